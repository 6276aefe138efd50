"""Checks of a domain's `params` table, shared by the built-in kinds.

Guarantees: a bad value or an unknown key is a ValueError at start-up that names the
domain, the key and what it accepts; nothing is silently ignored.
"""

from __future__ import annotations


def share_param(domain: str, params: dict, key: str, known: tuple[str, ...]) -> float:
    """`params[key]` as a share in [0, 1] (default 0); unknown keys or a bad value raise
    ValueError naming the domain and what to write."""
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"domain {domain!r}: unknown params {unknown}; this kind takes {list(known)}")
    value = params.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"domain {domain!r}: params.{key} must be a number in [0, 1], got {value!r}")
    return float(value)
