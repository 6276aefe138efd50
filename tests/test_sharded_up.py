"""`rlbus up` with `learner.world_size = 2` (gloo, CPU): rank 1 is killed mid-run; rank 0
notices, stops and exits, the launcher restarts the learner, which resumes from its last
DCP checkpoint. The run completes with nothing lost and nothing trained twice, and no
rank of the killed learner outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.smoke_run import CONFIG

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is gone


def _ranks(run_path: Path) -> dict[str, int]:
    try:
        return {r: int(p) for r, p in json.loads((run_path / "learner_ranks.json").read_text())["pids"].items()}
    except (OSError, json.JSONDecodeError, KeyError):
        return {}


def _steps(run_path: Path) -> int:
    try:
        return int(json.loads((run_path / "summary.json").read_text())["steps"])
    except (OSError, json.JSONDecodeError, KeyError, ValueError):
        return 0


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_up_two_ranks_survives_a_killed_rank_and_loses_nothing(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("2 gloo ranks need 2 CPU cores")
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(CONFIG)
    run_id = f"ws2{os.getpid()}"
    run_path = tmp_path / "runs" / run_id
    proc = subprocess.Popen(
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
            str(STEPS),
            "--set",
            "learner.world_size=2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not killed:
            ranks = _ranks(run_path)
            if _steps(run_path) >= 8 and set(ranks) == {
                "0",
                "1",
            }:  # after the step-5 checkpoint, with steps to roll back
                os.kill(ranks["1"], signal.SIGKILL)
                killed = ranks
            time.sleep(0.3)
        assert killed, "the run never reached step 8 with 2 ranks"
        t_kill = time.monotonic()
        while _alive(killed["0"]):
            assert time.monotonic() - t_kill < 20, "rank 0 did not stop after rank 1 died"
            time.sleep(0.2)
        stop_s = time.monotonic() - t_kill
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    s = json.loads((run_path / "summary.json").read_text())
    assert s["final"] is True and s["steps"] >= STEPS, s
    assert s["worker_restarts"].get("learner", 0) >= 1, s["worker_restarts"]
    assert s["learner_rollbacks"] >= 1, s  # it restored its DCP checkpoint and replayed REWARDS
    assert s["lost"] == 0 and s["trained_twice"] == 0, s
    assert sum(s["task_fates"].values()) == s["tasks_published"]
    log = (run_path / "logs" / "learner.log").read_text()
    assert "learner.rank_died" in log and log.count("learner.ranks_started") >= 2
    assert (run_path / "checkpoints" / "learner.dcp" / "LATEST").exists()
    assert not (run_path / "checkpoints" / "learner.pt").exists()
    assert not _ranks(run_path), "the ranks file outlived a clean stop"
    assert not any(_alive(p) for p in killed.values())
    print(
        f"rank 0 stopped {stop_s:.1f}s after rank 1 was killed; learner restarts {s['worker_restarts']['learner']}, "
        f"rollbacks {s['learner_rollbacks']}, wall {s['wall_seconds']}s"
    )
