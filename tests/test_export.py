"""`rlbus export` against the session's real nats-server: versions published with
`learner.weights.publish_version` come back as HF model directories that
`AutoModelForCausalLM.from_pretrained` loads, with the same logits as the published model;
without a server only `latest` exports, from the learner checkpoint."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bus.conn import connect, delete_run, ensure_topology
from bus.kv import RELEASE_LATEST, put_json
from bus.subjects import Registry
from learner import checkpoint
from learner.weights import publish_version
from rlbus.commands.export import ExportError, export
from rlbus.model.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=32, num_layers=1, num_heads=2)
IDS = torch.tensor([[1, 5, 9, 14, 20, 33, 7]])


def _perturbed(start: Path, seed: int):
    model = AutoModelForCausalLM.from_pretrained(start).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _loaded_logits(path: Path) -> torch.Tensor:
    return _logits(AutoModelForCausalLM.from_pretrained(path).eval())


@pytest.fixture
def run_path(tmp_path, run_id) -> Path:
    path = tmp_path / "runs" / run_id
    build_tiny_model(path / "model" / "start", **TINY)
    return path


async def _publish(nats_url: str, run_id: str, models: list, released: int | None) -> None:
    nc = await connect(nats_url, name="test-export")
    js = nc.jetstream(timeout=10)
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    for version, model in enumerate(models):
        await publish_version(js, reg, model, version, version * 5, {})
    if released is not None:
        await put_json(js, reg, RELEASE_LATEST, {"version": released, "step": released * 5})
    await nc.close()


async def _delete_blob(nats_url: str, run_id: str, name: str) -> None:
    from bus.weight_stores import NatsStore

    nc = await connect(nats_url, name="test-export-delete")
    await NatsStore(nc.jetstream(timeout=10), Registry(run_id).object_bucket).delete(name)
    await nc.close()


async def _drop(nats_url: str, run_id: str) -> None:
    nc = await connect(nats_url, name="test-export-drop")
    await delete_run(nc.jetstream(timeout=10), Registry(run_id))
    await nc.close()


def test_export_numbered_latest_and_released_versions_load_with_the_published_logits(
    run_path, run_id, nats_url, tmp_path
):
    start = run_path / "model" / "start"
    models = [AutoModelForCausalLM.from_pretrained(start).eval(), _perturbed(start, 1), _perturbed(start, 2)]
    (run_path / "run.json").write_text(json.dumps({"run_id": run_id, "nats_url": nats_url}))
    asyncio.run(_publish(nats_url, run_id, models, released=None))
    try:
        with pytest.raises(ExportError, match="no released version"):
            export(run_path, tmp_path / "rel", "released")
        asyncio.run(_publish(nats_url, run_id, [], released=1))  # what the release gate writes

        src = export(run_path, tmp_path / "v1", "1")
        assert (src.kind, src.version, src.step) == ("blob", 1, 5)
        assert torch.allclose(_loaded_logits(tmp_path / "v1"), _logits(models[1]), atol=1e-6)
        assert not torch.allclose(_logits(models[1]), _logits(models[0]), atol=1e-3)  # the versions differ

        assert export(run_path, tmp_path / "latest").version == 2
        assert torch.allclose(_loaded_logits(tmp_path / "latest"), _logits(models[2]), atol=1e-6)

        assert export(run_path, tmp_path / "rel", "released").version == 1
        assert torch.allclose(_loaded_logits(tmp_path / "rel"), _logits(models[1]), atol=1e-6)

        out = tmp_path / "v1"
        assert {"config.json", "model.safetensors", "tokenizer.json", "rlbus_export.json"} <= {
            p.name for p in out.iterdir()
        }
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.decode(tok("12+7=")["input_ids"], skip_special_tokens=True) == "12+7="
        assert json.loads((out / "rlbus_export.json").read_text())["version"] == 1

        with pytest.raises(ExportError, match="neither in its WEIGHTS stream"):
            export(run_path, tmp_path / "v9", "9")

        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlbus.cli",
                "export",
                str(run_path),
                "--version",
                "2",
                "--out",
                str(tmp_path / "cli"),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        assert torch.allclose(_loaded_logits(tmp_path / "cli"), _logits(models[2]), atol=1e-6)

        asyncio.run(_delete_blob(nats_url, run_id, "v000001.safetensors"))  # what weight retention does
        with pytest.raises(ExportError, match="keep_versions"):
            export(run_path, tmp_path / "gone", "1")
        assert not (tmp_path / "gone").exists()
    finally:
        asyncio.run(_drop(nats_url, run_id))


def test_export_without_a_server_uses_the_checkpoint_for_latest_and_refuses_other_versions(run_path, run_id, tmp_path):
    start = run_path / "model" / "start"
    (run_path / "run.json").write_text(json.dumps({"run_id": run_id, "nats_url": "nats://127.0.0.1:1"}))
    trained = _perturbed(start, 3)
    checkpoint.save(
        run_path / "checkpoints" / "learner.pt",
        model=trained,
        optimizer=torch.optim.AdamW(trained.parameters()),
        state={"step": 7, "version": 3},
    )
    notes = []
    src = export(run_path, tmp_path / "ck", "latest", say=notes.append)
    assert (src.kind, src.step, src.version) == ("checkpoint", 7, 3)
    assert notes and "not reachable" in notes[0] and "checkpoint" in notes[0]
    assert torch.allclose(_loaded_logits(tmp_path / "ck"), _logits(trained), atol=1e-6)
    for version in ("released", "2"):
        with pytest.raises(ExportError, match="rlbus up --resume"):
            export(run_path, tmp_path / "x", version)
    assert not (tmp_path / "x").exists()


def test_export_help_has_examples():
    out = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "export", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0 and "examples:" in out.stdout and "--version" in out.stdout
