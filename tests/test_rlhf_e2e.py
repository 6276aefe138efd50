"""The RLHF example end to end, tiny (e2e tier): pairs under the hidden rule, `rlbus train-rm`,
`rlbus up examples/rlhf.toml` with the RM as the only reward, `rlbus report` with the
RM-vs-rule chart and `rm_divergence` in summary.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e


def rlbus(*args: str, timeout: float = 300) -> str:
    """Run `rlbus ARGS` (its own process group, killed on timeout); its output, or fail with it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"rlbus {' '.join(args)}: exit {proc.returncode}\n{text[-3000:]}"
    return text


def test_rlhf_example_runs_with_the_rm_as_the_only_reward(tmp_path):
    from scheduler.store import open_store
    from scheduler.store_rows import EvalResultRow, RewardRow

    pairs, base, rm = tmp_path / "pairs.jsonl", tmp_path / "base", tmp_path / "rm"
    rlbus("rlhf-pairs", str(pairs), "--n", "300", "--level", "2", "--eval-n", "20")
    rlbus("init-model", str(base), "--tokenizer", "char", "--hidden-size", "32", "--num-layers", "1")
    rlbus("train-rm", str(pairs), "--model", str(base), "--out", str(rm), "--max-steps", "20", "--threads", "1")
    cfg = (ROOT / "examples" / "rlhf.toml").read_text().replace("runs/rlhf/rm/model", str(rm / "model"))
    (tmp_path / "rlhf.toml").write_text(cfg)
    run_id = f"rlhf{os.getpid()}"
    sets = ["sft.max_steps=30", "scheduler.eval.n=20", "scheduler.eval.every_versions=4", "model.hidden_size=32"]
    rlbus(
        "up",
        str(tmp_path / "rlhf.toml"),
        "--run-dir",
        str(tmp_path / "runs"),
        "--run-id",
        run_id,
        "--max-steps",
        "16",
        *[x for s in sets for x in ("--set", s)],
        timeout=420,
    )
    run = tmp_path / "runs" / run_id
    rlbus("report", str(run))
    summary = json.loads((run / "summary.json").read_text())
    assert "rm_divergence" in summary and summary["rm_divergence_reason"]
    assert (run / "plots" / "rm_vs_rule.png").stat().st_size > 0
    store = open_store(None, run)
    try:
        rewards = [r for r in store.rows(RewardRow, run_id) if r.purpose == "train"]
        evals = [e for e in store.rows(EvalResultRow, run_id) if e.domain == "rlhf"]
    finally:
        store.close()
    assert rewards and all(r.status == "ok" and 0.0 <= r.reward <= 1.0 for r in rewards)
    assert evals and evals[0].version == 0  # the rule, measured before RL and after
