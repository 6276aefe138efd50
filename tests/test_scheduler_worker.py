"""The scheduler worker on the real bus, with a tiny real model: it stops after
`max_messages` evaluations and shuts down in full (side tasks ended, recorder's last pass,
run marked `stopped`, store closed), and a scheduler stopped by SIGTERM before any weight
version exists shuts down the same way and exits 0."""

from __future__ import annotations

import asyncio
import signal

import pytest

from bus.conn import ensure_topology
from bus.kv import EVAL_BASELINE, get_json
from bus.session import WorkerContext
from bus.subjects import Registry
from learner.weights import publish_version
from rlbus.model.tiny_model import build_tiny_model
from scheduler.store import open_store
from scheduler.store_rows import EvalResultRow, RunRow
from scheduler.worker import run
from schemas.config import load_config
from tests.conftest import eventually, logs
from tests.tiny_weights import TINY, load_model, perturb

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards

CONFIG = """
[sampler]
max_tokens = 4
[scheduler.eval]
n = 4
every_versions = 1
[scheduler.curriculum]
every_s = 0.2
"""


def _config(tmp_path):
    path = tmp_path / "scheduler.toml"
    path.write_text(CONFIG)
    return path


def _stored(run_path, run_id) -> tuple[str, list[int]]:
    """(run status, evaluated versions) from the run store in `run_path`."""
    store = open_store(None, run_path)
    try:
        (row,) = store.rows(RunRow, run_id)
        return row.status, sorted(r.version for r in store.rows(EvalResultRow, run_id))
    finally:
        store.close()


async def test_scheduler_stops_after_max_evaluations_and_shuts_down(js, nats_url, run_id, tmp_path):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    run_path = tmp_path / "runs" / run_id
    start = build_tiny_model(run_path / "model" / "start", **TINY)
    model = load_model(start)
    perturb(model, seed=1)
    await publish_version(js, reg, model, version=1, step=3, metrics={})

    cfg = load_config(_config(tmp_path))
    ctx = WorkerContext(run_id=run_id, nats_url=nats_url, run_path=run_path, max_messages=2)
    # the baseline (version 0) and version 1 are the two evaluations; then it must return
    # on its own, without a stop signal
    counters = await asyncio.wait_for(run(cfg, ctx), 180)

    assert counters["evals"] == 2 and counters["eval_version"] == 1
    assert counters["max_deliveries_dead_lettered"] == 0  # the dead-letterer ended and reported
    assert "curriculum_version" in counters  # the curriculum was stopped and reported
    assert counters["recorded_eval"] >= 1  # the recorder ran (and its last pass was added)
    assert (await get_json(js, reg, EVAL_BASELINE))["version"] == 0
    status, versions = await asyncio.to_thread(_stored, run_path, run_id)
    assert status == "stopped"
    assert versions == [0, 1]


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
async def test_scheduler_stopped_before_any_version_shuts_down_in_full(js, run_id, tmp_path, spawn_worker):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    run_path = tmp_path / "runs" / run_id
    build_tiny_model(run_path / "model" / "start", **TINY)
    proc = spawn_worker("scheduler", run_id, _config(tmp_path))

    baseline = await eventually(lambda: get_json(js, reg, EVAL_BASELINE), 120, "the baseline eval", tmp_path)
    assert baseline["version"] == 0
    proc.send_signal(signal.SIGTERM)  # no weight version was ever published
    code = await asyncio.to_thread(proc.wait, 60)
    assert code == 0, logs(tmp_path)

    status, versions = await asyncio.to_thread(_stored, run_path, run_id)
    assert status == "stopped", logs(tmp_path)
    assert versions == [0]
