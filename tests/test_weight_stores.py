"""Weight stores (bus/weight_stores.py): file:// round trip with the sha256 check, a corrupted
file refused, s3:// without boto3 failing with the install hint, store selection from the
config string, and publish_version through a file store announced over real NATS."""

from __future__ import annotations

import importlib.util

import pytest
from transformers import AutoModelForCausalLM

from bus.conn import ensure_topology
from bus.kv import WEIGHTS_LATEST, get_json
from bus.objects import ChecksumMismatch
from bus.subjects import Registry
from bus.weight_blobs import load_state_bytes
from bus.weight_stores import FileStore, NatsStore, fetch_weights, make_store
from learner.weights import publish_version
from rlbus.model.tiny_model import build_tiny_model

HAS_BOTO3 = importlib.util.find_spec("boto3") is not None


async def test_file_store_round_trip_and_corruption(tmp_path):
    store = make_store(f"file://{tmp_path}/weights")
    assert isinstance(store, FileStore)
    uri, sha, size = await store.put("v000001.safetensors", b"weights-bytes")
    assert uri == (tmp_path / "weights" / "v000001.safetensors").as_uri() and size == 13
    assert await fetch_weights(uri, sha) == b"weights-bytes"
    assert not list((tmp_path / "weights").glob("*.tmp"))
    (tmp_path / "weights" / "v000001.safetensors").write_bytes(b"weights-bytez")
    with pytest.raises(ChecksumMismatch):
        await fetch_weights(uri, sha)


def test_make_store_specs(tmp_path):
    with pytest.raises(ValueError, match="JetStream"):
        make_store("nats")
    assert isinstance(make_store("nats", js=object(), reg=Registry("r1")), NatsStore)
    with pytest.raises(ValueError, match="absolute path"):
        make_store("file://relative/dir")
    with pytest.raises(ValueError, match="unknown weight_store"):
        make_store("ftp://host/x")


@pytest.mark.skipif(HAS_BOTO3, reason="boto3 is installed; the missing-dependency error cannot show")
async def test_s3_without_boto3_says_how_to_install():
    with pytest.raises(RuntimeError, match="pip install boto3"):
        make_store("s3://bucket/prefix")
    with pytest.raises(RuntimeError, match="pip install boto3"):
        await fetch_weights("s3://bucket/prefix/v1.safetensors", "0" * 64)


@pytest.mark.usefixtures("drop_run")
async def test_publish_version_to_file_store(js, run_id, tmp_path):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    path = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path)
    wv = await publish_version(js, reg, model, 3, 7, {"loss": 1.0}, store=FileStore(tmp_path / "w"))
    assert wv.uri.startswith("file://") and wv.version == 3
    latest = await get_json(js, reg, WEIGHTS_LATEST)
    assert latest["uri"] == wv.uri and latest["sha256"] == wv.sha256
    fresh = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(tmp_path / "o", hidden_size=32, num_layers=1, num_heads=2, seed=1)
    )
    load_state_bytes(fresh, await fetch_weights(wv.uri, wv.sha256, js))
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
