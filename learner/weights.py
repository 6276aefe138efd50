"""Weight blobs: model state <-> safetensors bytes/files, and publishing a WeightVersion.

Guarantees:
- `state_to_bytes` is deterministic for the same parameters and stores each tied
  tensor once; `load_state_bytes` loads it back strictly (only tied aliases may be
  absent) so a blob for another architecture fails loudly.
- `state_segments` is the same safetensors layout (same tensor order, same header, so
  the same bytes as `state_to_bytes` for the dtypes in `ST_DTYPES`) as a list of
  buffers: the header, then each tensor's OWN memory (zero-copy). It exists only for
  CPU-contiguous tensors; otherwise (GPU, exotic dtype) publishing falls back to
  `state_to_bytes`.
- `publish_version` stores the blob first (NATS object store, a `file://` directory
  or `s3://`, see `make_store`), then announces it on `weights.<run>` and in KV
  `weights.latest`: a reader never sees an announcement whose blob is missing. A LoRA
  policy publishes only its adapter (`learner.lora.adapter_blob`, self-describing).
  The full state is handed to the store as `state_segments` (no intermediate bytes):
  the caller must not modify the model until `publish_version` returns (the learner
  publishes between steps).
- The announcement carries only URI + sha256 (+ size, dtype); `fetch_weights` reads any
  of the three stores and raises `ChecksumMismatch` unless the bytes hash to the
  announced sha256. `file://` writes go to a unique temp file, renamed into place
  (atomic on one filesystem; no fsync: a machine crash can lose the newest version,
  never expose a torn one under its final name). The sha256 is computed over the same
  buffers that are written, in a low-priority thread (`in_background_thread`) while
  they are written. Given a core connection `nc`, a `file://` version also sends a
  `WeightPrefetch` (version, uri, size; no sha256) on `weights.<run>.prefetch` the
  moment the file is complete under its final name, before its hash is done; the
  WeightVersion follows once it is. The hint is not stored: speculative rollout workers
  start loading on it, and nothing they generate leaves them before the WeightVersion
  arrived and their own hash of the loaded bytes matched it.
- `load_state_file(model, path, sha256, staging)` is the zero-copy read of a `file://`
  blob: it reads each tensor's bytes straight into a reused staging tensor of the
  model's dtype/shape (`readinto`, no intermediate bytes), hashes exactly the bytes
  read (header included), and only if they hash to `sha256` makes the staging tensors
  the model's parameters/buffers (swap; the previous storage becomes the next staging
  buffer, so a worker holds the weights twice). On a mismatch it raises
  `ChecksumMismatch` and the model is untouched. It returns False without touching the
  model when the file does not fit that path (LoRA adapter blob, dtype/shape/device
  mismatch, non-contiguous parameter): the caller then uses the generic
  `fetch_weights` + `load_state_bytes`, which converts dtypes or fails loudly. Names are
  checked as strictly as `load_state_bytes` (unexpected or missing non-tied: ValueError).
- `load_state_file_speculative(model, path, staging)` is the same load WITHOUT the hash
  on the critical path, and by default without the copy: tensors viewing a private
  (copy-on-write) memory map of the file, every page faulted in, become the model's
  weights at once (misaligned tensors: read into staging tensors instead). The file must
  not be rewritten in place while mapped (the file store never does). The returned
  `SpeculativeLoad` holds the previous weights (out of `staging`, so no later read can
  overwrite them) until it is settled: `digest()` (in a thread) hashes exactly the bytes
  that serve, then `commit()` (match: the previous weights are released, kept as staging
  buffers after a read) or `rollback()` (mismatch: the previous weights are the model's
  again). Until then the
  worker holds the weights twice, and a caller must treat the new weights as unverified
  (the rollout worker publishes nothing generated with them before the check passed,
  see `rollout_workers.weights_watch`). Structural faults (truncated, padded, unreadable
  header) still raise ChecksumMismatch before anything is swapped; it returns None
  (model untouched) where `load_state_file` would return False, and also when tied
  aliases could not be kept by swapping (use `load_state_file`, verify-first).
- `s3://` needs boto3; without it `make_store`/`fetch_weights` raise a clear error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import struct
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import structlog

from bus.kv import WEIGHTS_LATEST, put_json
from bus.objects import ChecksumMismatch, get_blob, put_blob, put_segments, sha256_hex, sha256_segments
from bus.publish import publish
from bus.subjects import Registry
from learner.retention import version_name
from schemas import WeightPrefetch, WeightVersion, encode

log = structlog.get_logger()
BACKGROUND_NICE = 10  # nice increment of integrity-hash threads (see in_background_thread)


def state_tensors(model) -> dict:
    """The model's state to publish: each tensor once (tied aliases dropped), detached, no copy."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        tensors[name] = tensor.detach()
    return tensors


