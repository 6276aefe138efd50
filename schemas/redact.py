"""Credentials out of URLs before anything stores or logs them (issue 27).

A NATS URL (`nats://user:password@host:4222`, or several comma-separated) or a database
URL (`postgresql://user:password@host/db`) may carry a password. Files in the run folder
(`config.json`, `run.json`, `run.db`), the wandb config, worker argv (world-readable in
/proc) and log lines get the redacted form; the full URL reaches child processes by
environment only (`RLBUS_NATS_URL`, `RLBUS_DB_URL`), whose /proc entry only the same
user can read.

Guarantees:
- `redact_url(url)` keeps scheme, user, host, port, path and query, and replaces every
  password in it with `REDACTED` ("***"); a NATS URL's bare userinfo (`nats://TOKEN@host`,
  a token login) is replaced whole. A URL without a secret comes back unchanged, and so
  does any string that is not a URL. It never raises.
- `is_redacted(url)` is true when some server of `url` carries the `***` password: such
  a URL cannot log in, and readers must take the real one from the environment.
- `redact_tree(obj)` returns a copy of a JSON-like tree (dicts, lists, strings) with
  `redact_url` applied to every string; other values are kept.
- `strip_credentials(url)` drops user and password, for URLs read back from the run
  folder: the login then comes from `RLBUS_NATS_USER`/`RLBUS_NATS_PASSWORD` (bus.conn).
"""

from __future__ import annotations

import re

REDACTED = "***"
NATS_URL_ENV = "RLBUS_NATS_URL"
"""Environment variable through which `rlbus up` hands workers the full NATS URL (not argv)."""

# scheme://user:password@ : the password is everything after the first ':' of the userinfo
# up to the last '@' before the host (a password may itself hold '@' when unquoted)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://(?P<user>[^:/@,\s]*)):(?P<pw>[^/,\s]*)@")


# nats://TOKEN@host (also tls://, ws://, wss://): a userinfo without ':' is a token
_TOKEN = re.compile(r"(?P<head>(?:nats|tls|ws|wss)://)(?P<tok>[^:/@,\s]+)@")


def redact_url(url: str) -> str:
    """`url` with each password (or NATS token) replaced by `***` (every server of a comma-separated list)."""
    if not isinstance(url, str) or "@" not in url:
        return url
    url = _USERINFO.sub(lambda m: f"{m['head']}:{REDACTED}@" if m["pw"] else m[0], url)
    return _TOKEN.sub(lambda m: m[0] if m["tok"] == REDACTED else f"{m['head']}{REDACTED}@", url)


def is_redacted(url: str) -> bool:
    """Whether `url` carries a redacted (`***`) password and so cannot log in as it is."""
    return isinstance(url, str) and (
        any(m["pw"] == REDACTED for m in _USERINFO.finditer(url))
        or any(m["tok"] == REDACTED for m in _TOKEN.finditer(url))
    )


def strip_credentials(url: str) -> str:
    """`url` without user and password (`nats://host:4222`); other parts unchanged."""
    if not isinstance(url, str) or "@" not in url:
        return url
    url = _USERINFO.sub(lambda m: m["head"][: -len(m["user"])] if m["user"] else m["head"], url)
    return _TOKEN.sub(lambda m: m["head"], url)


def redact_tree(obj):
    """A copy of a JSON-like tree with every string passed through `redact_url`."""
    if isinstance(obj, str):
        return redact_url(obj)
    if isinstance(obj, dict):
        return {k: redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_tree(v) for v in obj]
    return obj
