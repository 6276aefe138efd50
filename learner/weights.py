"""Weight blobs: model state <-> safetensors bytes, and publishing a WeightVersion.

Guarantees:
- `state_to_bytes` is deterministic for the same parameters and stores each tied
  tensor once; `load_state_bytes` loads it back strictly (only tied aliases may be
  absent) so a blob for another architecture fails loudly.
- `publish_version` stores the blob first (NATS object store, a `file://` directory
  or `s3://`, see `make_store`), then announces it on `weights.<run>` and in KV
  `weights.latest`: a reader never sees an announcement whose blob is missing. A LoRA
  policy publishes only its adapter (`learner.lora.adapter_blob`, self-describing).
- The announcement carries only URI + sha256 (+ size, dtype); `fetch_weights` reads any
  of the three stores and raises `ChecksumMismatch` unless the bytes hash to the
  announced sha256. `file://` writes are atomic (temp file + rename).
- `s3://` needs boto3; without it `make_store`/`fetch_weights` raise a clear error.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from urllib.parse import urlparse

from bus.kv import WEIGHTS_LATEST, put_json
from bus.objects import ChecksumMismatch, get_blob, put_blob, sha256_hex
from bus.publish import publish
from bus.subjects import Registry
from schemas import WeightVersion


def state_to_bytes(model) -> bytes:
    """Serialize a torch model's parameters and buffers as safetensors bytes (tied tensors once)."""
    from safetensors.torch import save

    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return save(tensors)


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


class FileStore:
    """A directory on a filesystem every reader mounts (local disk, NFS, a shared volume)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    async def put(self, name: str, data: bytes) -> tuple[str, str, int]:
        """Write `data` atomically as `root/name`; (file:// uri, sha256, size)."""
        return await asyncio.to_thread(self._write, name, data)

    def _write(self, name: str, data: bytes) -> tuple[str, str, int]:
        self.root.mkdir(parents=True, exist_ok=True)
        path = (self.root / name).resolve()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path.as_uri(), sha256_hex(data), len(data)


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
        key = f"{self.prefix}/{name}" if self.prefix else name
        await asyncio.to_thread(self.client.put_object, Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}", sha256_hex(data), len(data)


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
                          store=None) -> WeightVersion:
    """Store the model's weights (in `store`, default the run's object store) and announce them as `version`."""
    store = store or NatsStore(js, reg.object_bucket)
    blob = await asyncio.to_thread(model_blob, model) if model is not None else b"null-policy"
    uri, sha, size = await store.put(f"v{version:06d}.safetensors", blob)
    wv = WeightVersion(run_id=reg.run_id, version=version, step=step, uri=uri, sha256=sha, bytes=size,
                       dtype=str(next(model.parameters()).dtype).replace("torch.", "") if model is not None else "none",
                       metrics=metrics)
    await publish(js, reg.weights, wv)
    await put_json(js, reg, WEIGHTS_LATEST, {"version": version, "msg_id": wv.msg_id, "uri": uri,
                                             "sha256": sha, "step": step, "published_at": time.time()})
    return wv
