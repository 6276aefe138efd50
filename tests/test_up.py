"""`rlbus up` end to end: every role its own process, a worker killed mid-run (a rollout
worker, or the learner itself) is restarted, the run still exits 0, and every published
task is accounted for: lost = 0 and no reward trained twice in the model's lineage.

The rollout variant is `make test`'s one smoke run (tests/smoke_run.py, shared with the
samples, report and export checks of a finished run); the learner variant is e2e."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.smoke_run import CONFIG, worker_pids

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_up_restarts_a_killed_rollout_worker_and_loses_nothing(smoke_run):
    assert not smoke_run.problem(), smoke_run.problem()
    check_run(smoke_run.tmp, smoke_run.run_path, smoke_run.run_id, "rollout")


@pytest.mark.e2e
def test_up_restarts_a_killed_learner_from_its_checkpoint_and_loses_nothing(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(CONFIG)
    run_id = f"up{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "up", str(cfg), "--run-dir", str(tmp_path / "runs"),
                             "--run-id", run_id, "--max-steps", "60", "--set", "scheduler.eval.mode=local"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    run_path = tmp_path / "runs" / run_id
    try:
        deadline = time.monotonic() + 240
        killed = False
        while time.monotonic() < deadline and proc.poll() is None:
            summary = run_path / "summary.json"
            if summary.exists():
                try:
                    steps = json.loads(summary.read_text())["steps"]
                except (json.JSONDecodeError, KeyError):
                    steps = 0
                # the learner dies after its step-5 checkpoint, with later steps to roll back
                if steps >= 8 and not killed:
                    pids = worker_pids(run_id, "learner")
                    assert pids, "no learner worker process found"
                    os.kill(pids[0], signal.SIGKILL)
                    killed = True
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert killed, text[-3000:]
    assert proc.returncode == 0, text[-3000:]
    check_run(tmp_path, run_path, run_id, "learner")


def check_run(tmp_path: Path, run_path: Path, run_id: str, victim: str) -> None:
    """What a finished run with one killed `victim` must show (summary, run store, logs)."""
    s = json.loads((run_path / "summary.json").read_text())
    assert s["final"] is True
    assert s["steps"] >= (25 if victim == "rollout" else 60)
    assert s["worker_restarts"].get(victim, 0) >= 1
    if victim == "learner":
        assert s["learner_rollbacks"] >= 1, s  # it restored its checkpoint and replayed REWARDS
    assert s["lost"] == 0 and s["trained_twice"] == 0, s
    assert s["tasks_published"] > 0 and s["trained_samples"] > 0
    loaded = s["rollout"]["weights_loaded"]  # hot-loads summed over rollout workers (restarted ones included)
    assert isinstance(loaded, int) and loaded >= 1, s["rollout"]
    cpu = s["cpu_seconds"]  # where the cores went: every role, the launcher, the embedded nats-server
    assert {"sampler", "rollout", "verifier", "learner", "scheduler", "launcher", "nats-server"} <= set(cpu), cpu
    assert all(v > 0 for v in cpu.values()), cpu
    fates = s["task_fates"]
    assert sum(fates.values()) == s["tasks_published"]
    ev = s["eval"]["arith"]
    assert ev["n"] == 20 and 0.0 <= ev["baseline"] <= 1.0 and 0.0 <= ev["final"] <= 1.0
    assert ev["final_version"] >= 25
    arith = s["domains"]["arith"]  # training rewards per domain, as the launcher saw them
    assert arith["rewards"] > 0 and 0.0 <= arith["reward_mean"] <= 1.0, arith
    assert set(arith["statuses"]) <= {"ok", "malformed"} and arith["tool_calls"] == {}, arith
    assert (run_path / "reward_curve.png").stat().st_size > 1000
    if victim == "rollout":  # file:// weights: mapped speculatively (on a hint when it comes first), all verified
        rollout_log = (run_path / "logs" / "rollout.log").read_text()
        assert '"speculative": true' in rollout_log and "rollout.weights_verified" in rollout_log
        assert "weights_rejected" not in rollout_log and "weights_rolled_back" not in rollout_log
        assert "weights_prefetch_failed" not in rollout_log
        kept = sorted(p.name for p in (tmp_path / "weights").glob("v*.safetensors"))
        assert kept[0] == "v000000.safetensors" and 5 <= len(kept) <= 6, kept  # 0, the newest 4, maybe the released
        assert int(kept[-1][1:7]) >= 25, kept
    # the scheduler's recorder wrote the run store (SQLite in the run folder by default)
    import sqlite3

    db = sqlite3.connect(run_path / "run.db")
    assert db.execute("select count(*) from rewards").fetchone()[0] == s["rewards"]
    assert db.execute("select count(*) from eval_results").fetchone()[0] == len(ev["curve"])
    assert db.execute("select status from runs").fetchone()[0] == "stopped"
    # cost per stage, from the workers' heartbeats: CPU seconds everywhere, tokens where they are made
    costs = {r[0]: (r[1], r[2]) for r in db.execute("select stage, cpu_seconds, tokens from costs")}
    assert {"rollout", "verifier", "learner", "sampler"} <= set(costs), costs
    assert all(cpu > 0 for cpu, _ in costs.values()) and costs["rollout"][1] > 0 and costs["learner"][1] > 0, costs
    state = json.loads((run_path / "run.json").read_text())
    assert state["nats_url"].startswith("nats://") and set(state["workers"]) >= {"sampler", "rollout", "learner"}
    # nothing of the run lives directly in the run dir
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_id]
