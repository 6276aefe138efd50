"""`rlbus up --resume`: kill -9 the learner mid-run (restarted from its checkpoint, it rolls
back and replays), then kill -9 the launcher, watch its orphaned workers stop by themselves,
resume, and finish with nothing lost and nothing trained twice. One run for both faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.run.resume import ResumeError, resumed_config
from tests.smoke_run import CONFIG
from tests.smoke_run import worker_pids as _worker_pids

ROOT = Path(__file__).resolve().parents[1]


def _steps(run_path: Path) -> int:
    try:
        return int(json.loads((run_path / "summary.json").read_text())["steps"])
    except (OSError, json.JSONDecodeError, KeyError, ValueError):
        return 0


def _run_processes(run_id: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", run_id], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line and "pytest" not in line]


def test_resume_refuses_a_different_config(tmp_path):
    run_path = tmp_path / "r1"
    run_path.mkdir()
    (tmp_path / "a.toml").write_text(CONFIG)
    (tmp_path / "b.toml").write_text(CONFIG.replace("lr = 1e-4", "lr = 5e-4"))
    from schemas.config import dump_config, load_config

    dump_config(load_config(tmp_path / "a.toml"), run_path / "config.json")
    assert resumed_config(run_path, str(tmp_path / "a.toml"), ["run.max_steps=40"]).run.max_steps == 40
    with pytest.raises(ResumeError, match="learner.lr"):
        resumed_config(run_path, str(tmp_path / "b.toml"), [])
    with pytest.raises(ResumeError, match="only run limits"):
        resumed_config(run_path, None, ["learner.lr=1"])


@pytest.mark.e2e
def test_kill_learner_then_launcher_then_resume_loses_nothing(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(CONFIG)
    run_id = f"rs{os.getpid()}"
    run_path = tmp_path / "runs" / run_id
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            str(cfg),
            "--run-dir",
            str(tmp_path / "runs"),
            "--run-id",
            run_id,
            "--max-steps",
            "60",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    resumed = None
    try:
        deadline = time.monotonic() + 240
        while _steps(run_path) < 8 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
        learner = _worker_pids(run_id, "learner")
        assert _steps(run_path) < 60 and learner, f"run did not reach step 8 in time, or finished ({_steps(run_path)})"
        os.kill(learner[0], signal.SIGKILL)  # after its step-5 checkpoint, with later steps to roll back
        restarted = None
        while time.monotonic() < deadline and first.poll() is None and restarted is None:
            live = json.loads((run_path / "summary.json").read_text())
            if live.get("worker_restarts", {}).get("learner", 0) >= 1 and _steps(run_path) >= 12:
                restarted = live
            time.sleep(0.5)
        assert restarted, "the killed learner was not restarted (or the run stepped no further)"
        before = _steps(run_path)
        assert before < 60, f"the run finished before the launcher could be killed (steps={before})"
        os.kill(first.pid, signal.SIGKILL)  # the launcher only: its workers and server are orphaned
        first.wait(10)
        t_kill = time.monotonic()
        while any(_worker_pids(run_id, r) for r in ("sampler", "rollout", "verifier", "learner", "scheduler")):
            assert time.monotonic() - t_kill < 60, "orphaned workers did not stop by themselves within 60 s"
            time.sleep(0.5)
        orphan_stop_s = time.monotonic() - t_kill

        t_resume = time.monotonic()
        resumed = subprocess.Popen(
            [sys.executable, "-m", "rlbus.cli", "up", "--resume", str(run_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        first_new_step = None
        while resumed.poll() is None and time.monotonic() - t_resume < 300:
            if (
                first_new_step is None
                and _steps(run_path) > 0
                and json.loads((run_path / "run.json").read_text()).get("launcher_pid") == resumed.pid
            ):
                first_new_step = time.monotonic() - t_resume
            time.sleep(0.5)
        out, _ = resumed.communicate(timeout=120)
    finally:
        for p in (first, resumed):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert resumed.returncode == 0, text[-3000:]
    s = json.loads((run_path / "summary.json").read_text())
    assert s["final"] is True and s["steps"] >= 60, s
    assert s["lost"] == 0 and s["trained_twice"] == 0, s
    assert s["learner_rollbacks"] >= 1, s  # the restarted learner restored its checkpoint and replayed REWARDS
    assert sum(s["task_fates"].values()) == s["tasks_published"]
    assert "reusing the run's nats-server" in text, text[-2000:]
    print(
        f"steps before kill {before}; orphans stopped in {orphan_stop_s:.1f}s; "
        f"resume to supervised run {first_new_step}s; learner rollbacks {s['learner_rollbacks']}"
    )
    time.sleep(1)
    assert not _run_processes(run_id), _run_processes(run_id)
