"""Weight blobs: model state <-> safetensors bytes, and publishing a WeightVersion.

Guarantees:
- `state_to_bytes` is deterministic for the same parameters and stores each tied
  tensor once; `load_state_bytes` loads it back strictly (only tied aliases may be
  absent) so a blob for another architecture fails loudly.
- `publish_version` stores the blob in the run's object store first, then announces it
  on `weights.<run>` and in KV `weights.latest`: a reader never sees an announcement
  whose blob is missing.
"""

from __future__ import annotations

import time

from bus.kv import WEIGHTS_LATEST, put_json
from bus.objects import put_blob
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


async def publish_version(js, reg: Registry, model, version: int, step: int, metrics: dict[str, float]) -> WeightVersion:
    """Store the model's weights and announce them as `version`."""
    blob = state_to_bytes(model) if model is not None else b"null-policy"
    uri, sha, size = await put_blob(js, reg.object_bucket, f"v{version:06d}.safetensors", blob)
    wv = WeightVersion(run_id=reg.run_id, version=version, step=step, uri=uri, sha256=sha, bytes=size,
                       dtype=str(next(model.parameters()).dtype).replace("torch.", "") if model is not None else "none",
                       metrics=metrics)
    await publish(js, reg.weights, wv)
    await put_json(js, reg, WEIGHTS_LATEST, {"version": version, "msg_id": wv.msg_id, "uri": uri,
                                             "sha256": sha, "step": step, "published_at": time.time()})
    return wv
