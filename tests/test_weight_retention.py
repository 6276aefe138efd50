"""Weight-version retention (learner.retention) against real stores: the NATS object
store and a file:// directory. Old versions are deleted after a publish, version 0 and the
released version are kept, a new process sweeps what an earlier one left, a deleted blob
reads as BlobGone, and a rollout watcher whose version is deleted under it while a newer
one exists skips it and loads the newer one."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from bus.conn import ensure_topology
from bus.kv import RELEASE_LATEST, put_json
from bus.objects import BlobGone
from bus.subjects import Registry
from bus.weight_stores import FileStore, NatsStore, fetch_weights
from learner.retention import Retention, version_name
from learner.weights import publish_version
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.weights_watch import WeightWatcher
from tests.tiny_weights import load_model, model_dir, perturb, same_weights, until  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("drop_run")


def _versions(names) -> list[int]:
    return sorted(int(n[1:7]) for n in names if n.endswith(".safetensors"))


@pytest.mark.parametrize("kind", ["nats", "file"])
async def test_retention_keeps_newest_version_zero_and_the_released_one(js, run_id, tmp_path, kind):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    store = NatsStore(js, reg.object_bucket) if kind == "nats" else FileStore(tmp_path / "w")
    uris = {}
    for v in range(11):
        uris[v], _, _ = await store.put(version_name(v), f"blob {v}".encode())
    await store.put("notes.txt", b"not a version: never touched")
    await put_json(js, reg, RELEASE_LATEST, {"version": 4, "step": 4})

    retention = Retention(store, keep=3, js=js, reg=reg)
    assert await retention.after_publish(10) == 6  # 1-3 and 5-7; 4 is released, 8-10 are the newest 3
    assert _versions(await store.names()) == [0, 4, 8, 9, 10] and "notes.txt" in await store.names()
    with pytest.raises(BlobGone):
        await fetch_weights(uris[5], "0" * 64, js)

    await put_json(js, reg, RELEASE_LATEST, {"version": 9, "step": 9})  # a newer release replaces 4
    await store.put(version_name(11), b"blob 11")
    assert await retention.after_publish(11) == 2  # 4 (no longer released) and 8
    assert _versions(await store.names()) == [0, 9, 10, 11]

    # a new learner process (smaller keep) sweeps what the earlier one left
    await store.put(version_name(12), b"blob 12")
    fresh = Retention(store, keep=1, js=js, reg=reg)
    assert await fresh.after_publish(12) == 2  # 10, 11; 9 stays released
    assert _versions(await store.names()) == [0, 9, 12]
    assert await Retention(store, keep=0, js=js, reg=reg).after_publish(12) == 0  # keep 0: keep all


async def test_watcher_skips_a_version_deleted_under_it_and_loads_the_newer_one(
    js, run_id, model_dir, tmp_path, monkeypatch
):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    store = FileStore(tmp_path / "w")
    publisher = load_model(model_dir)
    engine = HFEngine(str(model_dir), threads=1)
    start = load_model(model_dir)
    entered, superseded = threading.Event(), threading.Event()
    real = HFEngine.load_weights_file

    def racing(self, path, sha256):
        if path.endswith(version_name(1)):
            os.unlink(path)  # retention deleted v1 just before this worker read it ...
            entered.set()
            assert superseded.wait(10)  # ... because newer versions had been published meanwhile
        return real(self, path, sha256)

    monkeypatch.setattr(HFEngine, "load_weights_file", racing)
    counters: dict = {}
    watcher = WeightWatcher(js, reg, counters)
    await watcher.start()
    try:
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store)
        await until(lambda: watcher.newest is not None and watcher.newest.version == 1)
        loading = asyncio.create_task(watcher.maybe_load(engine))
        assert await asyncio.to_thread(entered.wait, 10)
        perturb(publisher, 2)
        await publish_version(js, reg, publisher, 2, 2, {}, store=store)
        await until(lambda: watcher.newest.version == 2)
        superseded.set()
        assert await loading is False
        assert counters["weights_gone"] == 1 and "weights_rejected" not in counters
        assert watcher.loaded is None and same_weights(engine.model, start)  # untouched
        assert await watcher.maybe_load(engine) and watcher.version == 2 and same_weights(engine.model, publisher)

        # the NEWEST version gone is a fault, not a skip: rejected, the engine keeps v2
        perturb(publisher, 3)
        await publish_version(js, reg, publisher, 3, 3, {}, store=store)
        await until(lambda: watcher.newest.version == 3)
        os.unlink(tmp_path / "w" / version_name(3))
        assert not await watcher.maybe_load(engine)
        assert counters["weights_rejected"] == 1 and watcher.version == 2
    finally:
        superseded.set()
        await watcher._sub.unsubscribe()
