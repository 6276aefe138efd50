"""The tiny Qwen2 model the weight tests publish, load and perturb (tests/test_weights.py,
tests/test_weight_fastpath.py). `model_dir` is a pytest fixture: a test module imports it
to get one model directory per module."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbus.tiny_model import build_tiny_model

TINY = dict(hidden_size=32, num_layers=1, num_heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny qwen2 checkpoint (TINY sizes), built once per test module."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", **TINY)


def load_model(path):
    """The checkpoint at `path`, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(path).eval()


def perturb(model, seed: int, scale: float = 0.1) -> None:
    """Add seeded gaussian noise (std `scale`) to every parameter, in place: same seed, same change."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
