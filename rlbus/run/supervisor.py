"""The worker processes of one `rlbus up` run: start, restart, stop, all by PID.

Guarantees:
- Each role runs as `rlbus worker ROLE` in its own process and session (so its process
  group holds whatever it started), logging to `<run>/logs/<role>.log`; `start(role, fork=True)`
  forks it from the launcher (`rlbus.run.forked`) instead of a fresh interpreter, restarts never.
- `poll()` restarts a worker that exited while the run is live, up to `MAX_RESTARTS`
  per role; one more exit is the run's failure, with the log to read.
- `kill_hung(role)` SIGKILLs a frozen worker's whole process group (a stopped process
  dies of SIGKILL too, so it never wakes to publish again); the next `poll()` restarts it.
- `<run>/run.json` always names the server URL, the server's pid and every worker's pid
  (`rlbus dlq`, `status` and `--resume` read it).
- No credential reaches argv or `run.json` (issue 27): the URL there is redacted
  (`schemas.redact`); workers get the full NATS URL in env `RLBUS_NATS_URL`, and any
  other secret (`secret_env`, e.g. `RLBUS_DB_URL`) by environment too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import structlog

from rlbus.run.folder import RunFolder
from rlbus.run.forked import ForkedWorker, fork_worker
from schemas.redact import NATS_URL_ENV, redact_url

log = structlog.get_logger()
MAX_RESTARTS = 5


class Supervisor:
    """Worker processes of one run: start, restart, stop by PID."""

    def __init__(
        self,
        run_path: Path,
        config_file: Path,
        nats_url: str,
        run_id: str,
        run_dir: Path,
        secret_env: dict[str, str] | None = None,
    ):
        self.run_path, self.config_file, self.nats_url, self.run_id, self.run_dir = (
            run_path,
            config_file,
            nats_url,
            run_id,
            run_dir,
        )
        self.secret_env = dict(secret_env or {})
        self.procs: dict[str, subprocess.Popen | ForkedWorker] = {}
        self.server_pid: int | None = None
        self.monitor_url: str | None = None  # the run's own nats-server monitoring endpoint
        self.restarts: dict[str, int] = {}
        self.stopping: set[str] = set()
        self.notes: list[str] = []  # what poll() did, for the console (taken by the run loop)
        self.folder = RunFolder(run_path)
        self.folder.logs.mkdir(parents=True, exist_ok=True)

    def start(self, role: str, fork: bool = False) -> None:
        """Start `rlbus worker ROLE` for this run (`fork`: forked from this process, sharing what it
        imported, `rlbus.run.forked`; only before the launcher has threads or ran torch)."""
        # the URL travels by environment (only this user reads /proc/<pid>/environ), never argv
        cmd = [
            sys.executable,
            "-m",
            "rlbus.cli",
            "worker",
            role,
            "--config",
            str(self.config_file),
            "--run-id",
            self.run_id,
            "--run-dir",
            str(self.run_dir),
        ]
        logf = open(self.folder.log(role), "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_LAUNCHER_PID=str(os.getpid()), **self.secret_env)
        env[NATS_URL_ENV] = self.nats_url
        # idle OpenMP threads sleep instead of spinning: every role shares the cores (bench/learner_scale.py
        # measured 3-5x the CPU per step with the default spin-wait on a loaded 2-core machine)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if fork:
            logf.close()
            self.procs[role] = fork_worker(cmd[3:], env, self.folder.log(role))
        else:
            self.procs[role] = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
            )
            logf.close()
        self.write_state()

    def write_state(self) -> None:
        """Record the server URL and every pid in `<run>/run.json` (for `rlbus dlq`, status, resume)."""
        state = {
            "run_id": self.run_id,
            "nats_url": redact_url(self.nats_url),
            "launcher_pid": os.getpid(),
            "server_pid": self.server_pid,
            "monitor_url": self.monitor_url,  # the embedded server's /varz, /jsz (None with an external one)
            "workers": {role: p.pid for role, p in self.procs.items()},
            "updated_at": time.time(),
        }
        self.folder.write_state(state)

    def poll(self) -> str | None:
        """Restart crashed workers; return a failure reason when one crash-loops."""
        for role, proc in list(self.procs.items()):
            if proc.poll() is None or role in self.stopping:
                continue
            self.restarts[role] = self.restarts.get(role, 0) + 1
            log.warning("launcher.worker_exited", role=role, code=proc.returncode, restarts=self.restarts[role])
            if self.restarts[role] > MAX_RESTARTS:
                return (
                    f"{role} exited {self.restarts[role]} times (last code {proc.returncode}); "
                    f"read {self.folder.log(role)}"
                )
            self.notes.append(
                f"{role} (pid {proc.pid}) exited with code {proc.returncode}: restarted "
                f"({self.restarts[role]} of {MAX_RESTARTS}); its unacked work is redelivered"
            )
            self.start(role)
        return None

    def signal(self, role: str) -> None:
        """Ask a worker to finish (SIGTERM)."""
        self.stopping.add(role)
        proc = self.procs.get(role)
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    async def wait(self, role: str, timeout: float) -> None:
        """Wait for a signalled worker; SIGKILL after `timeout`."""
        proc = self.procs.get(role)
        if not proc:
            return
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            log.warning("launcher.worker_killed", role=role)
            proc.kill()
            proc.wait(5)

    async def stop(self, roles, timeout: float) -> None:
        """Signal several workers, then wait for all of them."""
        for r in roles:
            self.signal(r)
        for r in roles:
            await self.wait(r, timeout)

    def kill_all(self) -> None:
        """Last resort: kill every worker still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def kill_hung(self, role: str) -> None:
        """SIGKILL a frozen worker's process group; `poll()` then restarts it like a crash."""
        proc = self.procs.get(role)
        if proc is None or proc.poll() is not None:
            return
        log.warning("launcher.worker_hung", role=role, pid=proc.pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        proc.wait(10)
