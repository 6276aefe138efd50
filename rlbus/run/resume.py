"""`rlbus up --resume <run-dir>/<run_id>`: continue a run whose launcher died.

Guarantees:
- The run's config comes from its run directory (`config.json`); a CONFIG given as well
  must match it in everything but the run's limits (`run.max_steps`, `run.max_minutes`,
  `run.drain_seconds`), or resume is refused with the differing keys named.
- A run whose launcher is still alive is refused (never two supervisors, never two
  learners; the learner's KV lease guards the latter as well).
- Workers the dead launcher left (pids in `run.json`, checked against their command
  line so a recycled pid is never signalled) are stopped: SIGTERM, then SIGKILL after a
  grace period. They normally stopped by themselves already (see `bus.session`).
- The NATS server: the recorded one is reused when it still answers (its pid is kept so
  the resumed launcher stops it at the end); otherwise a new embedded server is started
  on the run's own store directory, so every stream and bucket is still there.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlbus.run.folder import RunFolder, alive
from schemas.config import ConfigError, RunConfig, load_config

LIMIT_KEYS = {"max_steps", "max_minutes", "drain_seconds"}


class ResumeError(RuntimeError):
    """The run cannot be resumed as asked (the message says why and what to do)."""


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resumed_config(run_path: Path, config_path: str | None, overrides: list[str]) -> RunConfig:
    """The run's saved config (limits may be overridden); a given CONFIG must match it."""
    saved_file = RunFolder(run_path).config_json
    if not saved_file.exists():
        raise ResumeError(f"{run_path} has no config.json: is it a run folder (<run-dir>/<run_id>)?")
    limit_overrides = [o for o in overrides if o.split("=", 1)[0].removeprefix("run.") in LIMIT_KEYS]
    other = [o for o in overrides if o not in limit_overrides]
    if other:
        raise ResumeError(f"--resume keeps the run's config; only run limits may change, not {other}")
    cfg = load_config(saved_file, limit_overrides)
    if config_path:
        try:
            given = load_config(config_path, [])
        except ConfigError as exc:
            raise ResumeError(str(exc)) from None
        a, b = _flatten(cfg.model_dump(mode="json")), _flatten(given.model_dump(mode="json"))
        ignore = {f"run.{k}" for k in LIMIT_KEYS | {"run_id", "run_dir", "nats_url"}}
        diff = sorted(k for k in set(a) | set(b) if k not in ignore and a.get(k) != b.get(k))
        if diff:
            raise ResumeError(
                f"{config_path} does not match the run's config in {diff[:10]}; resume without "
                f"CONFIG (the run's own config.json is used) or start a new run"
            )
    return cfg


def read_state(run_path: Path) -> dict:
    """The run's `run.json` (what the launcher recorded); ResumeError when there is none."""
    folder = RunFolder(run_path)
    state = folder.state()
    if not state:
        raise ResumeError(
            f"cannot read {folder.run_json} (missing or not a JSON object); was the run started with `rlbus up`?"
        )
    return state


def stop_leftover_workers(state: dict, grace_s: float = 30.0) -> list[int]:
    """Stop the recorded workers still running for this run; returns the pids signalled."""
    run_id = state["run_id"]
    pids = [p for p in state.get("workers", {}).values() if alive(p, f"--run-id {run_id}")]
    for p in pids:
        os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p, run_id) for p in pids):
        time.sleep(0.2)
    for p in pids:
        if alive(p, run_id):
            os.kill(p, signal.SIGKILL)
    return pids


def check_launcher_gone(state: dict) -> None:
    """Refuse while the recorded launcher still runs."""
    pid = state.get("launcher_pid")
    if pid and pid != os.getpid() and alive(pid, "rlbus"):
        raise ResumeError(
            f"the run's launcher (pid {pid}) is still running; stop it first (kill {pid}) or let it finish"
        )


class AdoptedServer:
    """A nats-server a dead launcher left running, stopped by pid at the end."""

    def __init__(self, url: str, pid: int | None, monitor_url: str | None = None) -> None:
        self.url, self.pid, self.monitor_url = url, pid, monitor_url

    def stop(self, timeout: float = 10.0) -> None:
        if not alive(self.pid, "nats-server"):
            return
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(self.pid, "nats-server"):
            time.sleep(0.1)
        if alive(self.pid, "nats-server"):
            os.kill(self.pid, signal.SIGKILL)
