"""Verifier-only task data (gold answers, unit tests) behind `Task.hidden_ref`.

The sampler stores each task's hidden payload in the run's `hidden-<run>` KV bucket
before it publishes the task; only verifiers resolve a `hidden_ref` back to it. Rollout
workers have no code path that reads this bucket (and, with per-role NATS permissions,
no right to), so gold and tests never reach the policy's prompt, sandbox or trajectory.

Guarantees:
- `hidden_ref_for(domain, key)` is deterministic (the same problem always gets the same
  ref) and a valid KV key whatever characters the problem id holds.
- `put_hidden` writes msgpack; writing the same ref twice is harmless (same bytes).
- `get_hidden` raises `HiddenDataMissing` naming the ref and bucket when it is absent,
  so a verifier reports `infra_error` (retry, then dead letter) instead of a reward of 0.
- `HiddenCache` resolves each ref from the server at most once per process.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgpack
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError

from bus.subjects import Registry

_SAFE = re.compile(r"[^A-Za-z0-9_\-=]")


class HiddenDataMissing(LookupError):
    """A task names hidden data the run's hidden bucket does not hold."""


def hidden_ref_for(domain: str, key: str) -> str:
    """The ref of `domain`'s problem `key`: readable, KV-safe, collision-free via a short hash."""
    digest = hashlib.sha256(f"{domain}\0{key}".encode()).hexdigest()[:12]
    return f"{_SAFE.sub('_', domain)}.{_SAFE.sub('_', key)[:80]}.{digest}"


async def put_hidden(js: JetStreamContext, reg: Registry, ref: str, data: dict[str, Any]) -> None:
    """Store `data` (msgpack-able) under `ref`."""
    kv = await js.key_value(reg.hidden_bucket)
    await kv.put(ref, msgpack.packb(data, use_bin_type=True))


async def get_hidden(js: JetStreamContext, reg: Registry, ref: str) -> dict[str, Any]:
    """The hidden payload of `ref` (HiddenDataMissing if absent)."""
    kv = await js.key_value(reg.hidden_bucket)
    try:
        entry = await kv.get(ref)
    except (KeyNotFoundError, NotFoundError):
        entry = None
    if entry is None or not entry.value:
        raise HiddenDataMissing(f"hidden data {ref!r} not in bucket {reg.hidden_bucket!r} "
                                "(was the task published by this run's sampler?)")
    return msgpack.unpackb(entry.value, raw=False)


class HiddenCache:
    """Per-process cache in front of `get_hidden` (hidden data never changes within a run)."""

    def __init__(self, js: JetStreamContext, reg: Registry, max_entries: int = 4096) -> None:
        self.js, self.reg, self.max_entries = js, reg, max_entries
        self._data: dict[str, dict[str, Any]] = {}

    async def get(self, ref: str) -> dict[str, Any]:
        if ref not in self._data:
            if len(self._data) >= self.max_entries:
                self._data.pop(next(iter(self._data)))
            self._data[ref] = await get_hidden(self.js, self.reg, ref)
        return self._data[ref]
