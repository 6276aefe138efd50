"""Speculative weight loads (rollout_workers.weight_loading.load_state_file_speculative, HFEngine,
WeightWatcher(speculative=True)) and the rollout worker's publish gate
(rollout_workers.worker.roll_out_batch):

- a `file://` version serves as soon as it is read, before its sha256 check finished;
- a good version's trajectories are published only after that check passed;
- a corrupted file: the batch generated with it is not published, its tasks are retried
  (redelivered, then regenerated with the previous, good weights), the engine is back on
  the previous weights, and the version is rejected (never loaded again);
- the previous weights are never overwritten while a check is pending.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import threading
from pathlib import Path

import pytest
import torch

import rollout_workers.weight_loading as lw
import rollout_workers.worker as rw
from bus.conn import ensure_topology, pull_subscription
from bus.publish import publish
from bus.pull import run_pull_loop
from bus.streams import iter_stream
from bus.subjects import Registry
from bus.weight_stores import FileStore
from learner.weights import model_segments, publish_version
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.weight_loading import load_state_file_speculative
from rollout_workers.weights_watch import WeightWatcher
from schemas import Task, Trajectory, decode
from tests.messages import make_task
from tests.tiny_weights import equals_snapshot, load_model, model_dir, perturb, same_weights, snapshot, tied, until  # noqa: F401 - model_dir is a fixture


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # a byte inside the tensor data: the file still parses
    path.write_bytes(bytes(data))


class GatedDigest:
    """Holds every SpeculativeLoad.digest until `release()` (the check is "still running")."""

    def __init__(self, monkeypatch):
        self.go, self.started, self.calls = threading.Event(), threading.Event(), 0
        real = lw.SpeculativeLoad.digest

        def digest(load):
            self.calls += 1
            self.started.set()
            assert self.go.wait(30)
            return real(load)

        monkeypatch.setattr(lw.SpeculativeLoad, "digest", digest)

    def release(self) -> None:
        self.go.set()


# -- weight_loading / HFEngine --------------------------------------------------------------


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
async def test_speculative_load_swaps_first_then_commits_or_rolls_back(model_dir, tmp_path, mapped):
    src, dst = load_model(model_dir), load_model(model_dir)
    store = FileStore(tmp_path / "w")
    staging: dict = {}
    before = snapshot(dst)
    perturb(src, 1)
    uri, sha, _ = await store.put_segments("v1.safetensors", model_segments(src))
    load = load_state_file_speculative(dst, uri.removeprefix("file://"), staging, mapped=mapped)
    assert load is not None and load.mapped == mapped
    assert same_weights(src, dst) and tied(dst)  # serving the new weights, unverified
    assert load.digest() == sha
    assert not staging  # the previous weights are held by the load, not offered as staging buffers
    load.commit()
    # verified: read loads keep the previous weights as staging buffers, mapped ones release them
    assert bool(staging) == (not mapped) and same_weights(src, dst)

    perturb(src, 2)
    good = snapshot(dst)
    uri, sha, _ = await store.put_segments("v2.safetensors", model_segments(src))
    _corrupt(tmp_path / "w" / "v2.safetensors")
    load = load_state_file_speculative(dst, uri.removeprefix("file://"), staging, mapped=mapped)
    assert load is not None and not equals_snapshot(dst, good)  # the corrupt bytes are serving
    assert load.digest() != sha
    load.rollback()
    assert equals_snapshot(dst, good) and tied(dst)  # exactly the previous weights again
    assert not equals_snapshot(dst, before)


async def test_mapped_load_is_private_and_misaligned_files_are_read(model_dir, tmp_path):
    src, dst, dst2 = load_model(model_dir), load_model(model_dir), load_model(model_dir)
    perturb(src, 5)
    uri, sha, _ = await FileStore(tmp_path / "w").put_segments("v1.safetensors", model_segments(src))
    path = Path(uri.removeprefix("file://"))
    original = path.read_bytes()
    load = load_state_file_speculative(dst, str(path), {})
    assert load is not None and load.mapped and same_weights(src, dst)
    with torch.no_grad():
        next(dst.parameters()).add_(1.0)  # a private mapping: copy-on-write, the file is untouched
    assert path.read_bytes() == original and load.digest() != sha
    load.rollback()
    # a header one byte longer moves every tensor off its dtype alignment: read, not mapped
    (n,) = struct.unpack("<Q", original[:8])
    shifted = struct.pack("<Q", n + 1) + original[8 : 8 + n] + b" " + original[8 + n :]
    (tmp_path / "w" / "v2.safetensors").write_bytes(shifted)
    load2 = load_state_file_speculative(dst2, str(tmp_path / "w" / "v2.safetensors"), {})
    assert load2 is not None and not load2.mapped and same_weights(src, dst2)
    assert load2.digest() == hashlib.sha256(shifted).hexdigest()


async def test_engine_refuses_other_loads_while_a_check_is_pending(model_dir, tmp_path):
    src = load_model(model_dir)
    engine = HFEngine(str(model_dir), threads=1)
    store = FileStore(tmp_path / "w")
    perturb(src, 3)
    uri, sha, _ = await store.put_segments("v1.safetensors", model_segments(src))
    path = uri.removeprefix("file://")
    load = engine.load_weights_file_speculative(path)
    assert load is not None
    for other in (
        lambda: engine.load_weights_file(path, sha),
        lambda: engine.load_weights_file_speculative(path),
        lambda: engine.load_weights(b""),
    ):
        with pytest.raises(RuntimeError, match="not verified yet"):
            other()
    load.commit()
    assert engine.load_weights_file(path, sha)  # settled: loads again


async def test_speculative_declines_what_the_fast_path_declines(model_dir, tmp_path):
    src = load_model(model_dir)
    perturb(src, 4)
    uri, _, _ = await FileStore(tmp_path / "w").put_segments("v1.safetensors", model_segments(src))
    half = load_model(model_dir).to(torch.bfloat16)
    snap = snapshot(half)
    assert load_state_file_speculative(half, uri.removeprefix("file://"), {}) is None and equals_snapshot(half, snap)


async def _speculative_rig(js, run_id, model_dir, tmp_path, monkeypatch):
    """A run's topology, a file store, a publishing model, an engine and a started
    speculative watcher with its sha256 digests held by a GatedDigest."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    counters: dict[str, float] = {}
    watcher = WeightWatcher(js, reg, counters, speculative=True)
    await watcher.start()
    return (
        reg,
        FileStore(tmp_path / "w"),
        load_model(model_dir),
        HFEngine(str(model_dir), threads=1),
        counters,
        watcher,
        GatedDigest(monkeypatch),
    )


