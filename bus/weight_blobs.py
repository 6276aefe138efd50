"""Weight blobs: a torch model's state <-> safetensors bytes, and the LoRA adapter blob format.

Every role that holds a policy (learner publishing, rollout loading, evaluation, export)
speaks this one format; torch, safetensors and peft are imported only inside the
functions that need them.

Guarantees:
- `state_to_bytes` is deterministic for the same parameters and stores each tied
  tensor once; `load_state_bytes` loads it back strictly (only tied aliases may be
  absent) so a blob for another architecture fails loudly.
- `state_segments` is the same safetensors layout (same tensor order, same header, so
  the same bytes as `state_to_bytes` for the dtypes in `ST_DTYPES`) as a list of
  buffers: the header, then each tensor's OWN memory (zero-copy). It exists only for
  CPU-contiguous tensors; otherwise it returns None and the caller serializes.
- A blob describes itself: an adapter blob carries `rlbus.kind = "lora"` and its
  config (`rlbus.lora`) in the safetensors header metadata; `blob_kind` tells it from a
  full state blob without a schema field.
- `apply_adapter_blob(base, blob)` never modifies `base`: it adapts a deep copy and (by
  default) merges, returning a plain model whose logits equal the trained peft model's
  (up to float rounding); `merged_state_blob` turns that into a full-state blob.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import uuid
from pathlib import Path

KIND_KEY, META_KEY = "rlbus.kind", "rlbus.lora"  # safetensors header metadata of an adapter blob


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
ST_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}
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


def load_state_bytes(model, blob: bytes) -> None:
    """Load safetensors bytes into `model` in place (no restart)."""
    import torch
    from safetensors.torch import load

    tensors = load(blob)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {name for name in missing if _is_tied_alias(model, name, tensors)}
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"weight blob does not fit the model: missing={sorted(set(missing) - tied)[:5]} "
            f"unexpected={sorted(unexpected)[:5]}"
        )
    with torch.no_grad():
        model.tie_weights() if hasattr(model, "tie_weights") else None


def _is_tied_alias(model, name: str, tensors: dict) -> bool:
    sd = model.state_dict()
    ptr = sd[name].data_ptr()
    return any(sd[other].data_ptr() == ptr for other in tensors if other in sd and other != name)


def _header_metadata(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]).get("__metadata__", {}) or {}


def blob_kind(blob: bytes) -> str:
    """`lora` for an adapter blob, `full` for a full state blob."""
    return _header_metadata(blob).get(KIND_KEY, "full")


def apply_adapter_blob(base_model, blob: bytes, meta: dict | None = None, *, merge: bool = True):
    """A copy of `base_model` with the adapter applied (merged into plain weights by default;
    `merge=False` keeps the peft model). `meta` defaults to the config stored in the blob."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load

    meta = meta or json.loads(_header_metadata(blob)[META_KEY])
    model = get_peft_model(copy.deepcopy(base_model), LoraConfig(task_type="CAUSAL_LM", **meta))
    result = set_peft_model_state_dict(model, load(blob))
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"adapter blob does not fit the base model: unexpected={unexpected[:5]}")
    return model.merge_and_unload() if merge else model


def merged_state_blob(base_model, blob: bytes) -> bytes:
    """Full-state safetensors blob of `base_model` with the adapter merged in."""
    return state_to_bytes(apply_adapter_blob(base_model, blob))


def write_file_atomic(path: Path, segments: list) -> int:
    """Write the concatenated segments (blob segments, as `state_segments` gives them) to a unique temp file renamed to `path`; the size."""
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
