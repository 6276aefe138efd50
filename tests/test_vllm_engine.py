"""VLLMEngine on a real GPU: load, generate with behaviour logprobs, in-place weight updates.

Marked `gpu`; skipped (with the reason) where there is no CUDA device or no vLLM.
One engine per tier for the whole module (vLLM start-up is the slow part), closed after.
The CPU counterpart, run in CI, is tests/test_vllm_cpu.py (`make test-vllm`).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from bus.weight_blobs import state_to_bytes

HAS_CUDA = False
try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    pass

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (the gpu extra)"),
]

PROMPTS = ["12+34=", "7+5=", "40-13="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlbus.model.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden_size=128, num_layers=2, max_position_embeddings=64, seed=0
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    from rollout_workers.engines.vllm_engine import VLLMEngine

    with VLLMEngine(
        str(model_dir), "standard", gpu_memory_utilization=0.2, max_model_len=64, dtype="float32"
    ) as engine:
        yield engine


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def test_generate_shapes_and_logprobs(engine):
    out = engine.generate(PROMPTS, n=4, max_new_tokens=8, temperature=1.0)
    assert len(out) == len(PROMPTS) and all(len(g) == 4 for g in out)
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            assert s.prompt_ids.tolist() == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert 1 <= len(s.token_ids) <= 8 and len(s.logprobs) == len(s.token_ids)
            assert np.all(s.logprobs <= 1e-4) and np.all(np.isfinite(s.logprobs))
            assert s.finish_reason in ("stop", "length")
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == engine.eos_id


def test_behaviour_logprobs_match_hf(engine, model_dir):
    """vLLM's sampled-token logprobs agree with a torch forward pass of the same weights."""
    model = hf_model(model_dir)
    temperature = 0.7
    for s in [x for g in engine.generate(PROMPTS, n=2, max_new_tokens=6, temperature=temperature) for x in g]:
        ids = torch.tensor(np.concatenate([s.prompt_ids, s.token_ids]))[None].long()
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].float() / temperature
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids).long()[:, None]).squeeze(-1)
        np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=2e-2)


def test_weight_update_in_place_changes_and_restores_outputs(engine, model_dir):
    model = hf_model(model_dir)
    before = engine.generate(PROMPTS, n=1, max_new_tokens=8, temperature=0.0)
    original = state_to_bytes(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    engine.load_weights(state_to_bytes(model))  # all-zero weights: uniform next-token distribution
    zeroed = engine.generate(PROMPTS, n=1, max_new_tokens=4, temperature=0.0)
    uniform = -np.log(len(engine.tokenizer))
    for g in zeroed:
        np.testing.assert_allclose(g[0].logprobs, uniform, atol=1e-2)
    engine.load_weights(original)
    after = engine.generate(PROMPTS, n=1, max_new_tokens=8, temperature=0.0)
    assert [g[0].token_ids.tolist() for g in after] == [g[0].token_ids.tolist() for g in before]
    np.testing.assert_allclose(
        np.concatenate([g[0].logprobs for g in after]), np.concatenate([g[0].logprobs for g in before]), atol=1e-3
    )


def test_fast_tier_loads_generates_and_takes_weights(model_dir):
    from rollout_workers.engines.vllm_engine import VLLMEngine

    with VLLMEngine(str(model_dir), "fast", gpu_memory_utilization=0.2, max_model_len=64) as fast:
        out = fast.generate(PROMPTS, n=2, max_new_tokens=8, temperature=1.0)
        assert all(len(s.logprobs) == len(s.token_ids) for g in out for s in g)
        fast.load_weights(state_to_bytes(hf_model(model_dir)))
        assert len(fast.generate(PROMPTS, n=1, max_new_tokens=4, temperature=0.0)) == len(PROMPTS)