def state_to_bytes(model) -> bytes:
    """Serialize a torch model's parameters and buffers as safetensors bytes (tied tensors once)."""
    from safetensors.torch import save

    return save({k: v.to("cpu").contiguous() for k, v in state_tensors(model).items()})


# torch dtype name -> safetensors dtype; the order of safetensors' Dtype enum (its writer
# puts tensors in descending dtype order, then by name).
ST_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
             "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32",
             "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64"}
_ST_RANK = {st: i for i, st in enumerate(ST_DTYPES.values())}


def _st_dtype(tensor) -> str | None:
    return ST_DTYPES.get(str(tensor.dtype).replace("torch.", ""))


def _byte_view(tensor) -> memoryview:
    """The tensor's own memory as bytes (CPU, contiguous; no copy)."""
    return memoryview(tensor.reshape(-1).view(__import__("torch").uint8).numpy())


def state_segments(tensors: dict, metadata: dict | None = None) -> list[memoryview] | None:
    """A safetensors file as buffers (header, then each tensor's memory, zero-copy), laid out
    as safetensors' own writer does; None unless every tensor is CPU, contiguous, known dtype."""
    entries = []
    for name, t in tensors.items():
        st = _st_dtype(t)
        if st is None or t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
            return None
        entries.append((name, t, st))
    entries.sort(key=lambda e: (-_ST_RANK[e[2]], e[0]))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    segments, offset = [], 0
    for name, t, st in entries:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": st, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
        if n:
            segments.append(_byte_view(t))
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return [memoryview(struct.pack("<Q", len(raw)) + raw), *segments]


def model_segments(model) -> list:
    """What a version publishes, as buffers: the adapter alone for a LoRA policy, else the
    full state (zero-copy where `state_segments` can, else serialized)."""
    from learner.lora import adapter_blob, is_lora

    if is_lora(model):
        return [memoryview(adapter_blob(model))]
    return state_segments(state_tensors(model)) or [memoryview(state_to_bytes(model))]


def in_background_thread(fn, *args) -> concurrent.futures.Future:
    """Run `fn(*args)` in a new thread at lowered CPU priority (Linux per-thread nice +10);
    its Future. For integrity work off the critical path (hashing a weight file): the
    process's own training or generation, and a loader's read, take the CPU first. A new
    thread, not a pool's: a thread's nice cannot be lowered back without privileges."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed: same work, normal priority
            pass
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=f"bg-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return fut


def _write_file_atomic(path: Path, segments: list) -> int:
    """Write the concatenated segments to a unique temp file renamed to `path`; the size."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    size = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for seg in segments:
                mv = memoryview(seg).cast("B")
                while len(mv):
                    n = os.write(fd, mv)
                    size += n
                    mv = mv[n:]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def write_segments_file(path: Path, segments: list) -> tuple[str, int]:
    """Write the concatenated segments to `path` atomically (unique temp file + rename) while
    a thread hashes the same buffers; (sha256, size). Returns only after the hash is done
    (the buffers may then change)."""
    digest = in_background_thread(sha256_segments, segments)
    try:
        size = _write_file_atomic(path, segments)
    finally:
        concurrent.futures.wait([digest])
    return digest.result(), size


def load_state_bytes(model, blob: bytes) -> None:
    """Load safetensors bytes into `model` in place (no restart)."""
    import torch
    from safetensors.torch import load

    tensors = load(blob)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {name for name in missing if _is_tied_alias(model, name, tensors)}
    if unexpected or set(missing) - tied:
        raise ValueError(f"weight blob does not fit the model: missing={sorted(set(missing) - tied)[:5]} "
                         f"unexpected={sorted(unexpected)[:5]}")
    with torch.no_grad():
        model.tie_weights() if hasattr(model, "tie_weights") else None


