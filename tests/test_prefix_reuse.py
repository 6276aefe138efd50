"""KV reuse across the turns of an episode (`rollout.hf.prefix_reuse`) changes nothing but speed.

Multi-turn episodes on the tiny model, driven as `rollout_workers.agent` drives the engine:
turn 1 is G samples of a shared text prompt in one call, every later turn is one call over
all live episodes' token-id contexts (the previous context, the model turn cut short as a
tool call cut is, and a tool observation's ids). With reuse on, the generated ids equal the
full-prefill engine's and the behaviour log-probs agree within 1e-4 (the token-fidelity
tolerance), greedy and sampled under the same torch seed; the cache is actually hit; a
weight load clears it; a prompt sharing nothing is prefilled in full. The vLLM engine's
arguments carry `rollout.vllm.prefix_caching`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlbus.model.tiny_model import build_tiny_model
from rollout_workers.engines import make_engine
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.engines.prefix_cache import PrefixCache, common_prefix
from schemas.config import RolloutSection

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("reuse") / "m", seed=5, **TINY)


def episodes(engine: HFEngine, temperature: float, turns: int = 4, group: int = 3):
    """Every call's samples (prompt ids, generated ids, log-probs) of `group` episodes."""
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    first = engine.generate(["Read the filing and answer: revenue 2023?"], group, 10, temperature)[0]
    contexts = [s.prompt_ids.tolist() + s.token_ids.tolist() for s in first]
    seen = [(s.prompt_ids.tolist(), s.token_ids.tolist(), s.logprobs) for s in first]
    for _ in range(turns - 1):
        for c in contexts:  # a tool observation of a few tokens
            c.extend(int(x) for x in rng.integers(5, 60, size=int(rng.integers(2, 9))))
        for c, (s,) in zip(contexts, engine.generate(contexts, 1, 10, temperature), strict=True):
            seen.append((s.prompt_ids.tolist(), s.token_ids.tolist(), s.logprobs))
            c.extend(int(x) for x in s.token_ids[: max(1, len(s.token_ids) - 3)])  # cut as after a call
    return seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reuse_equals_full_prefill(model_dir, temperature):
    full = episodes(HFEngine(str(model_dir)), temperature)
    engine = HFEngine(str(model_dir), prefix_reuse=True)
    reused = episodes(engine, temperature)
    assert [x[:2] for x in reused] == [x[:2] for x in full]
    diff = max(float(np.abs(a[2] - b[2]).max()) for a, b in zip(full, reused, strict=True))
    print(f"T={temperature}: max |dlogp| {diff:.1e}, hits {engine.prefix.hits}, reused {engine.prefix.reused_tokens}")
    assert diff <= 1e-4
    assert engine.prefix.hits == 9  # 3 episodes x 3 later turns, each continuing its own entry
    assert engine.prefix.reused_tokens > 3 * 3 * 10
    assert len(engine.prefix) == 3  # the continued entries were replaced, not kept beside


def test_weight_load_clears_and_unrelated_prompt_prefills(model_dir, tmp_path):
    engine = HFEngine(str(model_dir), prefix_reuse=True)
    s = engine.generate([[7, 8, 9, 10, 11]], 1, 6, 0.0)[0][0]
    assert len(engine.prefix) == 1
    other = engine.generate([[40, 41, 42]], 1, 6, 0.0)[0][0]  # shares no first token: full prefill
    assert engine.prefix.hits == 0 and other.prompt_ids.tolist() == [40, 41, 42]
    blob = (model_dir / "model.safetensors").read_bytes()
    engine.load_weights(blob)
    assert len(engine.prefix) == 0
    again = engine.generate([[7, 8, 9, 10, 11] + s.token_ids.tolist()], 1, 6, 0.0)[0][0]
    assert engine.prefix.hits == 0 and len(again.token_ids) > 0


def test_prefix_cache_bounds_and_lookup():
    cache = PrefixCache(max_entries=2)
    cache.put([1, 2, 3, 4], [])
    cache.put([1, 2, 9], [])
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4
    assert cache.lookup([1, 2, 3, 4])[0] == 3  # the last prompt token is always fed again
    assert cache.lookup([5, 1])[0] == 0
    cache.put([7], [])
    assert len(cache) == 2 and cache.lookup([1, 2, 9, 9])[0] == 2  # [1,2,3,4] (least recent) evicted
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    with pytest.raises(ValueError, match="max_entries"):
        PrefixCache(0)


def test_config_reaches_the_engines(model_dir):
    section = RolloutSection.model_validate({"engine": "hf", "hf": {"prefix_reuse": False}})
    assert make_engine(section, str(model_dir)).prefix is None
    assert RolloutSection().hf.prefix_reuse is True
    engine = make_engine(RolloutSection.model_validate({"hf": {"prefix_cache_entries": 5}}), str(model_dir))
    assert engine.prefix.max_entries == 5
    from rollout_workers.engines.vllm_engine import llm_kwargs

    opts = dict(
        seed=0,
        dtype="auto",
        enforce_eager=True,
        max_model_len=None,
        kv_cache_memory_mb=None,
        gpu_memory_utilization=0.3,
        max_num_seqs=None,
    )
    assert llm_kwargs("m", "standard", **opts)["enable_prefix_caching"] is True
    assert llm_kwargs("m", "standard", prefix_caching=False, **opts)["enable_prefix_caching"] is False
    assert RolloutSection.model_validate({"vllm": {"prefix_caching": False}}).vllm.prefix_caching is False


def test_a_call_a_weight_load_overlapped_keeps_nothing(model_dir):
    engine = HFEngine(str(model_dir), prefix_reuse=True)
    blob = (model_dir / "model.safetensors").read_bytes()
    generate = engine.model.generate

    def spanning(**kwargs):  # new weights arrive while the batch is generating
        out = generate(**kwargs)
        engine.load_weights(blob)
        return out

    engine.model.generate = spanning
    engine.generate([[7, 8, 9, 10, 11]], 1, 6, 0.0)
    assert len(engine.prefix) == 0
    engine.model.generate = generate
    engine.generate([[7, 8, 9, 10, 11]], 1, 6, 0.0)
    assert len(engine.prefix) == 1
