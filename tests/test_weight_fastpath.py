"""Zero-copy weight paths (bus/weight_blobs.py, rollout_workers/weight_loading.py, bus/objects.py, HFEngine.load_weights_file,
WeightWatcher): the segment writer produces the exact safetensors bytes, the file fast path
round-trips (tied weights kept tied), a corrupted or truncated file raises ChecksumMismatch
and leaves the model untouched, a dtype mismatch or LoRA blob falls back to the generic
path, and the pipelined NATS object-store put/get interoperates with nats-py's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM

import bus.objects as objects
from bus.conn import ensure_topology
from bus.objects import ChecksumMismatch, get_blob, put_blob, put_segments, sha256_hex
from bus.subjects import Registry
from bus.weight_blobs import state_segments, state_tensors, state_to_bytes
from bus.weight_stores import FileStore
from learner.weights import model_segments, publish_version
from rlbus.model.tiny_model import build_tiny_model
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.weight_loading import load_state_file
from rollout_workers.weights_watch import WeightWatcher
from tests.tiny_weights import TINY, equals_snapshot, load_model, model_dir, perturb, same_weights, snapshot, tied  # noqa: F401 - model_dir is a fixture


async def _write(tmp_path, model, name="v000001.safetensors"):
    uri, sha, size = await FileStore(tmp_path / "w").put_segments(name, model_segments(model))
    return uri, sha, size


# -- writer ---------------------------------------------------------------------------


def test_segments_are_the_safetensors_bytes(model_dir, tmp_path):
    model = load_model(model_dir)
    assert b"".join(state_segments(state_tensors(model))) == state_to_bytes(model)
    mixed = {
        "w": torch.randn(3, 4),
        "h": torch.randn(5).half(),
        "b": torch.randn(2).to(torch.bfloat16),
        "i": torch.arange(3),
        "m": torch.tensor([True, False]),
        "s": torch.tensor(2.5),
        "e": torch.zeros(0, 3),
        "d": torch.randn(2).double(),
        "u": torch.arange(4, dtype=torch.uint8),
    }
    assert b"".join(state_segments(mixed)) == save(mixed)
    assert b"".join(state_segments(mixed, {"k": "v"})) == save(mixed, metadata={"k": "v"})
    assert state_segments({"nc": torch.randn(4, 3).t()}) is None  # not contiguous: no zero-copy layout


async def test_file_store_writes_a_readable_safetensors_file(model_dir, tmp_path):
    model = load_model(model_dir)
    perturb(model, 1)
    uri, sha, size = await _write(tmp_path, model)
    path = tmp_path / "w" / "v000001.safetensors"
    assert uri == path.as_uri() and size == path.stat().st_size and sha == sha256_hex(path.read_bytes())
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["v000001.safetensors"]  # no temp file left
    expected = state_tensors(model)
    back = load_file(path)
    assert back.keys() == expected.keys() and all(torch.equal(back[k], expected[k]) for k in back)
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == set(expected)


# -- reader ---------------------------------------------------------------------------


async def test_file_fast_path_round_trip_keeps_ties(model_dir, tmp_path):
    src, dst = load_model(model_dir), load_model(model_dir)
    staging: dict = {}
    for v in (1, 2, 3):  # staging buffers are reused (swapped) across versions
        perturb(src, v)
        uri, sha, _ = await _write(tmp_path, src, f"v{v:06d}.safetensors")
        assert load_state_file(dst, uri.removeprefix("file://"), sha, staging)
        assert same_weights(src, dst) and tied(dst)
        assert dst.lm_head.weight.data_ptr() == dst.get_input_embeddings().weight.data_ptr()
    assert dst.generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False).shape == (1, 4)


async def test_corrupt_or_truncated_file_leaves_the_model_untouched(model_dir, tmp_path):
    src, dst = load_model(model_dir), load_model(model_dir)
    perturb(src, 5)
    uri, sha, size = await _write(tmp_path, src)
    path = tmp_path / "w" / "v000001.safetensors"
    good = path.read_bytes()
    staging: dict = {}
    snap = snapshot(dst)
    corrupt = bytearray(good)
    corrupt[-7] ^= 0xFF  # a byte of the last tensor: everything before it was already read
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ChecksumMismatch):
        load_state_file(dst, path, sha, staging)
    assert equals_snapshot(dst, snap) and tied(dst)
    path.write_bytes(good[: size // 2])
    with pytest.raises(ChecksumMismatch):
        load_state_file(dst, path, sha, staging)
    assert equals_snapshot(dst, snap)
    path.write_bytes(good)
    with pytest.raises(ChecksumMismatch):
        load_state_file(dst, path, "0" * 64, staging)
    assert equals_snapshot(dst, snap)
    assert load_state_file(dst, path, sha, staging) and same_weights(src, dst)  # the intact file still loads


async def test_fast_path_declines_other_dtype_and_lora(model_dir, tmp_path):
    src = load_model(model_dir)
    perturb(src, 7)
    uri, sha, _ = await _write(tmp_path, src)
    half = load_model(model_dir).to(torch.bfloat16)
    snap = snapshot(half)
    assert not load_state_file(half, uri.removeprefix("file://"), sha, {})
    assert equals_snapshot(half, snap)
    lora = tmp_path / "lora.safetensors"
    lora.write_bytes(save({"a": torch.zeros(2)}, metadata={"rlbus.kind": "lora"}))
    assert not load_state_file(half, lora, sha256_hex(lora.read_bytes()), {})


# -- watcher over real NATS -------------------------------------------------------------


@pytest.mark.usefixtures("drop_run")
async def test_watcher_file_store_fast_path_and_fallback(js, run_id, model_dir, tmp_path, monkeypatch):
    import rollout_workers.weights_watch as ww

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    store = FileStore(tmp_path / "w")
    publisher = load_model(model_dir)
    engine = HFEngine(str(model_dir), threads=1)
    fetched: list[str] = []
    real_fetch = ww.fetch_weights

    async def counting_fetch(uri, *args, **kw):
        fetched.append(uri)
        return await real_fetch(uri, *args, **kw)

    monkeypatch.setattr(ww, "fetch_weights", counting_fetch)
    counters: dict[str, float] = {}
    watcher = WeightWatcher(js, reg, counters)
    await watcher.start()

    async def announced(v):
        deadline = asyncio.get_running_loop().time() + 10
        while watcher.newest is None or watcher.newest.version < v:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)

    try:
        perturb(publisher, 1)
        await publish_version(js, reg, publisher, 1, 1, {}, store=store)
        await announced(1)
        assert await watcher.maybe_load(engine)
        assert fetched == [] and same_weights(engine.model, publisher) and tied(engine.model)  # zero-copy path

        # a corrupted file: rejected, counted, engine keeps version 1
        perturb(publisher, 2)
        wv2 = await publish_version(js, reg, publisher, 2, 2, {}, store=store)
        path = tmp_path / "w" / "v000002.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
        snap = snapshot(engine.model)
        await announced(2)
        assert not await watcher.maybe_load(engine)
        assert counters["weights_rejected"] == 1 and watcher.version == 1 and wv2.msg_id in watcher.rejected
        assert equals_snapshot(engine.model, snap)

        # an engine in another dtype: the fast path declines, the generic path converts
        engine.model.to(torch.bfloat16)
        perturb(publisher, 3)
        await publish_version(js, reg, publisher, 3, 3, {}, store=store)
        await announced(3)
        assert await watcher.maybe_load(engine)
        assert len(fetched) == 1 and watcher.version == 3
        got, want = engine.model.state_dict(), publisher.state_dict()
        assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    finally:
        await watcher._sub.unsubscribe()


# -- NATS object store --------------------------------------------------------------------


@pytest.mark.usefixtures("drop_run")
async def test_pipelined_put_and_get_interoperate_with_nats_py(js, run_id, tmp_path, monkeypatch):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    monkeypatch.setattr(objects, "CHUNK_SIZE", 1000)  # many chunks, some spanning segments
    monkeypatch.setattr(objects, "MAX_IN_FLIGHT", 7)
    segments = [b"head", bytes(range(256)) * 9, memoryview(b"x" * 2500), b"", bytes(range(256)) * 3]
    data = b"".join(bytes(s) for s in segments)
    uri, sha, size = await put_segments(js, reg.object_bucket, "seg.bin", segments)
    assert size == len(data) and sha == sha256_hex(data)
    assert await get_blob(js, uri, sha) == data
    store = await js.object_store(reg.object_bucket)
    assert (await store.get("seg.bin")).data == data  # nats-py reads our object (and checks its digest)
    info = await store.get_info("seg.bin")
    assert info.chunks == -(-len(data) // 1000) and info.size == len(data)

    # replacing an object purges the old chunks; nats-py's objects read back here
    uri2, sha2, _ = await put_blob(js, reg.object_bucket, "seg.bin", b"second")
    assert uri2 == uri and await get_blob(js, uri, sha2) == b"second"
    await store.put("theirs.bin", data)
    assert await get_blob(js, f"nats-object://{reg.object_bucket}/theirs.bin", sha) == data
    with pytest.raises(ChecksumMismatch):
        await get_blob(js, uri, sha)

    # a model's zero-copy segments through the default store round-trip bit-exactly
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", **TINY))
    wv = await publish_version(js, reg, model, 1, 1, {})
    assert await get_blob(js, wv.uri, wv.sha256) == state_to_bytes(model)
