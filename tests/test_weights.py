"""Weight blobs and hot-loading over a real NATS server: publish_version, the object store's
sha256 check, and a rollout engine that loads good versions and refuses a bad checksum."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bus.conn import ensure_topology
from bus.kv import WEIGHTS_LATEST, get_json
from bus.objects import ChecksumMismatch, get_blob, put_blob, sha256_hex
from bus.publish import publish
from bus.subjects import Registry
from bus.weight_blobs import load_state_bytes, state_to_bytes
from learner.weights import publish_version
from rlbus.model.tiny_model import build_tiny_model
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.weights_watch import WeightWatcher
from schemas import WeightVersion, decode
from tests.tiny_weights import TINY, load_model, model_dir, perturb, same_weights, snapshot, until  # noqa: F401 - model_dir is a fixture

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards


# -- pure blob functions -------------------------------------------------------------


def test_state_bytes_round_trip(model_dir):
    src, dst = load_model(model_dir), load_model(model_dir)
    perturb(src, seed=1)
    assert not same_weights(src, dst)
    blob = state_to_bytes(src)
    assert blob == state_to_bytes(src)  # deterministic
    load_state_bytes(dst, blob)
    assert same_weights(src, dst)
    # tied embeddings stay tied and are stored once
    assert dst.get_input_embeddings().weight.data_ptr() == dst.lm_head.weight.data_ptr()
    from safetensors.torch import load

    names = set(load(blob))
    assert len(names) == len({t.data_ptr() for t in src.state_dict().values()})
    assert not ({"lm_head.weight", "model.embed_tokens.weight"} <= names)


def test_load_blob_of_other_architecture_raises(model_dir, tmp_path):
    blob = state_to_bytes(load_model(model_dir))
    llama = load_model(build_tiny_model(tmp_path / "llama", arch="llama", **TINY))  # same sizes, no qkv bias
    with pytest.raises(ValueError, match="does not fit"):
        load_state_bytes(llama, blob)
    wider = load_model(build_tiny_model(tmp_path / "wide", hidden_size=64, num_layers=1, num_heads=2))
    with pytest.raises((ValueError, RuntimeError)):
        load_state_bytes(wider, blob)
    deeper = load_model(build_tiny_model(tmp_path / "deep", hidden_size=32, num_layers=2, num_heads=2))
    with pytest.raises(ValueError, match="missing"):
        load_state_bytes(deeper, blob)


# -- object store ----------------------------------------------------------------------


async def test_get_blob_checks_sha(js, run_id, tmp_path):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    data = bytes(range(256)) * 1000  # several chunks
    uri, sha, size = await put_blob(js, reg.object_bucket, "blob.bin", data)
    assert uri == f"nats-object://{reg.object_bucket}/blob.bin" and size == len(data) and sha == sha256_hex(data)
    assert await get_blob(js, uri, sha) == data
    with pytest.raises(ChecksumMismatch):
        await get_blob(js, uri, "0" * 64)
    f = tmp_path / "w.bin"
    f.write_bytes(data)
    assert await get_blob(js, f.as_uri(), sha) == data
    with pytest.raises(ChecksumMismatch):
        await get_blob(js, f.as_uri(), sha256_hex(b"other"))


# -- publish + hot load ---------------------------------------------------------------


async def test_publish_version_announces_on_subject_and_kv(js, run_id, model_dir):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    model = load_model(model_dir)
    wv = await publish_version(js, reg, model, version=1, step=7, metrics={"loss": 0.25})
    assert wv.version == 1 and wv.step == 7 and wv.dtype == "float32" and wv.metrics == {"loss": 0.25}

    raw = await js.get_last_msg(reg.stream("WEIGHTS"), reg.weights)
    announced = decode(raw.data, WeightVersion)
    assert announced == wv
    assert raw.headers and raw.headers.get("Nats-Msg-Id") == wv.msg_id

    latest = await get_json(js, reg, WEIGHTS_LATEST)
    assert latest["version"] == 1 and latest["msg_id"] == wv.msg_id
    assert latest["uri"] == wv.uri and latest["sha256"] == wv.sha256 and latest["step"] == 7

    blob = await get_blob(js, wv.uri, wv.sha256)
    assert blob == state_to_bytes(model) and len(blob) == wv.bytes


async def test_watcher_loads_good_versions_and_rejects_bad_sha(js, run_id, model_dir):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    publisher = load_model(model_dir)
    perturb(publisher, seed=2)
    engine = HFEngine(str(model_dir), threads=1)
    perturb(engine.model, seed=3)
    assert not same_weights(engine.model, publisher)

    v1 = await publish_version(js, reg, publisher, version=1, step=1, metrics={})
    counters: dict[str, float] = {}
    watcher = WeightWatcher(js, reg, counters)
    await watcher.start()
    try:
        assert watcher.version == -1
        assert await asyncio.wait_for(watcher.wait_first(asyncio.Event()), 10)
        assert await watcher.maybe_load(engine)
        assert watcher.version == 1 and counters["weight_version"] == 1 and counters["weights_loaded"] == 1
        assert same_weights(engine.model, publisher)
        assert not await watcher.maybe_load(engine)  # nothing newer

        # an announcement whose sha256 does not match the blob: never loaded
        good_state = snapshot(engine.model)
        bad = WeightVersion(run_id=run_id, version=2, step=2, uri=v1.uri, sha256="f" * 64, bytes=v1.bytes)
        await publish(js, reg.weights, bad)
        await until(lambda: watcher.newest is not None and watcher.newest.version == 2)
        assert not await watcher.maybe_load(engine)
        assert counters["weights_rejected"] == 1
        assert watcher.version == 1
        assert all(torch.equal(v, good_state[k]) for k, v in engine.model.state_dict().items())
        assert not await watcher.maybe_load(engine)  # asked again: not refetched, not recounted
        assert counters["weights_rejected"] == 1

        # a later good version still loads
        perturb(publisher, seed=4)
        await publish_version(js, reg, publisher, version=3, step=3, metrics={})
        await until(lambda: watcher.newest.version == 3)
        assert await watcher.maybe_load(engine)
        assert watcher.version == 3 and counters["weights_loaded"] == 2 and counters["weights_rejected"] == 1
        assert same_weights(engine.model, publisher)
        # the engine still generates with the hot-loaded weights
        out = engine.generate(["1+2="], n=2, max_new_tokens=3, temperature=1.0)
        assert len(out) == 1 and len(out[0]) == 2
    finally:
        await watcher._sub.unsubscribe()


async def test_watcher_ignores_older_announcement(js, run_id, model_dir):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    model = load_model(model_dir)
    watcher = WeightWatcher(js, reg, {})
    await watcher.start()
    try:
        await publish_version(js, reg, model, version=5, step=5, metrics={})
        await until(lambda: watcher.newest is not None)
        await publish_version(js, reg, model, version=4, step=4, metrics={})
        await publish_version(js, reg, model, version=6, step=6, metrics={})
        await until(lambda: watcher.newest.version == 6)
        await publish_version(js, reg, model, version=2, step=2, metrics={})
        await asyncio.sleep(0.2)
        assert watcher.newest.version == 6
    finally:
        await watcher._sub.unsubscribe()