def _is_tied_alias(model, name: str, tensors: dict) -> bool:
    sd = model.state_dict()
    ptr = sd[name].data_ptr()
    return any(sd[other].data_ptr() == ptr for other in tensors if other in sd and other != name)


class NatsStore:
    """The run's JetStream object store."""

    def __init__(self, js, bucket: str):
        self.js, self.bucket = js, bucket

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Store `data`; (uri, sha256, size)."""
        return await put_blob(self.js, self.bucket, name, data)

    async def put_segments(self, name: str, segments: list) -> tuple[str, str, int]:
        """Store the concatenated buffers (chunked straight from them); (uri, sha256, size)."""
        return await put_segments(self.js, self.bucket, name, segments)

    async def names(self) -> list[str]:
        """Names of the objects stored (deleted ones excluded)."""
        from nats.js.errors import NotFoundError

        try:
            infos = await (await self.js.object_store(self.bucket)).list(ignore_deletes=True)
        except NotFoundError:  # nats-py's answer for an empty bucket
            return []
        return [i.name for i in infos if not i.deleted]

    async def delete(self, name: str) -> None:
        """Delete object `name` (its chunks are purged; a missing one is no error)."""
        from nats.js.errors import NotFoundError

        try:
            await (await self.js.object_store(self.bucket)).delete(name)
        except NotFoundError:
            pass


class FileStore:
    """A directory on a filesystem every reader mounts (local disk, NFS, a shared volume)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Write `data` atomically as `root/name`; (file:// uri, sha256, size)."""
        return await self.put_segments(name, [memoryview(data)])

    async def put_segments(self, name: str, segments: list, on_written=None) -> tuple[str, str, int]:
        """Write the concatenated buffers atomically as `root/name` (no joined copy) while a
        low-priority thread hashes them; (uri, sha256, size). `on_written(uri, size)` (async)
        is awaited as soon as the file is complete under its final name, before the hash
        is done (the prefetch hint); its failure is logged, not raised. Returns only after
        the hash is done (the buffers may then change)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = (self.root / name).resolve()
        digest = in_background_thread(sha256_segments, segments)
        try:
            size = await asyncio.to_thread(_write_file_atomic, path, segments)
            if on_written is not None:
                try:
                    await on_written(path.as_uri(), size)
                except Exception as exc:  # noqa: BLE001 - a lost hint costs latency only
                    log.warning("learner.weights_prefetch_failed", uri=path.as_uri(), error=str(exc))
        finally:
            await asyncio.wait([asyncio.wrap_future(digest)])
        return path.as_uri(), digest.result(), size

    async def names(self) -> list[str]:
        """Names of the files in the directory (temp files of unfinished writes excluded)."""
        if not self.root.is_dir():
            return []
        return [p.name for p in await asyncio.to_thread(lambda: list(self.root.iterdir())) if not p.name.startswith(".")]

    async def delete(self, name: str) -> None:
        """Unlink `root/name` (a missing file is no error). A reader that already opened or
        mapped it keeps reading it: the file lives on until it is closed."""
        await asyncio.to_thread((self.root / name).unlink, True)


def _boto3_client():
    try:
        import boto3
    except ImportError as exc:
        raise RuntimeError("s3:// weight stores need boto3: pip install boto3") from exc
    return boto3.client("s3")


class S3Store:
    """An S3 (or S3-compatible, via the usual AWS_* environment) bucket and key prefix."""

    def __init__(self, bucket: str, prefix: str = ""):
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), _boto3_client()

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Upload `data`; (s3:// uri, sha256, size)."""
        key = self._key(name)
        await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}", sha256_hex(data), len(data)

    async def put_segments(self, name: str, segments: list) -> tuple[str, str, int]:
        """Upload the concatenated buffers (joined: boto3 wants one body); (s3:// uri, sha256, size)."""
        return await self.put(name, b"".join(segments))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    async def names(self) -> list[str]:
        """Names (keys without the prefix) under the prefix."""
        def list_all() -> list[str]:
            out, start = [], (self.prefix + "/") if self.prefix else ""
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                out += [o["Key"][len(start):] for o in page.get("Contents", [])]
            return out
        return await asyncio.to_thread(list_all)

    async def delete(self, name: str) -> None:
        """Delete the object (S3 answers a missing key with success)."""
        await asyncio.to_thread(self.client.delete_object, Bucket=self.bucket, Key=self._key(name))


