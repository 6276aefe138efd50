"""Public payloads too large for a message, by reference: a repository tree, a trajectory's diff.

A NATS message holds at most the server's max_payload (1 MiB by default). A task whose
repository is larger than its domain's inline limit, or a trajectory whose artifact is larger
than `rollout.artifact_inline_bytes`, carries a `schemas.BlobRef` (uri, sha256, size) instead,
and the bytes live as an object in one of the run's two payload buckets, written and read with
`bus.objects` (chunked, sha256-checked):
- `workspace` (`Registry.workspace_bucket`, `workspaces-<run>`): task repositories, written only
  by the task publishers (sampler, scheduler);
- `artifact` (`Registry.artifact_bucket`, `artifacts-<run>`): trajectory artifacts, written by
  rollout. The verifier reads both (`bus.auth`), so the policy side can never plant or replace a
  repository that a task names.

Guarantees:
- Names are content addresses, `sha256-<hex sha256>`: the same bytes are one object however
  many tasks or trajectories name them. `put_payload` writes nothing only when the object of
  that name READS BACK as exactly those bytes (size and sha256 of the bytes themselves, not of
  the meta, which a writer of the bucket could have planted); otherwise it writes them, which
  repairs a planted or corrupt object.
- Each bucket has a byte cap (`Limits.workspaces_max_bytes`, `artifacts_max_bytes`): a flood of
  objects is refused at the cap instead of filling the store's disk.
- `put_payload` needs publish rights on its bucket's subjects only (no purge: see
  `bus.objects.put_segments(purge_replaced=False)`).
- `get_payload` returns the bytes only if their size and sha256 are the ref's; a missing
  object, a corrupt one, a ref into another run's bucket (or the other kind's, when a kind is
  asked for) or an unreachable store raises `PayloadUnavailable` naming the object (an
  infrastructure error for the caller: retried, then dead-lettered; never a reward).
- The payload buckets hold only public data (the repository the agent sees, what the policy
  wrote): hidden task data goes to the hidden KV bucket (`bus.hidden`), never here.
- Nothing deletes payload objects during a run (they go with the run: `bus.conn.delete_run`).
  Weight retention (`learner.retention`) works on the weight store alone and deletes only
  `vNNNNNN.safetensors` names, so it can reach neither these buckets nor these names.
- `pack_files` is deterministic (paths sorted), so the same tree is always the same object.
- A ref names its run's bucket: a task drawn under another run id (the scheduler's eval sets
  are drawn as run `eval`) is published with its ref `rebind`-ed to the publishing run, whose
  bucket the publisher stores the bytes in.
- `resolve_artifacts` gives a copy of a trajectory with its referenced artifacts inline
  (for scoring only: what is published keeps the refs, so no message grows past its limit).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgpack
from nats.js import JetStreamContext

from bus.objects import BlobGone, ChecksumMismatch, get_blob, put_blob
from bus.subjects import Registry
from schemas import BlobRef, Trajectory

NAME_PREFIX = "sha256-"


class PayloadUnavailable(LookupError):
    """A referenced payload is missing, corrupt, in another run's bucket, or the store is unreachable."""


def payload_name(sha256: str) -> str:
    """The object name of a payload whose content hashes to `sha256`."""
    return f"{NAME_PREFIX}{sha256}"


KINDS = ("workspace", "artifact")


def bucket_of(reg: Registry, kind: str) -> str:
    """The run's bucket of payload `kind` (`workspace` or `artifact`)."""
    if kind not in KINDS:
        raise ValueError(f"payload kind {kind!r}: one of {KINDS}")
    return reg.payload_buckets()[kind][0]


def payload_ref(reg: Registry, data: bytes, kind: str = "workspace") -> BlobRef:
    """The ref `data` gets in `reg`'s run as a payload of `kind` (computed, nothing stored)."""
    sha = hashlib.sha256(data).hexdigest()
    return BlobRef(uri=f"nats-object://{bucket_of(reg, kind)}/{payload_name(sha)}", sha256=sha, size=len(data))


def rebind(ref: BlobRef, reg: Registry, kind: str = "workspace") -> BlobRef:
    """The same payload's ref in `reg`'s run (a task drawn under one run id, published under another:
    the scheduler's eval sets are drawn as run `eval`); the bytes must be stored there too."""
    return BlobRef(
        uri=f"nats-object://{bucket_of(reg, kind)}/{payload_name(ref.sha256)}", sha256=ref.sha256, size=ref.size
    )


