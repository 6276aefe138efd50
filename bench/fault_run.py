"""One `rlbus up` run driven from outside for the fault matrix (`bench/faults.py`).

Guarantees:
- `FaultRun.start()` launches `rlbus up` (or `rlbus up --resume`) as its own process
  group, console to `<tmp>/console.log`; `stop_everything()` kills that group, every
  worker and server pid `run.json` ever named, by PID, whatever happened.
- `wait_steps(n)` / `wait_exit()` poll `summary.json` and the launcher; they never hang
  past their timeout.
- `dead_letters()` reads the reasons from the run store (SQLite `run.db` by default, or
  the configured SQL URL): what the DLQ holds and why.
- Reads only files and processes; it never connects to the run's NATS.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE_CONFIG = """
[run]
max_steps = 0
max_minutes = 1.5
drain_seconds = 5
heartbeat_timeout_s = 8
[model]
tokenizer = "char"
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
"""A small variant of examples/smoke.toml: 90 s in all (a 30-step SFT, about 45 s of RL at a few
learner steps per second, the drain), so a fault at ~20 s has the rest of the run to heal in."""


class FaultRun:
    """A run under test: its folder, its launcher, its console."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        config: str = BASE_CONFIG,
        overrides: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.tmp = tmp
        self.run_id = f"fault-{name}-{os.getpid()}"
        self.run_dir = tmp / "runs"
        self.run_path = self.run_dir / self.run_id
        self.config_file = tmp / f"{name}.toml"
        self.config_file.write_text(config)
        self.overrides, self.env = overrides, env
        self.console_path = tmp / f"{name}.console.log"
        self.proc: subprocess.Popen | None = None
        self.pids: set[int] = set()

    def start(self, resume: bool = False) -> None:
        """Launch `rlbus up` (fresh, or `--resume` of this run)."""
        cmd = [sys.executable, "-m", "rlbus.cli", "up"]
        if resume:
            cmd += ["--resume", str(self.run_path)]
        else:
            cmd += [str(self.config_file), "--run-dir", str(self.run_dir), "--run-id", self.run_id]
            for o in self.overrides:
                cmd += ["--set", o]
        out = self.console_path.open("ab")
        out.write(f"\n$ rlbus up {'--resume ' + str(self.run_path) if resume else self.config_file.name}\n".encode())
        out.flush()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(os.environ, **(self.env or {})),
        )
        out.close()

    # -- reading the run ---------------------------------------------------------------
    def summary(self) -> dict:
        """summary.json as it is now ({} before the first write)."""
        try:
            return json.loads((self.run_path / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def state(self) -> dict:
        """run.json (pids of the launcher, the server, every worker); remembers every pid seen."""
        try:
            st = json.loads((self.run_path / "run.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        self.pids |= {p for p in [st.get("server_pid"), *st.get("workers", {}).values()] if p}
        return st

    def steps(self) -> int:
        """Learner steps so far (summary.json)."""
        return int(self.summary().get("steps", 0) or 0)

    def pid(self, role: str) -> int:
        """The pid of `role`'s current worker (or `server`, `launcher`)."""
        st = self.state()
        found = {"server": st.get("server_pid"), "launcher": st.get("launcher_pid")}.get(role) or st.get(
            "workers", {}
        ).get(role)
        if not found:
            raise RuntimeError(f"no {role} pid in {self.run_path / 'run.json'}")
        return int(found)

    def console(self) -> str:
        """Everything the launcher printed so far."""
        try:
            return self.console_path.read_text(errors="replace")
        except OSError:
            return ""

    def messages(self) -> list[str]:
        """The launcher's `rlbus up: ...` lines (faults, what it did, how to continue)."""
        return [ln.strip() for ln in self.console().splitlines() if ln.strip().startswith("rlbus up:")]

    # -- waiting -----------------------------------------------------------------------
    def wait_steps(self, n: int, timeout: float) -> bool:
        """Until the learner has taken `n` steps (True), the launcher exited or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.state()
            if self.steps() >= n:
                return True
            if self.proc and self.proc.poll() is not None:
                return False
            time.sleep(0.25)
        return False

    def wait_exit(self, timeout: float) -> int | None:
        """The launcher's exit code, or None when it is still running after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.state()
            time.sleep(0.5)
        return self.proc.poll()

    def dead_letters(self, url: str | None = None) -> dict[str, int]:
        """DLQ entries by reason, from the run store (`url`, default the run's SQLite file)."""
        import sqlalchemy as sa

        url = url or f"sqlite:///{self.run_path / 'run.db'}"
        if url.startswith("sqlite") and not (self.run_path / "run.db").exists():
            return {}
        try:
            engine = sa.create_engine(url)
            with engine.connect() as conn:
                rows = conn.execute(sa.text("SELECT reason FROM dead_letters WHERE run_id = :r"), {"r": self.run_id})
                out = Counter(r[0][:120] for r in rows)
            engine.dispose()
        except sa.exc.SQLAlchemyError as exc:
            return {f"(run store unreadable: {type(exc).__name__})": 0}
        return dict(out)

    # -- cleaning up -------------------------------------------------------------------
    def stop_everything(self) -> None:
        """Kill the launcher's group and every pid the run ever recorded (workers, servers)."""
        self.state()
        if self.proc and self.proc.poll() is None:
            _killpg(self.proc.pid)
        for pid in self.pids:
            _killpg(pid)
        if self.proc:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _killpg(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
