"""Verifier-only task data (gold answers, unit tests) behind `Task.hidden_ref`.

The sampler stores each task's hidden payload in the run's `hidden-<run>` KV bucket
before it publishes the task; only verifiers resolve a `hidden_ref` back to it. Rollout
workers have no code path that reads this bucket (and, with per-role NATS permissions,
no right to), so gold and tests never reach the policy's prompt, sandbox or trajectory.

Guarantees:
- `hidden_ref_for(domain, key)` is deterministic (the same problem always gets the same
  ref) and a valid KV key whatever characters the problem id holds.
- `put_hidden` writes msgpack; writing the same ref twice is harmless (same bytes).
- Large payloads (a repository task's tree and hidden tests) may exceed NATS's max payload
  (1 MiB by default): a payload over `INLINE_MAX` bytes is stored as chunks of at most
  `CHUNK_BYTES` under `<ref>.c<i>` in the SAME bucket, written first, and then `ref` holds
  a reference `{"__chunks__": n, "sha256": ..., "size": ...}`; `get_hidden` reassembles them
  and checks size and sha256 (a mismatch or a missing chunk raises `HiddenDataMissing`:
  an infra error, retried). Chunks stay in the hidden bucket, so the policy side, which
  has no right to that bucket (`bus.auth`), can no more read a large payload than a small
  one. (The run's object store is readable by rollout workers, since weights live there,
  so hidden data never goes to it.)
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

from bus.cache import LoadOnce
from bus.subjects import Registry

_SAFE = re.compile(r"[^A-Za-z0-9_\-=]")


class HiddenDataMissing(LookupError):
    """A task names hidden data the run's hidden bucket does not hold."""


def hidden_ref_for(domain: str, key: str) -> str:
    """The ref of `domain`'s problem `key`: readable, KV-safe, collision-free via a short hash."""
    digest = hashlib.sha256(f"{domain}\0{key}".encode()).hexdigest()[:12]
    return f"{_SAFE.sub('_', domain)}.{_SAFE.sub('_', key)[:80]}.{digest}"


INLINE_MAX = 512 * 1024
"""Largest payload stored as one KV value; larger ones are chunked (module guarantees)."""
CHUNK_BYTES = 512 * 1024
CHUNKS_KEY = "__chunks__"


async def put_hidden(
    js: JetStreamContext,
    reg: Registry,
    ref: str,
    data: dict[str, Any],
    inline_max: int = INLINE_MAX,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Store `data` (msgpack-able) under `ref` (chunked when over `inline_max` bytes)."""
    kv = await js.key_value(reg.hidden_bucket)
    blob = msgpack.packb(data, use_bin_type=True)
    if len(blob) <= inline_max:
        await kv.put(ref, blob)
        return
    n = (len(blob) + chunk_bytes - 1) // chunk_bytes
    for i in range(n):
        await kv.put(f"{ref}.c{i}", blob[i * chunk_bytes : (i + 1) * chunk_bytes])
    head = {CHUNKS_KEY: n, "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    await kv.put(ref, msgpack.packb(head, use_bin_type=True))


async def _value(kv, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, NotFoundError):
        return None
    return entry.value if entry is not None and entry.value else None


async def get_hidden(js: JetStreamContext, reg: Registry, ref: str) -> dict[str, Any]:
    """The hidden payload of `ref` (HiddenDataMissing if absent, or its chunks are incomplete)."""
    kv = await js.key_value(reg.hidden_bucket)
    raw = await _value(kv, ref)
    if raw is None:
        raise HiddenDataMissing(
            f"hidden data {ref!r} not in bucket {reg.hidden_bucket!r} (was the task published by this run's sampler?)"
        )
    data = msgpack.unpackb(raw, raw=False)
    if not (isinstance(data, dict) and CHUNKS_KEY in data and len(data) == 3):
        return data
    parts = [await _value(kv, f"{ref}.c{i}") for i in range(int(data[CHUNKS_KEY]))]
    blob = b"".join(p for p in parts if p is not None)
    if None in parts or len(blob) != data["size"] or hashlib.sha256(blob).hexdigest() != data["sha256"]:
        raise HiddenDataMissing(f"hidden data {ref!r}: chunks missing or corrupt in bucket {reg.hidden_bucket!r}")
    return msgpack.unpackb(blob, raw=False)


class HiddenCache:
    """Per-process cache in front of `get_hidden` (hidden data never changes within a run); the
    trajectories of one task, verified at once, read it once (`bus.cache.LoadOnce`)."""

    def __init__(self, js: JetStreamContext, reg: Registry, max_entries: int = 4096) -> None:
        self.js, self.reg, self.max_entries = js, reg, max_entries
        self._data: LoadOnce[str, dict[str, Any]] = LoadOnce(lambda ref: get_hidden(js, reg, ref), max_entries)

    async def get(self, ref: str) -> dict[str, Any]:
        return await self._data.get(ref)
