"""Weight updates in flight (`rollout.inflight`, rollout_workers/inflight.py) on the hf engine and the tiny model.

- Under fixed weights a turn generated in chunks equals the one-call turn: same ids, same
  finish reasons and texts, log-probs within 1e-4 (greedy; seeded sampling while every row runs
  every chunk), with and without the prefix cache; end-of-sequence mid-chunk and a stop string
  split by a chunk boundary end the turn where the one-call turn ends.
- After a mid-turn update the trajectory's version runs say which version made each token, and
  the learner's recomputed log-probs (pack_samples + token_logprobs) match the recorded ones
  under each token's own version; staleness counts from the oldest run.
- The prefix cache never reuses one version's keys/values under another (cleared and salted).
- Versions published faster than they load (real NATS, speculative watcher) never stall a turn.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from bus.conn import ensure_topology
from bus.subjects import Registry
from bus.weight_blobs import state_to_bytes
from bus.weight_stores import FileStore
from learner.batch import pack_samples, token_logprobs
from learner.groups import Group, PooledSample, split_stale
from learner.weights import publish_version
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.engines.prefix_cache import PrefixCache
from rollout_workers.inflight import Inflight, cut_runs, generate_turn
from rollout_workers.weights_watch import WeightWatcher
from rollout_workers.worker import single_turn_trajectories
from schemas import Reward, Trajectory, Turn, decode, encode, pack_f32, pack_i32
from tests.messages import make_task
from tests.tiny_weights import load_model, perturb

TINY = dict(hidden_size=64, num_layers=2, num_heads=4)
PROMPT = "Compute 12+7 and answer."
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(**TINY)


def turn(engine, n, max_tokens, temperature, inflight=None, prompt=PROMPT, seed=0):
    torch.manual_seed(seed)
    return asyncio.run(generate_turn(engine, [prompt], n, max_tokens, temperature, inflight))[0]


def assert_same(full, chunked):
    for a, b in zip(full, chunked, strict=True):
        assert b.token_ids.tolist() == a.token_ids.tolist()
        assert b.prompt_ids.tolist() == a.prompt_ids.tolist()
        assert (b.finish_reason, b.text) == (a.finish_reason, a.text)
        assert float(np.abs(a.logprobs - b.logprobs).max()) <= TOL
        assert b.runs == [(0, len(b.token_ids))]


def full_rows_seed(engine, n, max_tokens) -> int:
    """A seed whose sampled rows all run to max_tokens (the precondition of seeded equality)."""
    for seed in range(50):
        if all(len(s.token_ids) == max_tokens for s in turn(engine, n, max_tokens, 1.0, seed=seed)):
            return seed
    raise AssertionError("no seed in 50 keeps every row to max_tokens")


@pytest.mark.parametrize("reuse", [False, True], ids=["full-prefill", "prefix-reuse"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_turn_equals_one_call_under_fixed_weights(model_dir, reuse, chunk):
    engine = HFEngine(str(model_dir), prefix_reuse=reuse)
    fixed = Inflight(chunk, version=lambda: 0)
    assert_same(turn(engine, 3, 10, 0.0), turn(engine, 3, 10, 0.0, fixed))  # greedy
    seed = full_rows_seed(engine, 3, 10)
    assert_same(turn(engine, 3, 10, 1.0, seed=seed), turn(engine, 3, 10, 1.0, fixed, seed=seed))  # seeded sampling
    if reuse:
        assert engine.prefix.hits > 0  # later chunks continued the earlier ones' cache


def test_end_of_sequence_mid_chunk_and_split_stop_string(model_dir):
    engine = HFEngine(str(model_dir))
    ids = turn(engine, 1, 12, 0.0)[0].token_ids.tolist()
    eos = ids[4]
    engine.eos_id = eos  # the model now "ends" where it wrote that token first: inside chunk 2 of 3-token chunks
    full = turn(engine, 1, 12, 0.0)
    assert full[0].finish_reason == "stop" and len(full[0].token_ids) == ids.index(eos) + 1
    assert_same(full, turn(engine, 1, 12, 0.0, Inflight(3, version=lambda: 0)))

    engine = HFEngine(str(model_dir))
    text = engine.decode(ids)
    stop = engine.decode(ids[2:4])  # split by the boundary after token 3
    assert stop and stop in text
    engine.stop = [stop]  # as vLLM's stop strings: the chunked driver reads `engine.stop`
    (s,) = turn(engine, 1, 12, 0.0, Inflight(3, version=lambda: 0))
    k = next(k for k in range(1, len(ids) + 1) if stop in engine.decode(ids[:k]))
    assert s.token_ids.tolist() == ids[:k] and s.finish_reason == "stop" and s.runs == [(0, k)]
    assert s.text == text[: text.index(stop) + len(stop)]


def test_cut_runs():
    assert cut_runs([(0, 4), (1, 8)], 6) == [(0, 4), (1, 2)]
    assert cut_runs([(0, 4), (1, 8)], 4) == [(0, 4)]
    assert cut_runs([(3, 5)], 5) == [(3, 5)]


def _perturbed_blob(model_dir, seed: int) -> bytes:
    model = load_model(model_dir)
    perturb(model, seed, scale=0.2)
    return state_to_bytes(model)


@pytest.mark.parametrize("reuse", [False, True], ids=["full-prefill", "prefix-reuse"])
def test_mid_turn_update_runs_and_learner_logprobs(model_dir, reuse):
    engine = HFEngine(str(model_dir), prefix_reuse=reuse)
    blob = _perturbed_blob(model_dir, 7)
    state = {"v": 0}

    async def refresh():  # v1 is announced while chunk 1 generates: loaded at the first boundary
        if state["v"] == 0:
            await asyncio.to_thread(engine.load_weights, blob)
            state["v"] = 1

    seed = full_rows_seed(HFEngine(str(model_dir)), 2, 12)
    samples = turn(engine, 2, 12, 1.0, Inflight(4, version=lambda: state["v"], refresh=refresh), seed=seed)
    if reuse:
        # chunk 2 (v1) reused nothing of chunk 1 (v0); chunk 3 (v1) continued chunk 2: one hit per row
        assert engine.prefix.hits == 2
    task = make_task("run-x", group_size=2, max_tokens=12)
    trajs = single_turn_trajectories(task, samples, 1, 0.0)
    for t in trajs:
        answer = t.turns[-1]
        assert answer.version_runs == [(0, 4), (1, 8)] and answer.policy_version == 1
        assert t.policy_version == 1 and t.oldest_version == 0
        assert decode(encode(t), Trajectory) == t  # msgpack round trip keeps the runs

    rewards = [Reward(run_id="run-x", trajectory=t, reward=1.0) for t in trajs]
    batch = pack_samples(rewards, engine.pad_id)
    v0, v1 = load_model(model_dir), load_model(model_dir)
    v1_engine = HFEngine(str(model_dir))
    v1_engine.load_weights(blob)
    v1.load_state_dict(v1_engine.model.state_dict())
    with torch.no_grad():
        lp0 = token_logprobs(v0, batch["input_ids"], batch["attention_mask"])
        lp1 = token_logprobs(v1, batch["input_ids"], batch["attention_mask"])
    for i, t in enumerate(trajs):
        start = len(t.turns[0].token_ids) // 4 - 1  # position p scores token p+1
        recorded = batch["behavior_logp"][i, start : start + 12]
        assert float((lp0[i, start : start + 4] - recorded[:4]).abs().max()) <= TOL  # v0 made tokens 0..3
        assert float((lp1[i, start + 4 : start + 12] - recorded[4:]).abs().max()) <= TOL  # v1 made 4..11
        assert float((lp1[i, start : start + 4] - recorded[:4]).abs().max()) > 10 * TOL  # and v1 did not make 0..3


def test_staleness_counts_from_the_oldest_run():
    task = make_task("run-x", group_size=1, max_tokens=6)
    ids, lps = pack_i32(range(6)), pack_f32([-1.0] * 6)
    prompt = Turn(role="prompt", text="p", token_ids=pack_i32([1, 2]))
    answer = Turn(
        role="assistant",
        text="a",
        token_ids=ids,
        logprobs=lps,
        trainable=True,
        policy_version=5,
        version_runs=[(2, 3), (5, 3)],
    )
    t = Trajectory.from_task(task, 0, [prompt, answer])
    assert (t.policy_version, t.oldest_version) == (5, 2)
    old = Trajectory.from_task(task, 0, [prompt, answer.model_copy(update={"version_runs": []})])
    assert old.oldest_version == 5  # no runs: as before in-flight updates
    group = Group(group_id=t.group_id, task_msg_id=t.task_msg_id, size=1, first_seen=0.0)
    group.samples[0] = PooledSample(reward=Reward(run_id="run-x", trajectory=t, reward=1.0), raw=None)
    assert [s.reward.trajectory for s in split_stale(group, current_version=5, max_staleness=2)] == [t]
    with pytest.raises(ValueError, match="cover 5 tokens"):
        Turn(role="assistant", text="a", token_ids=ids, policy_version=5, version_runs=[(2, 2), (5, 3)])
    with pytest.raises(ValueError, match="last run"):
        Turn(role="assistant", text="a", token_ids=ids, policy_version=4, version_runs=[(2, 3), (5, 3)])


def test_prefix_cache_is_salted_by_weight_epoch(model_dir):
    cache = PrefixCache(4)
    cache.put([1, 2, 3, 4], [], epoch=0)
    assert cache.lookup([1, 2, 3, 4, 5], epoch=1) == (0, None, None)  # another version's entry: never reused
    assert cache.lookup([1, 2, 3, 4, 5], epoch=0)[0] == 4
    engine = HFEngine(str(model_dir), prefix_reuse=True)
    before = engine._weights_seen
    engine.load_weights(_perturbed_blob(model_dir, 3))
    assert engine._weights_seen == before + 2  # as the load starts and once it is done


@pytest.mark.usefixtures("drop_run")
async def test_versions_published_faster_than_they_load_never_stall_a_turn(js, run_id, model_dir, tmp_path):
    """At every chunk boundary two versions are announced before the reload and a third while the
    reload runs (the episode paused for it): the turn takes the newest there is each time, skips
    the others, and always advances."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    store, publisher = FileStore(tmp_path / "w"), load_model(model_dir)
    watcher = WeightWatcher(js, reg, {}, speculative=True)
    await watcher.start()
    engine = HFEngine(str(model_dir))
    published = [0]

    async def publish_next():
        v = published[0] + 1
        perturb(publisher, v, scale=0.01)
        await publish_version(js, reg, publisher, v, v, {}, store=store)
        published[0] = v

    async def refresh():
        await publish_next()
        await publish_next()
        while watcher.newest_version < published[0]:
            await asyncio.sleep(0.005)
        await asyncio.gather(watcher.maybe_load(engine), publish_next())  # one more while paused for the reload

    try:
        await publish_version(js, reg, publisher, 0, 0, {}, store=store)
        while watcher.newest_version < 0:
            await asyncio.sleep(0.01)
        await watcher.maybe_load(engine)
        inflight = Inflight(2, lambda: watcher.version, refresh, watcher.load_lock)
        groups = await asyncio.wait_for(generate_turn(engine, [PROMPT], 2, 8, 0.0, inflight), 60)
        await watcher.settle()
    finally:
        await watcher.close()
    taken = set()
    for s in groups[0]:
        versions = [v for v, _ in s.runs]
        assert sum(k for _, k in s.runs) == len(s.token_ids) and versions == sorted(set(versions))
        taken |= set(versions)
    assert len(taken) >= 2, groups[0][0].runs  # new weights were taken mid-turn
    assert len(set(range(published[0] + 1)) - taken) >= len(taken)  # most announced versions were skipped


