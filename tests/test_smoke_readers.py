"""The readers of a finished run, on the session's smoke `rlbus up` (tests/smoke_run.py):
`rlbus report` and `rlbus export` work on what a real run left, not only on crafted stores.
(`rlbus samples` on it: tests/test_samples.py.) The run's streams are never changed."""

from __future__ import annotations

import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

from tests.smoke_run import ROOT

PNG = b"\x89PNG\r\n\x1a\n"


def _rlbus(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=180
    )


def test_report_of_a_real_run_has_its_eval_curve_and_plots(smoke_run):
    assert not smoke_run.problem(), smoke_run.problem()
    res = _rlbus("report", str(smoke_run.run_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = (smoke_run.run_path / "report.md").read_text()
    assert "| arith |" in text and "no evaluations recorded" not in text, text[:2000]
    plots = sorted((smoke_run.run_path / "plots").glob("*.png"))
    assert plots and all(p.read_bytes()[:8] == PNG for p in plots), plots
    assert "plots/reward_per_domain.png" in text


def test_export_of_a_finished_run_takes_its_checkpoint_and_loads(smoke_run, tmp_path):
    assert not smoke_run.problem(), smoke_run.problem()
    out = tmp_path / "exported"
    res = _rlbus("export", str(smoke_run.run_path), "--version", "latest", "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "checkpoint" in res.stdout + res.stderr  # the server is gone: the learner's checkpoint is the source
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    refused = _rlbus("export", str(smoke_run.run_path), "--version", "2", "--out", str(tmp_path / "x"))
    assert refused.returncode != 0 and "rlbus up --resume" in refused.stdout + refused.stderr
    assert not (tmp_path / "x").exists()
