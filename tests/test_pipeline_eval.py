"""Evaluation through the pipeline: `purpose=eval` tasks go through real rollout and verifier
worker processes, their rewards come back to the scheduler's collector, and the learner
never trains on them."""

from __future__ import annotations

import pytest

from bus.conn import ensure_topology
from bus.kv import LEARNER_PROGRESS, get_json
from bus.subjects import Registry
from producers.domains import arith
from scheduler.evaluation import EvalSuite
from scheduler.pipeline_eval import PipelineEval, eval_tasks
from schemas.config import load_config
from tests.conftest import eventually

pytestmark = pytest.mark.usefixtures("drop_run")

CONFIG = """
[sampler]
max_tokens = 4
[rollout]
engine = "null"
[learner]
policy = "null"
[scheduler.eval]
n = 12
difficulty = 1
mode = "pipeline"
timeout_s = 60
"""


def test_eval_tasks_are_greedy_eval_purpose_with_stable_ids(tmp_path):
    cfg = load_config(None, [])
    suite = EvalSuite.from_config(load_config(_write(tmp_path)))
    tasks = eval_tasks(suite, "r1", 7)
    assert len(tasks) == 12 and {t.purpose for t in tasks} == {"eval"} and {t.temperature for t in tasks} == {0.0}
    assert tasks[0].msg_id == "ev7.arith.0-rr1" and eval_tasks(suite, "r1", 7)[0].msg_id == tasks[0].msg_id
    assert cfg.scheduler.eval.mode == "local"  # the default


def _write(tmp_path):
    path = tmp_path / "pe.toml"
    path.write_text(CONFIG)
    return path


async def test_round_through_rollout_and_verifier_workers(js, run_id, tmp_path, spawn_worker):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    config = _write(tmp_path)
    learner = spawn_worker("learner", run_id, config)  # publishes version 0, acks eval rewards untrained
    spawn_worker("rollout", run_id, config)
    spawn_worker("verifier", run_id, config)
    cfg = load_config(config)
    suite = EvalSuite.from_config(cfg)
    pe = PipelineEval(js, reg, suite, timeout_s=60)
    await pe.start()
    try:
        scores, version = await pe.evaluate()
    finally:
        await pe.stop()
    # the null engine answers "0": the score is exactly the share of problems whose answer is 0
    es = suite.sets["arith"]
    want = sum(it.gold == 0 for it in es.items) / len(es)
    assert pe.last["tasks"] == pe.last["rewards"] == 12, pe.last  # every eval reward came back
    assert scores["arith"][:2] == (want, 12) and version == 0
    assert [it.task.verifier_params["expression"] for it in es.items] == [
        p.expression for p in arith.heldout_set(cfg.scheduler.eval.seed, 12, 1)
    ]

    async def learner_skipped_them():
        progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
        info = await js.consumer_info(reg.stream("REWARDS"), "learner")
        return info.num_ack_pending == 0 and info.num_pending == 0 and progress.get("samples_trained", 0) == 0

    await eventually(learner_skipped_them, 30, "the learner to ack the eval rewards without training", tmp_path)
    assert learner.poll() is None


async def test_round_is_abandoned_when_stop_is_set(js, run_id, tmp_path):
    """At shutdown the rollout and verifier workers go first: a round in flight can never
    finish, so `stop` must end it at once, with no score (not a score of missing = wrong)."""
    import asyncio
    import time

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    suite = EvalSuite.from_config(load_config(_write(tmp_path)))
    pe = PipelineEval(js, reg, suite, timeout_s=600)  # no worker runs: the round would wait 600 s
    await pe.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(1.0, stop.set)
    t0 = time.monotonic()
    try:
        result = await pe.evaluate(stop=stop)
    finally:
        await pe.stop()
    assert result is None and time.monotonic() - t0 < 10
    assert pe.rounds == {} and pe.last["tasks"] == 12 and pe.last["rewards"] == 0
    # without a stop, a round that times out reports its missing problems as wrong
    pe.timeout_s = 1.0
    await pe.start()
    try:
        scores, version = await pe.evaluate()
    finally:
        await pe.stop()
    assert scores["arith"][:2] == (0.0, 12) and version is None


TRAINING = """
[sampler]
group_size = 2
max_inflight_tasks = 32
publish_batch = 16
[sampler.domains.quick]
kind = "sleep"
params = { seconds = 0.2 }
[rollout]
engine = "sleep"
batch_tasks = 2
[rollout.priority]
min_share = 0.5
[verifier]
concurrency = 0
[learner]
policy = "null"
groups_per_step = 2
step_window_s = 0.5
max_staleness = 100000
checkpoint_every = 1000000
"""


@pytest.mark.e2e
async def test_learner_steps_go_on_during_an_eval_round(js, run_id, tmp_path, spawn_worker):
    """Eval beside training: a round's tasks ride the `eval` class on the same rollout worker that
    keeps taking training tasks (min_share 0.5: one of each per batch of 2), and the learner keeps
    stepping from the first eval task published to the last eval reward."""
    import time

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    training = tmp_path / "train.toml"
    training.write_text(TRAINING)
    for role in ("learner", "sampler", "rollout", "verifier"):
        spawn_worker(role, run_id, training)

    async def step() -> int:
        return int((await get_json(js, reg, LEARNER_PROGRESS) or {}).get("step", 0))

    async def training_flows():
        return await step() >= 2

    await eventually(training_flows, 90, "the learner's first steps", tmp_path)
    suite = EvalSuite.from_config(load_config(_write(tmp_path)))  # 12 arith problems, pipeline mode
    pe = PipelineEval(js, reg, suite, timeout_s=120)
    assert pe.priority == "eval"
    await pe.start()
    try:
        before, t0 = await step(), time.monotonic()
        scores, _ = await pe.evaluate()
        after, seconds = await step(), time.monotonic() - t0
    finally:
        await pe.stop()
    assert pe.last["tasks"] == pe.last["rewards"] == 12, pe.last  # the round completed
    assert after >= before + 2, (before, after, seconds)  # steps went on during it
    assert scores["arith"][1] == 12
