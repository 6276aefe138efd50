"""The tiny Qwen2 model the weight tests publish, load and perturb and the helpers that
compare weights (tests/test_weights.py, test_weight_fastpath.py, test_weight_speculative.py,
test_weight_prefetch.py). `model_dir` is a pytest fixture: a test module imports it
to get one model directory per module."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

TINY = dict(hidden_size=32, num_layers=1, num_heads=2)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    """A tiny qwen2 checkpoint (TINY sizes), built once per test session (shared, read-only)."""
    return tiny_model(**TINY)


def load_model(path):
    """The checkpoint at `path`, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(path).eval()


def perturb(model, seed: int, scale: float = 0.1) -> None:
    """Add seeded gaussian noise (std `scale`) to every parameter, in place: same seed, same change."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def same_weights(a, b) -> bool:
    """Two models hold exactly the same state (names and values)."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def snapshot(model) -> dict:
    """A detached copy of the model's state."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def equals_snapshot(model, snap: dict) -> bool:
    """The model's state is exactly `snap` (see `snapshot`)."""
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


def tied(model) -> bool:
    """Input embeddings and lm_head are still one tensor."""
    return model.get_input_embeddings().weight is model.lm_head.weight


async def until(check, timeout: float = 10.0) -> None:
    """Poll `check()` every 20 ms until true; fail the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