# -- WeightWatcher(speculative=True) over real NATS -------------------------------------------


@pytest.mark.usefixtures("drop_run")
async def test_watcher_serves_before_the_check_and_rolls_back_a_bad_version(
    js, run_id, model_dir, tmp_path, monkeypatch
):
    reg, store, publisher, engine, counters, watcher, gate = await _speculative_rig(
        js, run_id, model_dir, tmp_path, monkeypatch
    )
    try:
        # v1: serves at once, the check still running
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store)
        await until(lambda: watcher.newest is not None and watcher.newest.version == 1)
        mark = watcher.mark()
        assert await watcher.maybe_load(engine)
        assert watcher.version == 1 and same_weights(engine.model, publisher) and tied(engine.model)
        check = asyncio.create_task(watcher.verified_since(mark))
        await asyncio.to_thread(gate.started.wait, 10)
        await asyncio.sleep(0.05)
        assert not check.done() and "weights_verified" not in counters  # serving, not yet verified
        out = engine.generate(["1+2="], n=2, max_new_tokens=3, temperature=1.0)  # generation overlaps the check
        assert len(out[0]) == 2
        gate.release()
        assert await check and counters["weights_verified"] == 1

        # v2: corrupted file; it serves, the check fails, v1 is back, v2 is rejected
        v1_state = snapshot(engine.model)
        perturb(publisher, 2)
        wv2 = await publish_version(js, reg, publisher, 2, 2, {}, store=store)
        _corrupt(tmp_path / "w" / "v000002.safetensors")
        await until(lambda: watcher.newest.version == 2)
        mark = watcher.mark()
        assert await watcher.maybe_load(engine)
        assert not await watcher.verified_since(mark)
        assert watcher.version == 1 and counters["weight_version"] == 1 and equals_snapshot(engine.model, v1_state)
        assert tied(engine.model)
        assert wv2.msg_id in watcher.rejected and counters["weights_rejected"] == 1
        assert counters["weights_rolled_back"] == 1
        assert not await watcher.maybe_load(engine) and counters["weights_rejected"] == 1  # never again
        assert await watcher.verified_since(watcher.mark())  # what serves now (v1) is verified

        # v3: good again, loads over the rolled-back state
        perturb(publisher, 3)
        await publish_version(js, reg, publisher, 3, 3, {}, store=store)
        await until(lambda: watcher.newest.version == 3)
        mark = watcher.mark()
        assert await watcher.maybe_load(engine) and await watcher.verified_since(mark)
        assert watcher.version == 3 and same_weights(engine.model, publisher) and counters["weights_verified"] == 2
    finally:
        gate.release()
        await watcher._sub.unsubscribe()


