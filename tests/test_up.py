"""`rlbus up` end to end: every role its own process, a worker killed mid-run (a rollout
worker, or the learner itself) is restarted, the run still exits 0, and every published
task is accounted for: lost = 0 and no reward trained twice in the model's lineage.

This is `make test`'s one smoke run (tests/smoke_run.py, shared with the samples, report
and export checks of a finished run). The killed learner: tests/test_resume.py (e2e)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_up_restarts_a_killed_rollout_worker_and_loses_nothing(smoke_run):
    assert not smoke_run.problem(), smoke_run.problem()
    check_run(smoke_run.tmp, smoke_run.run_path, smoke_run.run_id)


def check_run(tmp_path: Path, run_path: Path, run_id: str) -> None:
    """What the finished smoke run, with its killed rollout worker, must show (summary, run store, logs)."""
    s = json.loads((run_path / "summary.json").read_text())
    assert s["final"] is True
    assert s["steps"] >= 25
    assert s["worker_restarts"].get("rollout", 0) >= 1
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
    # file:// weights: mapped speculatively (on a hint when it comes first), all verified
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
