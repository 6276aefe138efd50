"""The start gate: `rlbus up` starts its roles while it still prepares the model.

Most of a role's start-up on a small machine is imports (torch and transformers' model code: about
5 CPU-seconds per process here), and none of it needs the model. So the launcher starts the worker
processes as soon as the run's server is up and its config.json written, with env `START_GATE_ENV`
naming a gate file; each worker imports what it will need, then waits at the gate. The launcher
opens the gate (creates the file) once the model is prepared (tiny model built, SFT done) and the
run's streams exist: the imports overlap the model's preparation instead of following it.

Guarantees:
- `pass_gate(role, cfg)` returns at once when the environment names no gate (a worker started any
  other way: compose, Kubernetes, tests, a benchmark) or the gate is already open.
- Otherwise it imports the role's module, and torch plus transformers' model-loading code for a
  role that loads a model (`loads_model`), then waits for the gate file; it never connects to
  NATS or reads the model before the gate opens.
- A worker waiting at a gate whose launcher is gone (env `RLBUS_LAUNCHER_PID` no longer a live
  process) exits with code 1 and a line saying so, so no process outlives a failed `rlbus up`.
- `close_gate(path)` (before any worker starts: a resumed run's old gate) and `open_gate(path)` are
  the launcher's side.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

START_GATE_ENV = "RLBUS_START_GATE"
"""Env: the gate file a worker started by `rlbus up` waits for (absent: no gate)."""
POLL_S = 0.05
"""How often a waiting worker looks for the gate file."""


def loads_model(role: str, cfg) -> bool:
    """Whether `role` loads the policy model under `cfg` (and so needs torch and transformers)."""
    if role == "learner":
        return cfg.learner.policy == "hf"
    if role == "rollout":
        return cfg.rollout.engine == "hf"
    return role == "scheduler"  # the local evaluation's HF engine


def prewarm(module: str, model: bool) -> None:
    """Import the role's module and, for a role that loads a model, what loading one imports."""
    importlib.import_module(module)
    if model:
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401 - the slow part of any HF model's first load


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pass_gate(role: str, module: str, cfg) -> float:
    """Prewarm, then wait for the gate named in the environment; seconds waited (0.0 without a gate)."""
    gate = os.environ.get(START_GATE_ENV)
    if not gate or Path(gate).exists():
        return 0.0
    prewarm(module, loads_model(role, cfg))
    launcher = int(os.environ.get("RLBUS_LAUNCHER_PID", "0") or 0)
    t0 = time.monotonic()
    while not Path(gate).exists():
        if launcher and not _alive(launcher):
            sys.exit(f"rlbus worker {role}: the launcher (pid {launcher}) is gone before the run started")
        time.sleep(POLL_S)
    return time.monotonic() - t0


def open_gate(path: Path) -> None:
    """Let the waiting workers go on (the model is ready and the streams exist)."""
    path.write_text(f"{time.time()}\n")


def close_gate(path: Path) -> None:
    """Remove a gate left by an earlier launcher of this run, before any worker starts."""
    path.unlink(missing_ok=True)