@pytest.mark.usefixtures("drop_run")
async def test_watcher_default_stays_verify_first(js, run_id, model_dir, tmp_path, monkeypatch):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    publisher = load_model(model_dir)
    engine = HFEngine(str(model_dir), threads=1)
    called = []
    monkeypatch.setattr(HFEngine, "load_weights_file_speculative", lambda *a: called.append(a))
    watcher = WeightWatcher(js, reg, {})
    await watcher.start()
    try:
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=FileStore(tmp_path / "w"))
        await until(lambda: watcher.newest is not None)
        assert await watcher.maybe_load(engine) and not called and same_weights(engine.model, publisher)
    finally:
        await watcher._sub.unsubscribe()


# -- the rollout worker's publish gate ---------------------------------------------------------


async def _trajectories(js, reg) -> list[Trajectory]:
    return [decode(data, Trajectory) async for _, data in iter_stream(js, reg.stream("TRAJ"), reg.all("traj"))]


@pytest.mark.usefixtures("drop_run")
async def test_worker_publishes_only_verified_batches_and_retries_bad_ones(
    js, run_id, model_dir, tmp_path, monkeypatch
):
    reg, store, publisher, engine, counters, watcher, gate = await _speculative_rig(
        js, run_id, model_dir, tmp_path, monkeypatch
    )
    events: list[tuple] = []
    real_generate, real_publish = engine.generate, rw.publish_many

    def generate(*a, **kw):
        events.append(("generate", watcher.version))
        out = real_generate(*a, **kw)
        gate.release()  # the check finishes only after this batch was generated with the unverified weights
        return out

    async def publish_many(js_, items):
        events.append(("publish", [t.policy_version for _, t in items], counters.get("weights_verified", 0)))
        return await real_publish(js_, items)

    monkeypatch.setattr(engine, "generate", generate)
    monkeypatch.setattr(rw, "publish_many", publish_many)
    sub = await pull_subscription(js, reg.rollout_consumer(30.0))

    async def one_batch(task: Task | None = None) -> dict:
        if task is not None:
            await publish(js, reg.tasks(task.domain), task)
        return await run_pull_loop(
            js,
            reg,
            "rollout",
            sub,
            Task,
            lambda b: rw.roll_out_batch(
                b, js=js, reg=reg, engine=engine, watcher=watcher, counters=counters, budget_s=30.0
            ),
            batch=4,
            max_messages=1,
            fetch_timeout=1.0,
            counters={},
        )

    try:
        # good v1: generated while its check runs, published only after it passed
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store)
        await until(lambda: watcher.newest is not None)
        outcome = await one_batch(make_task(run_id, "arith-1", group_size=2, max_tokens=3))
        assert outcome.get("ack") == 1 and "retry" not in outcome
        assert events == [("generate", 1), ("publish", [1, 1], 1)]  # verified (count 1) before publishing
        assert [t.policy_version for t in await _trajectories(js, reg)] == [1, 1]
        v1_state = snapshot(engine.model)

        # corrupted v2: generated with it, then the check fails -> nothing published, task retried
        gate.go.clear()
        events.clear()
        perturb(publisher, 2)
        wv2 = await publish_version(js, reg, publisher, 2, 2, {}, store=store)
        _corrupt(tmp_path / "w" / "v000002.safetensors")
        await until(lambda: watcher.newest.version == 2)
        task2 = make_task(run_id, "arith-2", group_size=2, max_tokens=3)
        outcome = await one_batch(task2)
        assert outcome.get("retry") == 1 and "ack" not in outcome
        assert events == [("generate", 2)]  # generated with the unverified v2, never published
        assert counters["batches_discarded_unverified"] == 1
        assert len(await _trajectories(js, reg)) == 2  # still only v1's
        assert watcher.version == 1 and equals_snapshot(engine.model, v1_state)  # back on the previous weights
        assert wv2.msg_id in watcher.rejected and counters["weights_rejected"] == 1

        # the retried task is redelivered and regenerated with the good weights
        events.clear()
        outcome = await one_batch()
        assert outcome.get("ack") == 1 and "retry" not in outcome
        assert events == [("generate", 1), ("publish", [1, 1], 1)]
        trajs = await _trajectories(js, reg)
        assert len(trajs) == 4 and {t.task_msg_id for t in trajs[2:]} == {task2.msg_id}
        assert all(t.policy_version == 1 for t in trajs)
    finally:
        gate.release()
        await watcher._sub.unsubscribe()