def make_store(spec: str, js=None, reg: Registry | None = None):
    """The store of `learner.weight_store`: `nats`, `file:///dir` or `s3://bucket/prefix`."""
    if spec == "nats":
        if js is None or reg is None:
            raise ValueError("the nats weight store needs a JetStream context and the run registry")
        return NatsStore(js, reg.object_bucket)
    parsed = urlparse(spec)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"weight_store {spec!r}: file URIs need an absolute path, e.g. file:///data/weights")
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, parsed.path)
    raise ValueError(f"unknown weight_store {spec!r}: expected 'nats', 'file:///dir' or 's3://bucket/prefix'")


async def fetch_weights(uri: str, sha256: str, js=None, reg: Registry | None = None) -> bytes:
    """The blob at `uri` (nats-object://, file://, s3://), checked against `sha256`.

    Raises `bus.objects.ChecksumMismatch` when the bytes do not hash to `sha256`.
    `reg` is accepted for symmetry with the publishing side (the URI names the bucket).
    """
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        return await get_blob(js, uri, sha256)
    obj = await asyncio.to_thread(_boto3_client().get_object, Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))
    data = await asyncio.to_thread(obj["Body"].read)
    if sha256_hex(data) != sha256:
        raise ChecksumMismatch(f"{uri}: sha256 {sha256_hex(data)} != announced {sha256}")
    return data


def model_blob(model) -> bytes:
    """What a version publishes: the adapter alone for a LoRA policy, else the full state."""
    from learner.lora import adapter_blob, is_lora

    return adapter_blob(model) if is_lora(model) else state_to_bytes(model)


async def publish_version(js, reg: Registry, model, version: int, step: int, metrics: dict[str, float],
                          store=None, nc=None) -> WeightVersion:
    """Store the model's weights (in `store`, default the run's object store) and announce them as `version`.

    With a `FileStore` and a core connection `nc`, a `WeightPrefetch` goes out on
    `reg.weights_prefetch` as soon as the file is complete, before its sha256 is."""
    store = store or NatsStore(js, reg.object_bucket)
    name = version_name(version)

    async def prefetch(uri: str, size: int) -> None:
        hint = WeightPrefetch(run_id=reg.run_id, version=version, step=step, uri=uri, bytes=size)
        await nc.publish(reg.weights_prefetch, encode(hint))
        await nc.flush()

    if model is None:
        uri, sha, size = await store.put(name, b"null-policy")
    elif isinstance(store, FileStore):
        uri, sha, size = await store.put_segments(name, await asyncio.to_thread(model_segments, model),
                                                  on_written=prefetch if nc is not None else None)
    elif hasattr(store, "put_segments"):
        uri, sha, size = await store.put_segments(name, await asyncio.to_thread(model_segments, model))
    else:  # a store with only put(name, bytes)
        uri, sha, size = await store.put(name, await asyncio.to_thread(model_blob, model))
    wv = WeightVersion(run_id=reg.run_id, version=version, step=step, uri=uri, sha256=sha, bytes=size,
                       dtype=str(next(model.parameters()).dtype).replace("torch.", "") if model is not None else "none",
                       metrics=metrics)
    await publish(js, reg.weights, wv)
    await put_json(js, reg, WEIGHTS_LATEST, {"version": version, "msg_id": wv.msg_id, "uri": uri,
                                             "sha256": sha, "step": step, "published_at": time.time()})
    return wv


# ---------------------------------------------------------------------------- zero-copy file load
def _readinto_full(f, mv: memoryview) -> None:
    while len(mv):
        n = f.readinto(mv)
        if not n:
            raise ChecksumMismatch(f"{f.name}: file ends early")
        mv = mv[n:]