def pack_files(files: dict[str, str]) -> bytes:
    """A file tree (path -> UTF-8 text) as one payload: a msgpack map, paths sorted."""
    return msgpack.packb({p: files[p] for p in sorted(files)}, use_bin_type=True)


def unpack_files(data: bytes) -> dict[str, str]:
    """Inverse of `pack_files`; ValueError unless it is a map of str -> str."""
    try:
        files = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise ValueError(f"payload is not a msgpack file tree: {exc}") from None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError("payload is not a file tree (a map of path -> text)")
    return files


async def _holds(js: JetStreamContext, ref: BlobRef) -> bool:
    """Whether the object of `ref` reads back as exactly its bytes (size and sha256 of the bytes
    read, never the meta's say-so: a planted meta is repaired by the write that follows)."""
    try:
        data = await get_blob(js, ref.uri, ref.sha256)
    except Exception:  # noqa: BLE001 - missing, deleted, planted or corrupt: (re)write it
        return False
    return len(data) == ref.size


async def put_payload(js: JetStreamContext, reg: Registry, data: bytes, kind: str = "workspace") -> BlobRef:
    """Store `data` in the run's bucket of `kind` under its content address; its ref."""
    ref = payload_ref(reg, data, kind)
    if not await _holds(js, ref):
        await put_blob(js, bucket_of(reg, kind), payload_name(ref.sha256), data, purge_replaced=False)
    return ref


async def put_payloads(js: JetStreamContext, reg: Registry, blobs: dict[str, bytes], stored: set[str]) -> None:
    """Store every workspace blob of `blobs` (sha256 -> bytes) whose sha256 is not in `stored`, then add it there."""
    for sha, data in blobs.items():
        if sha not in stored:
            ref = await put_payload(js, reg, data, "workspace")
            if ref.sha256 != sha:
                raise ValueError(f"payload keyed {sha[:12]}... hashes to {ref.sha256[:12]}...")
            stored.add(sha)


async def get_payload(js: JetStreamContext, reg: Registry, ref: BlobRef, kind: str | None = None) -> bytes:
    """The bytes of `ref`, size and sha256 checked (else `PayloadUnavailable`); with `kind`, only
    from the run's bucket of that kind."""
    buckets = [bucket_of(reg, k) for k in (KINDS if kind is None else (kind,))]
    if not any(ref.uri.startswith(f"nats-object://{b}/") for b in buckets):
        raise PayloadUnavailable(f"{ref.uri}: not in this run's payload bucket(s) {buckets}")
    try:
        data = await get_blob(js, ref.uri, ref.sha256)
    except (BlobGone, ChecksumMismatch) as exc:
        raise PayloadUnavailable(f"payload {ref.uri}: {exc}") from exc
    except Exception as exc:
        raise PayloadUnavailable(f"payload {ref.uri}: {type(exc).__name__}: {exc}") from exc
    if len(data) != ref.size:
        raise PayloadUnavailable(f"payload {ref.uri}: {len(data)} bytes, the ref says {ref.size}")
    return data


class PayloadCache:
    """Resolved payloads by sha256, least recently used dropped past `max_bytes` (a process-local cache:
    a repository many tasks share is fetched once)."""

    def __init__(self, js: JetStreamContext, reg: Registry, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.js, self.reg, self.max_bytes = js, reg, max_bytes
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._bytes = 0

    async def get(self, ref: BlobRef, parse=None, kind: str | None = None) -> Any:
        """`parse(bytes)` of the payload (the bytes when `parse` is None), cached by sha256; `kind` as
        for `get_payload`."""
        if ref.sha256 in self._data:
            self._data.move_to_end(ref.sha256)
            return self._data[ref.sha256][1]
        data = await get_payload(self.js, self.reg, ref, kind)
        value = parse(data) if parse is not None else data
        self._data[ref.sha256] = (ref.size, value)
        self._bytes += ref.size
        while self._bytes > self.max_bytes and len(self._data) > 1:
            _, (size, _) = self._data.popitem(last=False)
            self._bytes -= size
        return value


async def resolve_artifacts(js: JetStreamContext, reg: Registry, traj: Trajectory) -> Trajectory:
    """`traj` itself when it has no `artifact_refs`, else a copy (never published: its wire map is
    dropped) whose `artifacts` hold every referenced one, checked (`PayloadUnavailable` if not)."""
    if not traj.artifact_refs:
        return traj
    artifacts = dict(traj.artifacts)
    for name, ref in traj.artifact_refs.items():
        artifacts[name] = await get_payload(js, reg, ref, "artifact")
    out = traj.model_copy(update={"artifacts": artifacts, "artifact_refs": {}})
    out._wire = None
    return out
