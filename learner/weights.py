"""Publishing a weight version: store the blob, then announce it.

Guarantees:
- `publish_version` stores the blob first (`bus.weight_stores`: NATS object store, a
  `file://` directory or `s3://`), then announces it on `weights.<run>` and in KV
  `weights.latest`: a reader never sees an announcement whose blob is missing.
- A LoRA policy publishes only its adapter (`learner.lora.adapter_blob`, self-describing);
  a full policy hands its state to the store as zero-copy buffers where it can
  (`bus.weight_blobs.state_segments`): the caller must not modify the model until
  `publish_version` returns (the learner publishes between steps).
- The announcement carries only URI + sha256 (+ size, dtype). With a `FileStore` and a
  core connection `nc`, a `WeightPrefetch` hint (no sha256, not stored) goes out on
  `weights.<run>.prefetch` the moment the file is complete, before its hash is done; the
  WeightVersion follows once it is.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from bus.kv import WEIGHTS_LATEST, put_json
from bus.publish import publish
from bus.subjects import Registry
from bus.weight_blobs import state_segments, state_tensors, state_to_bytes
from bus.weight_stores import FileStore, NatsStore
from learner.retention import version_name
from schemas import WeightPrefetch, WeightVersion, encode

log = structlog.get_logger()


def model_segments(model) -> list:
    """What a version publishes, as buffers: the adapter alone for a LoRA policy, else the
    full state (zero-copy where `state_segments` can, else serialized). `model` may also be
    a full state dict already gathered to CPU (a sharded learner's `full_state`)."""
    from learner.lora import adapter_blob, is_lora

    if isinstance(model, dict):
        from safetensors.torch import save

        return state_segments(model) or [memoryview(save({k: v.contiguous() for k, v in model.items()}))]
    if is_lora(model):
        return [memoryview(adapter_blob(model))]
    return state_segments(state_tensors(model)) or [memoryview(state_to_bytes(model))]


def weights_dtype(model) -> str:
    """The published dtype name ("float32"), "none" for the null policy."""
    if model is None:
        return "none"
    first = next(iter(model.values())) if isinstance(model, dict) else next(model.parameters())
    return str(first.dtype).replace("torch.", "")


async def publish_version(
    js, reg: Registry, model, version: int, step: int, metrics: dict[str, float], store=None, nc=None
) -> WeightVersion:
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
        uri, sha, size = await store.put_segments(
            name, await asyncio.to_thread(model_segments, model), on_written=prefetch if nc is not None else None
        )
    else:
        uri, sha, size = await store.put_segments(name, await asyncio.to_thread(model_segments, model))
    wv = WeightVersion(
        run_id=reg.run_id,
        version=version,
        step=step,
        uri=uri,
        sha256=sha,
        bytes=size,
        dtype=weights_dtype(model),
        metrics=metrics,
    )
    await publish(js, reg.weights, wv)
    await put_json(
        js,
        reg,
        WEIGHTS_LATEST,
        {"version": version, "msg_id": wv.msg_id, "uri": uri, "sha256": sha, "step": step, "published_at": time.time()},
    )
    return wv
