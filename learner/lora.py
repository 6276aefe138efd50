"""LoRA adapters through `peft`: train adapters only, publish only adapter weights.

Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685: a frozen weight ``W`` gets a trainable update ``(alpha / r) * B A``
(``B`` zero-initialised, so the wrapped model starts equal to the base).

Guarantees:
- `wrap_lora` freezes every base parameter; only the adapters are trainable.
- `adapter_blob` is a safetensors blob holding only the adapter tensors, with the
  adapter config in the header metadata: the self-describing format of
  `bus.weight_blobs` (`blob_kind`, `apply_adapter_blob`, `merged_state_blob`), which
  the loading side uses without importing the learner.
"""

from __future__ import annotations

import json

from bus.weight_blobs import KIND_KEY, META_KEY

__all__ = ["adapter_blob", "adapter_meta", "is_lora", "wrap_lora"]


def wrap_lora(model, *, rank: int, alpha: float, dropout: float = 0.0, target_modules=("q_proj", "v_proj")):
    """Wrap a causal LM with LoRA adapters (base frozen); returns the peft model."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )
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
    return {
        "r": c.r,
        "lora_alpha": c.lora_alpha,
        "lora_dropout": c.lora_dropout,
        "target_modules": sorted(c.target_modules),
        "bias": c.bias,
    }


def adapter_blob(model) -> bytes:
    """Safetensors bytes of the adapter tensors only, config in the header metadata."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    state = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return save(state, metadata={KIND_KEY: "lora", META_KEY: json.dumps(adapter_meta(model))})
