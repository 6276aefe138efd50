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
