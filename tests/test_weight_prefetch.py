"""Weight prefetch hints (learner.weights.publish_version with a FileStore and `nc`,
WeightWatcher(speculative=True, nc=...)), over the real NATS server:

- the learner sends the hint when the file is complete, BEFORE its sha256 is done, and
  the WeightVersion only after; a worker serves the hinted version at once, and its
  publish gate opens only when the WeightVersion arrives and the loaded bytes match it;
- a file changed after the hint: the check fails, the previous weights serve again, the
  hint is dropped (not a rejection), and the WeightVersion is then checked on its own
  and rejected;
- a hint whose WeightVersion never comes (learner died while hashing): the check fails
  after the wait, the previous weights serve again;
- a hint for a file the engine cannot load speculatively (dtype mismatch) is skipped
  quietly and the WeightVersion loads verify-first.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import bus.weight_stores as ws
import learner.weights as lw
import rollout_workers.weights_watch as ww
from bus.conn import connect, ensure_topology
from bus.subjects import Registry
from bus.weight_stores import FileStore
from learner.weights import publish_version
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.weights_watch import WeightWatcher
from schemas import WeightPrefetch, WeightVersion, encode
from tests.tiny_weights import equals_snapshot, load_model, model_dir, perturb, same_weights, snapshot, until  # noqa: F401 - model_dir is a fixture


class GatedLearnerHash:
    """Holds the learner's sha256 of a published file until `release()`."""

    def __init__(self, monkeypatch):
        self.go, self.started = threading.Event(), threading.Event()
        real = ws.sha256_segments

        def gated(segments):
            self.started.set()
            assert self.go.wait(30)
            return real(segments)

        monkeypatch.setattr(ws, "sha256_segments", gated)

    def release(self) -> None:
        self.go.set()


@pytest.fixture
async def nc(nats_url):
    conn = await connect(nats_url, name="pytest-prefetch")
    yield conn
    await conn.close()


async def _rig(nc, run_id, model_dir, tmp_path):
    reg = Registry(run_id)
    js = nc.jetstream(timeout=10)
    await ensure_topology(js, reg)
    counters: dict[str, float] = {}
    watcher = WeightWatcher(js, reg, counters, speculative=True, nc=nc)
    await watcher.start()
    return (
        js,
        reg,
        FileStore(tmp_path / "w"),
        load_model(model_dir),
        HFEngine(str(model_dir), threads=1),
        counters,
        watcher,
    )


@pytest.mark.usefixtures("drop_run")
async def test_hint_serves_before_the_learner_hash_and_the_gate_waits_for_the_version(
    nc, run_id, model_dir, tmp_path, monkeypatch
):
    js, reg, store, publisher, engine, counters, watcher = await _rig(nc, run_id, model_dir, tmp_path)
    gate = GatedLearnerHash(monkeypatch)
    try:
        assert not await watcher.wait_for_newer(0.1)  # nothing announced yet
        perturb(publisher, 1)
        publishing = asyncio.create_task(publish_version(js, reg, publisher, 1, 1, {}, store=store, nc=nc))
        assert await watcher.wait_for_newer(10)  # woken by the hint
        assert watcher.prefetch is not None and gate.started.is_set() and not publishing.done()  # still hashing
        assert watcher.newest is None and watcher.newest_version == 1
        mark = watcher.mark()
        assert await watcher.maybe_load(engine)
        assert watcher.version == 1 and same_weights(engine.model, publisher)  # serving before any sha256 exists
        check = asyncio.create_task(watcher.verified_since(mark))
        await asyncio.sleep(0.2)
        assert not check.done() and "weights_verified" not in counters  # nothing may be published yet
        engine.generate(["1+2="], n=2, max_new_tokens=3, temperature=1.0)  # generation meanwhile
        gate.release()
        wv = await publishing
        assert await check and counters["weights_verified"] == 1
        assert watcher.loaded == wv and watcher.loaded.sha256 == wv.sha256  # the hint gave way to the version
        assert not await watcher.maybe_load(engine)  # the version itself is not loaded again
        assert "weights_prefetch_failed" not in counters and "weights_rejected" not in counters
    finally:
        gate.release()
        await watcher.close()


