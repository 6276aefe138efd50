"""LoRA adapters through `peft`: train adapters only, publish only adapter weights.

Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685: a frozen weight ``W`` gets a trainable update ``(alpha / r) * B A``
(``B`` zero-initialised, so the wrapped model starts equal to the base).

Guarantees:
- `wrap_lora` freezes every base parameter; only the adapters are trainable.
- `adapter_blob` is a safetensors blob holding only the adapter tensors, with the
  adapter config in the safetensors header metadata (`rlbus.kind = "lora"`,
  `rlbus.lora = <json>`), so a blob describes itself: `blob_kind(blob)` tells a full
  state blob from an adapter blob without a schema field.
- `apply_adapter_blob(base, blob)` never modifies `base`: it adapts a deep copy and
  (by default) merges, returning a plain model whose logits equal the trained peft
  model's (up to float rounding). `merged_state_blob` turns that into a full-state blob
  any engine that loads full blobs (`learner.weights.load_state_bytes`) accepts.
"""

from __future__ import annotations

import copy
import json
import struct

__all__ = ["adapter_blob", "adapter_meta", "apply_adapter_blob", "blob_kind", "is_lora", "merged_state_blob",
           "wrap_lora"]

KIND_KEY, META_KEY = "rlbus.kind", "rlbus.lora"


def wrap_lora(model, *, rank: int, alpha: float, dropout: float = 0.0, target_modules=("q_proj", "v_proj")):
    """Wrap a causal LM with LoRA adapters (base frozen); returns the peft model."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                     task_type="CAUSAL_LM", bias="none")
    return get_peft_model(model, cfg)


def is_lora(model) -> bool:
    """Whether `model` is a peft model."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_meta(model) -> dict:
    """The adapter config needed to rebuild it on a fresh base (JSON-able)."""
    c = model.peft_config[model.active_adapter]
    return {"r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
            "target_modules": sorted(c.target_modules), "bias": c.bias}


def adapter_blob(model) -> bytes:
    """Safetensors bytes of the adapter tensors only, config in the header metadata."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    state = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return save(state, metadata={KIND_KEY: "lora", META_KEY: json.dumps(adapter_meta(model))})


def _header_metadata(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]).get("__metadata__", {}) or {}


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
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter blob does not fit the base model: unexpected={result.unexpected_keys[:5]}")
    return model.merge_and_unload() if merge else model


def merged_state_blob(base_model, blob: bytes) -> bytes:
    """Full-state safetensors blob of `base_model` with the adapter merged in."""
    from learner.weights import state_to_bytes

    return state_to_bytes(apply_adapter_blob(base_model, blob))