def _resolve(model, name: str):
    """The Parameter or buffer object behind a state_dict name (None if neither)."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    if attr in module._parameters:
        return module._parameters[attr]
    return module._buffers.get(attr)


def _file_plan(model, header: dict, data_len: int):
    """([(name, target tensor, begin, end)] in file order, swap) if every tensor of the file can
    be read straight into the model's tensor of the same name, dtype and shape on CPU, the data
    is covered without holes, and every state name missing from the file is a tied alias of one
    in it; None otherwise (the generic path then converts, or raises as `load_state_bytes`)."""
    sd = model.state_dict()
    if any(k not in sd for k in header):
        return None
    plan, by_ptr = [], {}
    for name, spec in header.items():
        target = _resolve(model, name)
        if target is None:
            return None
        t = target.data
        if (_st_dtype(t) != spec.get("dtype") or list(t.shape) != spec.get("shape") or t.device.type != "cpu"
                or not t.is_contiguous()):
            return None
        begin, end = spec["data_offsets"]
        if end - begin != t.numel() * t.element_size():
            return None
        plan.append((name, target, begin, end))
        by_ptr[t.data_ptr()] = target
    plan.sort(key=lambda e: e[2])
    pos = 0
    for _, _, begin, end in plan:
        if begin != pos:
            return None
        pos = end
    missing = [k for k in sd if k not in header]
    if pos != data_len or any(sd[k].data_ptr() not in by_ptr for k in missing):
        return None
    # swapping storages keeps a tie only if every alias IS the same tensor object
    swap = all(_resolve(model, k) is by_ptr[sd[k].data_ptr()] for k in missing)
    return plan, swap


def _open_file_plan(f, path, model):
    """(prefix bytes, plan, swap) of an open safetensors file positioned after its header, or
    None when the fast path does not apply (LoRA adapter, layout that does not fit the model);
    raises ChecksumMismatch for a file that cannot be the announced one (truncated, padded,
    unreadable header)."""
    file_size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise ChecksumMismatch(f"{path}: not a safetensors file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > min(file_size - 8, 100 << 20):
        raise ChecksumMismatch(f"{path}: header length {n} does not fit a {file_size}-byte file")
    raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ChecksumMismatch(f"{path}: unreadable safetensors header ({exc})") from exc
    meta = header.pop("__metadata__", None) or {}
    if meta.get("rlbus.kind", "full") != "full":
        return None
    try:
        data_end = max((int(spec["data_offsets"][1]) for spec in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ChecksumMismatch(f"{path}: malformed safetensors header ({exc!r})") from exc
    if data_end != file_size - 8 - n:  # truncated or padded: cannot be the announced file
        raise ChecksumMismatch(f"{path}: header describes {data_end} data bytes, file has {file_size - 8 - n}")
    planned = _file_plan(model, header, file_size - 8 - n)
    if planned is None:
        return None
    return head + raw, *planned


def _read_plan(f, path, plan, staging: dict, h=None) -> dict:
    """Read every planned tensor into its staging buffer (allocated when missing, of another
    shape/dtype, or aliasing the live tensor), hashing the bytes into `h` if given; the
    buffers by name. The file must end exactly there."""
    import torch

    bufs = {}
    for name, target, begin, end in plan:
        buf = staging.get(name)
        t = target.data
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.data_ptr() == t.data_ptr():
            buf = staging[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
        if end > begin:
            mv = _byte_view(buf)
            _readinto_full(f, mv)
            if h is not None:
                h.update(mv)
        bufs[name] = buf
    if f.read(1):
        raise ChecksumMismatch(f"{path}: trailing bytes after the tensor data")
    return bufs


def load_state_file(model, path: str | Path, sha256: str, staging: dict) -> bool:
    """Zero-copy load of a safetensors file into `model` (see the module guarantees). `staging`
    is the caller's reusable dict of staging tensors. True if loaded, False if the fast path
    does not apply (model untouched); raises ChecksumMismatch (model untouched)."""
    import torch

    with open(path, "rb", buffering=0) as f:
        opened = _open_file_plan(f, path, model)
        if opened is None:
            return False
        prefix, plan, swap = opened
        h = hashlib.sha256(prefix)
        _read_plan(f, path, plan, staging, h)
    actual = h.hexdigest()
    if actual != sha256:
        raise ChecksumMismatch(f"{Path(path).as_uri()}: sha256 {actual} != announced {sha256}")
    with torch.no_grad():
        for name, target, _, _ in plan:
            new = staging[name]
            if swap:
                staging[name] = target.data
                target.data = new
            else:
                target.copy_(new)
    return True


class SpeculativeLoad:
    """A file's weights already swapped into the model, their sha256 not yet checked.

    Holds the previous weights (taken OUT of the staging dict, so no later read can
    overwrite them) until `commit()` (verified: the previous weights are released, as
    staging buffers for a later read when the new ones were read, not mapped) or
    `rollback()` (mismatch: they are the model's weights again). `digest()` hashes exactly
    the bytes that serve (header, then each tensor in file order), from the tensors now
    serving; nothing may write them meanwhile (inference only reads its weights)."""

    def __init__(self, path: str, prefix: bytes, plan: list, new: dict, previous: dict, staging: dict,
                 mapped: bool = False):
        self.path, self._prefix, self._plan = path, prefix, plan
        self._new, self._previous, self._staging = new, previous, staging
        self.mapped, self.settled = mapped, False

    def digest(self) -> str:
        """sha256 (hex) of the file's bytes as loaded (hashlib releases the GIL: run it in a thread)."""
        h = hashlib.sha256(self._prefix)
        for name, _, begin, end in self._plan:
            if end > begin:
                h.update(_byte_view(self._new[name]))
        return h.hexdigest()

    def commit(self) -> None:
        """Verified: keep the new weights; release the previous ones."""
        if self.settled:
            return
        if not self.mapped:  # read loads reuse them as staging buffers
            self._staging.update(self._previous)
        self._previous, self.settled = {}, True

    def rollback(self) -> None:
        """Rejected: the previous weights are the model's again (read, not mapped, new weights
        become staging buffers)."""
        if self.settled:
            return
        import torch

        with torch.no_grad():
            for name, target, _, _ in self._plan:
                target.data = self._previous[name]
        if not self.mapped:
            self._staging.update(self._new)
        self._new, self._previous, self.settled = {}, {}, True


PAGE = 4096


def _map_plan(path, prefix: bytes, plan: list) -> dict | None:
    """Tensors viewing a private (copy-on-write) memory map of the file, one per planned
    name, with every page already faulted in; None when a tensor's offset is not aligned to
    its element size (the caller reads instead)."""
    import torch

    size = os.stat(path).st_size
    base = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # MAP_PRIVATE
    start, views = len(prefix), {}
    for name, target, begin, end in plan:
        t = target.data
        if (start + begin) % t.element_size():
            return None
        views[name] = base[start + begin:start + end].view(t.dtype).view(t.shape)
    if size:
        int(base[::PAGE].sum())  # fault every page in now, not in the first forward pass
    return views


def load_state_file_speculative(model, path: str | Path, staging: dict, mapped: bool = True
                                ) -> SpeculativeLoad | None:
    """Swap a safetensors file's tensors into `model` at once, before any hashing; the
    returned `SpeculativeLoad` verifies (`digest`) and settles it (`commit` or `rollback`).

    `mapped` (default): the new tensors view a private memory map of the file (no copy: the
    page cache serves them; every page faulted in before the swap). The file must not be
    rewritten in place while mapped (the file store never does: a new file per version,
    renamed into place; truncating a mapped file would crash the reader with SIGBUS).
    Falls back to reading when a tensor is misaligned. Not mapped: read into staging
    tensors (`readinto`). None when the file does not fit the zero-copy path, or when tied
    aliases cannot be kept by swapping (the caller then uses the verify-first
    `load_state_file`); model untouched. Raises ChecksumMismatch (model untouched) for a
    file that cannot be the announced one (truncated, padded, unreadable header)."""
    import torch

    with open(path, "rb", buffering=0) as f:
        opened = _open_file_plan(f, path, model)
        if opened is None or not opened[2]:
            return None
        prefix, plan, _ = opened
        new = _map_plan(path, prefix, plan) if mapped else None
        mapped = new is not None
        if new is None:
            new = _read_plan(f, path, plan, staging)
    previous = {}
    with torch.no_grad():
        for name, target, _, _ in plan:
            previous[name] = target.data
            target.data = new[name]
            staging.pop(name, None)  # the previous weights are held by the SpeculativeLoad, not staged
    return SpeculativeLoad(str(path), prefix, plan, new, previous, staging, mapped=mapped)
