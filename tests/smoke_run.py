"""The one `rlbus up` of `make test`: a short real run, shared by the tests that read a
finished run (tests/test_up.py's smoke checks, samples, report, export).

Guarantees:
- `run_smoke(tmp)` runs `rlbus up` once: every role its own process, SFT on, pipeline
  evaluation, file:// weights (prefetch hints, mapped loads, the newest 4 kept), and a
  rollout worker killed hard after the learner's third step. It never raises: what
  happened is in the returned `SmokeRun` (exit code, console, whether the kill landed),
  and the run's process group is killed by PID whatever happened.
- The run folder is left as the launcher wrote it; tests that share it only read it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[run]
max_steps = 25
max_minutes = 6
drain_seconds = 8
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
[sft]
max_steps = 30
seconds = 30
threads = 1
[sampler]
group_size = 4
max_tokens = 4
max_inflight_tasks = 16
[rollout]
batch_tasks = 4
[learner]
lr = 1e-4
groups_per_step = 4
step_window_s = 1.0
checkpoint_every = 5
[scheduler.eval]
n = 20
every_versions = 10
"""
"""A tiny run (test_resume.py and test_sharded_up.py use it too): 25 steps, SFT of 30 steps."""

KILL_AT_STEP = 3


@dataclass
class SmokeRun:
    """What the smoke run left: its folder, id, console and how it ended."""

    tmp: Path
    run_id: str
    run_path: Path
    returncode: int | None
    console: str
    killed: bool

    def problem(self) -> str:
        """'' when the run exited 0 after the kill landed; else why not, with the console's tail."""
        if self.killed and self.returncode == 0:
            return ""
        return f"smoke run: exit {self.returncode}, killed={self.killed}\n{self.console[-3000:]}"


def worker_pids(run_id: str, role: str) -> list[int]:
    """PIDs of `rlbus worker ROLE` processes of this run (by command line)."""
    out = subprocess.run(
        ["pgrep", "-f", f"rlbus.cli worker {role} .*--run-id {run_id}"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def _steps(run_path: Path) -> int:
    try:
        return int(json.loads((run_path / "summary.json").read_text())["steps"])
    except (OSError, ValueError, KeyError):
        return 0


def run_smoke(tmp: Path) -> SmokeRun:
    """Run the smoke `rlbus up` in `tmp` (see the module docstring); at most ~8 minutes."""
    cfg = tmp / "smoke.toml"
    cfg.write_text(CONFIG)
    run_id = f"smoke{os.getpid()}"
    run_path = tmp / "runs" / run_id
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            str(cfg),
            "--run-dir",
            str(tmp / "runs"),
            "--run-id",
            run_id,
            "--max-steps",
            "25",
            "--set",
            "scheduler.eval.mode=pipeline",  # evaluates through purpose=eval tasks
            "--set",
            f"learner.weight_store=file://{tmp}/weights",
            "--set",
            "learner.keep_versions=4",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    killed, out = False, b""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not killed:
            if _steps(run_path) >= KILL_AT_STEP:
                pids = worker_pids(run_id, "rollout")
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed = True
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            out += proc.communicate()[0] or b""
    return SmokeRun(tmp, run_id, run_path, proc.returncode, out.decode(errors="replace"), killed)