def test_agent_turn_cut_after_its_tool_call_keeps_the_runs_of_its_tokens(model_dir):
    from rollout_workers.agent import Episode, add_model_turn
    from rollout_workers.engines.sample import Sample

    engine = HFEngine(str(model_dir))
    ids = engine.encode("<py>print(1)</py> and more text after the call")
    call_len = len(engine.encode("<py>print(1)</py>"))
    assert engine.decode(ids[:call_len]) == "<py>print(1)</py>"
    sample = Sample(np.array([1, 2], np.int32), ids, np.full(len(ids), -0.5, np.float32), engine.decode(ids), "length")
    sample.runs = [(3, 4), (4, call_len - 4 + 2), (5, len(ids) - call_len - 2)]
    task = make_task("run-x", group_size=1, max_tokens=64, tools=["python"], max_turns=4)
    ep = Episode(task=task, sample_index=0, turns=[], context=[1, 2])
    call = add_model_turn(engine, ep, sample, 5, 0.0)
    assert call is not None and call.code.strip() == "print(1)"
    answer = ep.turns[-1]
    assert len(answer.token_ids) // 4 == call_len
    assert answer.version_runs == [(3, 4), (4, call_len - 4)] and answer.policy_version == 4


def test_run_episodes_in_chunks_records_runs_and_eval_tasks_stay_one_call(model_dir):
    from rollout_workers.agent import run_episodes

    engine = HFEngine(str(model_dir))
    inflight = Inflight(3, version=lambda: 2)
    for purpose, expect_runs in (("train", True), ("eval", False)):
        task = make_task("run-x", group_size=2, max_tokens=10, tools=["python"], max_turns=2, purpose=purpose)
        episodes = asyncio.run(
            run_episodes(engine, [task], version=lambda: 2, open_sandbox=None, inflight=inflight, slots=1)
        )
        for ep in episodes:
            for t in ep.turns:
                if t.role == "assistant":
                    assert t.policy_version == 2
                    assert bool(t.version_runs) == expect_runs
                    assert not expect_runs or t.version_runs == [(2, len(t.token_ids) // 4)]
