"""Side-by-side benchmarks against peers and limits (`make bench`).

`skip_unless(__file__, modules=..., cuda=..., docker=..., hint=...)` at the top of a benchmark's
`main` makes `make bench` (in `.venv`: no vLLM, CPU torch) pass over what cannot run
here: when a requirement is missing it prints ONE line to stdout,
`SKIP bench/<name>.py: needs <what> (<how to get it>)[; <hint>]`, and exits 0. It checks cheaply
(`importlib.util.find_spec` for modules, imports nothing it names; torch only for `cuda`;
one ping of the Docker engine for `docker`) and returns None when everything is there.

`start_roles(...)` / `stop_procs(...)`: the worker processes of a bench side (each role as
`python -m rlbus.cli worker ROLE` in its own session, its output in `<log_prefix>-<role>.log`),
and stopping them (SIGTERM to each live process group, SIGKILL to what is left after `timeout`).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(path: str) -> str:
    """`bench/<name>.py` for a benchmark's `__file__` (as given where it lies elsewhere)."""
    p = Path(path).resolve()
    try:
        return p.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _module_need(module: str, script: str) -> str:
    if module == "vllm":
        return f"vLLM (make vllm-env; run with .venv-vllm/bin/python {script})"
    return f"the Python module {module!r} (not importable in {sys.executable})"


def missing(script: str, *, modules: tuple[str, ...] = (), cuda: bool = False, docker: bool = False) -> list[str]:
    """What benchmark `script` needs and this Python/machine lacks, one phrase each ([] when all is there)."""
    name = _script(script)
    needs = [_module_need(m, name) for m in modules if importlib.util.find_spec(m) is None]
    if cuda:
        import torch

        if not torch.cuda.is_available():
            needs.append(f"a CUDA GPU (torch {torch.__version__} sees none here)")
    if docker:
        from sandbox_workers.factory import docker_available

        if not docker_available():
            needs.append("a Docker engine (none answers here: `docker info`)")
    return needs


def skip_unless(
    script: str, *, modules: tuple[str, ...] = (), cuda: bool = False, docker: bool = False, hint: str = ""
) -> None:
    """Return if benchmark `script` (its `__file__`) can run here; else print
    `SKIP bench/<name>.py: needs ...[; hint]` (one line, stdout) and exit 0."""
    needs = missing(script, modules=modules, cuda=cuda, docker=docker)
    if needs:
        print(f"SKIP {_script(script)}: needs {' and '.join(needs)}" + (f"; {hint}" if hint else ""), flush=True)
        raise SystemExit(0)


ROLES = ("learner", "verifier", "rollout", "sampler")


def start_roles(
    cfg_path: Path, nats_url: str, run_id: str, run_dir: Path, log_prefix: Path, roles: tuple[str, ...] = ROLES
) -> list[subprocess.Popen]:
    """Start each role as `python -m rlbus.cli worker ROLE` (see the module docstring)."""
    procs = []
    for role in roles:
        with open(f"{log_prefix}-{role}.log", "wb") as log:  # the child holds its own descriptor
            cmd = [sys.executable, "-m", "rlbus.cli", "worker", role, "--config", str(cfg_path)]
            cmd += ["--nats-url", nats_url, "--run-id", run_id, "--run-dir", str(run_dir)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def stop_procs(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    """SIGTERM each live process group, then SIGKILL each one still running after `timeout` s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