@pytest.mark.usefixtures("drop_run")
async def test_file_changed_after_the_hint_rolls_back_then_the_version_is_rejected(
    nc, run_id, model_dir, tmp_path, monkeypatch
):
    js, reg, store, publisher, engine, counters, watcher = await _rig(nc, run_id, model_dir, tmp_path)
    gate = GatedLearnerHash(monkeypatch)
    gate.release()
    try:
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store, nc=nc)
        await until(lambda: watcher.newest is not None)
        await watcher.maybe_load(engine)
        assert watcher.version == 1 and await watcher.verified_since(0)
        v1 = snapshot(engine.model)

        gate.go.clear()
        perturb(publisher, 2)
        publishing = asyncio.create_task(publish_version(js, reg, publisher, 2, 2, {}, store=store, nc=nc))
        await until(lambda: watcher.prefetch is not None and watcher.prefetch.version == 2)
        path = tmp_path / "w" / "v000002.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1  # corrupted on disk; the learner hashes its own buffers
        path.write_bytes(bytes(data))
        mark = watcher.mark()
        assert await watcher.maybe_load(engine) and watcher.version == 2  # the hinted (corrupt) file serves
        gate.release()
        wv2 = await publishing
        assert not await watcher.verified_since(mark)
        assert watcher.version == 1 and equals_snapshot(engine.model, v1)  # previous weights again
        assert counters["weights_prefetch_failed"] == 1 and "weights_rejected" not in counters  # a hint only
        # the WeightVersion is then loaded and checked on its own: the same bytes fail, it is rejected
        mark = watcher.mark()
        assert await watcher.maybe_load(engine)
        assert not await watcher.verified_since(mark)
        assert wv2.msg_id in watcher.rejected and counters["weights_rejected"] == 1
        assert counters["weights_rolled_back"] == 2 and watcher.version == 1 and equals_snapshot(engine.model, v1)
        assert not await watcher.maybe_load(engine)
    finally:
        gate.release()
        await watcher.close()


@pytest.mark.usefixtures("drop_run")
async def test_hint_without_a_version_rolls_back_after_the_wait(nc, run_id, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ww, "PREFETCH_WAIT_S", 0.5)
    js, reg, store, publisher, engine, counters, watcher = await _rig(nc, run_id, model_dir, tmp_path)
    try:
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store, nc=nc)
        await until(lambda: watcher.newest is not None)
        assert await watcher.maybe_load(engine) and await watcher.verified_since(0)
        v1 = snapshot(engine.model)
        # the learner wrote v2 and sent its hint, then died before its WeightVersion
        perturb(publisher, 2)
        uri, _, size = await store.put_segments("v000002.safetensors", lw.model_segments(publisher))
        await nc.publish(
            reg.weights_prefetch, encode(WeightPrefetch(run_id=run_id, version=2, step=2, uri=uri, bytes=size))
        )
        await until(lambda: watcher.prefetch is not None and watcher.prefetch.version == 2)
        mark = watcher.mark()
        assert await watcher.maybe_load(engine) and watcher.version == 2
        assert not await watcher.verified_since(mark)  # ~0.5 s: no WeightVersion came
        assert watcher.version == 1 and equals_snapshot(engine.model, v1)
        assert counters["weights_prefetch_failed"] == 1 and counters["weights_rolled_back"] == 1
        assert "weights_rejected" not in counters
        assert not await watcher.maybe_load(engine)  # the dropped hint is not tried again
        assert await watcher.verified_since(watcher.mark())
    finally:
        await watcher.close()


@pytest.mark.usefixtures("drop_run")
async def test_hint_the_engine_cannot_load_speculatively_is_skipped(nc, run_id, model_dir, tmp_path, monkeypatch):
    js, reg, store, publisher, engine, counters, watcher = await _rig(nc, run_id, model_dir, tmp_path)
    engine.model.to(torch.bfloat16)  # the file is float32: no speculative (zero-copy) path
    gate = GatedLearnerHash(monkeypatch)
    try:
        perturb(publisher, 1)
        publishing = asyncio.create_task(publish_version(js, reg, publisher, 1, 1, {}, store=store, nc=nc))
        await until(lambda: watcher.prefetch is not None)
        assert not await watcher.maybe_load(engine) and watcher.version == -1
        assert "weights_prefetch_failed" not in counters  # skipped, not failed
        gate.release()
        wv = await publishing
        await until(lambda: watcher.newest is not None)
        assert await watcher.maybe_load(engine) and watcher.loaded == wv  # verify-first, converting dtype
    finally:
        gate.release()
        await watcher.close()


def test_weight_version_is_still_the_only_authority():
    """The hint carries no sha256: nothing can be verified against it alone."""
    assert "sha256" not in WeightPrefetch.model_fields and "sha256" in WeightVersion.model_fields


@pytest.mark.usefixtures("drop_run")
async def test_malformed_hint_is_ignored_and_the_watch_goes_on(nc, run_id, model_dir, tmp_path):
    js, reg, store, publisher, engine, counters, watcher = await _rig(nc, run_id, model_dir, tmp_path)
    try:
        await nc.publish(reg.weights_prefetch, b"\xc1not msgpack")
        await nc.flush()
        await asyncio.sleep(0.2)
        assert watcher.prefetch is None and watcher.newest_version == -1
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store, nc=nc)
        assert await watcher.wait_for_newer(10) and await watcher.maybe_load(engine)
        assert await watcher.verified_since(0) and watcher.version == 1
    finally:
        await watcher.close()
