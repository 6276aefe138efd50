"""Harness-owned episodes (`kind = "agent"` domains): one harness process per episode, in a sandbox.

Per episode (each sample of each task), `run_agent_tasks`:
1. mints the episode's key on the worker's endpoint (`rollout_workers.endpoint`); each call
   generates at most the task's `max_tokens` (the domain's), whatever the harness asks;
2. opens the harness's sandbox (`agent.sandbox`; `auto` follows `sandbox.backend`):
   - bwrap: a process sandbox (bubblewrap: no network, a dedicated uid, rlimits `agent.*`);
   - docker: a container of its own (`sandbox_workers.docker_harness`; `sandbox.repo_image` for
     a repository task, else `sandbox.image`) with the docker backend's isolation
     (`network_mode=none`, read-only root, `agent.memory_mb`/`agent.pids` as cgroup limits,
     every capability dropped, uid 65534), the episode dir at `AGENT_DIR`, the endpoint
     socket's directory at `SOCK_DIR_INSIDE` and `agent.python_path` at `PY_INSIDE`/i bound
     read-only (the image's python3 must be this interpreter's major.minor: checked once per
     image), removed when the episode ends;
   with the task's repository in `/work` when it has one;
3. runs `rollout_workers/agent_launch.py` there with the domain's `command` (`{task_file}`
   and `{task}` replaced), within `agent.timeout_s`. The environment is cleared, then: `OPENAI_API_KEY`
   (the episode's key), `OPENAI_BASE_URL` (a relay on the sandbox's own loopback to the
   endpoint's Unix socket, bound in at `SOCK_INSIDE`; docker: in `SOCK_DIR_INSIDE`),
   `RLBUS_TASK_FILE` (the public task,
   `schemas.agent_task.public_task`, bound read-only with the launcher at `AGENT_DIR`),
   `PYTHONPATH` (`agent.python_path`, bound read-only), `HOME=/tmp`, and `agent.env` (docker:
   over the container's own PATH, TMPDIR, LANG, PYTHONDONTWRITEBYTECODE and HOSTNAME);
4. ends the episode on the endpoint (its recorded Trajectory), exports a repository task's
   diff as `artifacts["diff"]` (the `repo` verifier's input, as for rlbus-owned episodes),
   and writes `artifacts["agent"]` (`schemas.agent_task`); the wrapped domain's verifier
   scores it on the verifier side.

Guarantees:
- Outcomes: exit 0 is `ok`; past `agent.timeout_s` every process of the harness is killed and
  the episode ends with `timeout` (verified as it stands); a non-zero exit after the policy
  answered at least once is `harness_error` (finish_reason `error`, stderr tail kept), which
  the verifier worker scores 0. Infrastructure errors raise `SandboxUnavailable` (the batch is
  retried, then dead-lettered; nothing published): a harness that cannot start (launcher's
  `NOT_STARTED_CODE`), one that ends (exit, crash or timeout) without ever calling the policy, an engine
  failure behind the endpoint, a sandbox that cannot open (no bubblewrap and no
  `agent.allow_host`; in docker: no engine answering, a missing image, a python3 of another
  version), a repository state that cannot be exported.
- Without bubblewrap, harnesses run as plain host processes only with `agent.allow_host`
  (rlimits and a dedicated uid only; `sandbox.allow_degraded` is no consent); the console
  says so in red, once per process. The docker path never falls back: `agent.allow_host` is
  for the bwrap path only.
- The harness never gets the hidden payload, the NATS credentials or another episode's key;
  its key reaches only its own episode and is closed (409 afterwards) when the episode ends.
- Every sandbox and episode directory is removed, every key closed, whatever happens.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from rollout_workers.agent import DIFF_ARTIFACT, SandboxUnavailable
from rollout_workers.agent_launch import NOT_STARTED, NOT_STARTED_CODE
from sandbox_workers.async_sandbox import LocalAsyncSandbox
from sandbox_workers.base import Limits
from schemas import Task, Trajectory
from schemas.agent_task import AGENT_ARTIFACT, HARNESS_ERROR, public_task

log = structlog.get_logger()

AGENT_DIR = "/opt/rlbus-agent"
"""Inside the sandbox: the launcher and the task file (read-only)."""
SOCK_INSIDE = "/run/rlbus-endpoint.sock"
"""Inside the bwrap sandbox: the endpoint's Unix socket."""
SOCK_DIR_INSIDE = "/opt/rlbus-endpoint"
"""Inside a harness container: the endpoint socket's directory (read-only)."""
PY_INSIDE = "/opt/rlbus-py"
LAUNCHER = Path(__file__).with_name("agent_launch.py")


def agent_domains(cfg) -> set[str]:
    """The config's `kind = "agent"` domains."""
    return {d for d, dc in cfg.sampler.domains.items() if dc.kind == "agent"}


def python_dirs(ac) -> list[str]:
    """Host directories of `agent.python_path` (`purelib`: this interpreter's site-packages)."""
    return [sysconfig.get_paths()["purelib"] if p == "purelib" else str(Path(p).resolve()) for p in ac.python_path]


def harness_argv(command: list[str], task_file: str, instruction: str) -> list[str]:
    """The domain's command with `{task_file}` (the task file's path) and `{task}` (its
    `instruction`: for harnesses that take the task as an argument, as `mini -t`) replaced."""
    return [a.replace("{task_file}", task_file).replace("{task}", instruction) for a in command]


def _limits(ac) -> Limits:
    return Limits(
        memory_mb=ac.memory_mb,
        pids=ac.pids,
        cpu_seconds=int(ac.timeout_s) + 1,
        file_size_mb=64,
        nofile=1024,
        tmp_mb=512,
    )


@functools.cache
def _resolved(backend: str) -> str:
    from sandbox_workers.factory import resolve_backend

    return resolve_backend(backend)


def harness_sandbox(cfg) -> str:
    """Where this config's harnesses run: "docker" or "bwrap" (`agent.sandbox`; `auto` follows
    `sandbox.backend`, an `auto` backend resolved once per process)."""
    choice = cfg.agent.sandbox
    if choice != "auto":
        return choice
    return "docker" if _resolved(cfg.sandbox.backend) == "docker" else "bwrap"


async def _open_docker(cfg, task: Task, binds) -> LocalAsyncSandbox:
    """A per-episode harness container (`sandbox_workers.docker_harness`) with `binds` read-only;
    `sandbox.repo_image` for a repository task, else `sandbox.image`. Fails closed: any engine
    error raises (the caller's infrastructure error), nothing runs on the host."""
    from sandbox_workers.docker_harness import DockerHarnessSandbox

    image = cfg.sandbox.repo_image if task.workspace else cfg.sandbox.image
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-sandbox")
    sb = DockerHarnessSandbox(binds)
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(executor, lambda: sb.start(image, _limits(cfg.agent), cfg.agent.timeout_s))
        box = LocalAsyncSandbox(sb, executor)
        if python_dirs(cfg.agent):
            await _check_python(box, image)
    except BaseException:
        await loop.run_in_executor(executor, sb.close)
        executor.shutdown(wait=False)
        raise
    return box


_PY_CHECKED: set[str] = set()


async def _check_python(sb, image: str) -> None:
    """The image's python3 must be this interpreter's major.minor (bound site-packages hold its
    compiled extensions); checked once per image and process."""
    if image in _PY_CHECKED:
        return
    from sandbox_workers.docker_harness import PY_VERSION_ARGV

    here = "%d.%d" % sys.version_info[:2]
    res = await sb.execute(PY_VERSION_ARGV, 30)
    there = res.stdout.strip()
    if res.exit_code != 0 or there != here:
        raise SandboxUnavailable(
            f"image {image!r} has python3 {there or '(none: ' + res.stderr.strip()[-200:] + ')'}, but agent.python_path "
            f"binds packages of this worker's Python {here}: build the image from python:{here}-slim "
            "(rlbus sandbox build-image), or set agent.python_path = [] with the harness installed in the image"
        )
    _PY_CHECKED.add(image)


async def _open_bwrap(ac) -> LocalAsyncSandbox:
    """A process sandbox sized for a harness; host processes only with `agent.allow_host`."""
    from sandbox_workers.process import ProcessSandbox

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-sandbox")
    sb = ProcessSandbox(allow_degraded=ac.allow_host)
    sb.degraded_source = "agent.allow_host (harnesses run as plain host processes)"
    try:
        await asyncio.get_running_loop().run_in_executor(
            executor, lambda: sb.start(limits=_limits(ac), timeout=ac.timeout_s)
        )
    except BaseException:
        executor.shutdown(wait=False)
        raise
    if sb.isolation != "bwrap":
        if not ac.allow_host:  # degraded by sandbox.allow_degraded or its env var: not consent for harnesses
            await asyncio.get_running_loop().run_in_executor(executor, sb.close)
            executor.shutdown(wait=False)
            raise SandboxUnavailable(
                "bubblewrap is unavailable, so the harness would run as a plain host process: install bubblewrap "
                "(apt-get install -y bubblewrap), or set agent.allow_host = true to consent"
            )
        log.warning("agent.host_process", reason="no bubblewrap; allowed by agent.allow_host")
    return LocalAsyncSandbox(sb, executor)


def _episode_dir(task: Task) -> Path:
    """A host directory (0755, files 0644) with the launcher and the public task file."""
    d = Path(tempfile.mkdtemp(prefix="rlbus-agent-"))
    d.chmod(0o755)
    (d / "task.json").write_text(json.dumps(public_task(task), ensure_ascii=False))
    shutil.copyfile(LAUNCHER, d / "agent_launch.py")
    for f in d.iterdir():
        f.chmod(0o644)
    return d


def _docker_binds(ac, epdir: Path, uds: str) -> tuple[list[tuple[str, str]], str]:
    """(read-only binds of a harness container, the socket's path inside): the episode dir at
    `AGENT_DIR`, the endpoint socket's directory at `SOCK_DIR_INSIDE`, `python_path` at `PY_INSIDE`/i."""
    pydirs = python_dirs(ac)
    binds = [(str(epdir), AGENT_DIR), (os.path.dirname(uds), SOCK_DIR_INSIDE)]
    binds += [(d, f"{PY_INSIDE}/{i}") for i, d in enumerate(pydirs)]
    return binds, f"{SOCK_DIR_INSIDE}/{os.path.basename(uds)}"


def _invocation(sb, ac, command, epdir: Path, key: str, uds: str, base_url: str, instruction: str):
    """(argv, execute options) of the harness run in `sb` (bwrap: inside paths and binds; docker:
    inside paths, the binds were given at creation; else host paths)."""
    boxed = sb.isolation in ("bwrap", "docker")
    pydirs = python_dirs(ac)
    here = AGENT_DIR if boxed else str(epdir)
    task_file = f"{here}/task.json"
    inside_py = [f"{PY_INSIDE}/{i}" for i in range(len(pydirs))] if boxed else pydirs
    env = {**ac.env, "OPENAI_API_KEY": key, "RLBUS_TASK_FILE": task_file, "PYTHONPATH": ":".join(inside_py)}
    options: dict = {"env": env}
    if sb.isolation == "docker":
        env["HOME"] = "/tmp"
        route = ["--sock", _docker_binds(ac, epdir, uds)[1]]
    elif boxed:
        env["HOME"] = "/tmp"
        options["ro_binds"] = ((str(epdir), AGENT_DIR), (uds, SOCK_INSIDE), *zip(pydirs, inside_py, strict=True))
        route = ["--sock", SOCK_INSIDE]
    else:
        options["ro_binds"], route = (), ["--url", base_url]
    argv = ["python3", f"{here}/agent_launch.py", *route, "--", *harness_argv(command, task_file, instruction)]
    return argv, options


def _tail(text: str, n: int) -> str:
    return text[-n:]


def _outcome(ep, res, task: Task) -> tuple[str, str, int]:
    """(status, finish reason, calls) of a finished harness run, or SandboxUnavailable when it
    is an infrastructure error (see the module guarantees)."""
    calls = len(ep.calls) if ep is not None else 0
    if ep is not None and ep.infra_error:
        raise SandboxUnavailable(f"the endpoint's engine failed for task {task.task_id}: {ep.infra_error}")
    if res.exit_code == NOT_STARTED_CODE and NOT_STARTED in res.stderr:
        raise SandboxUnavailable(f"harness of task {task.task_id}: {_tail(res.stderr, 400).strip()}")
    if calls == 0:  # nothing of the policy's to score or train on: the harness's own failure
        raise SandboxUnavailable(
            f"harness of task {task.task_id} ended (exit {res.exit_code}) without calling the policy: "
            f"{_tail(res.stderr, 400).strip()}"
        )
    if res.timed_out:
        return "timeout", "timeout", calls
    if res.exit_code == 0:
        return "ok", "stop", calls
    return HARNESS_ERROR, "error", calls


async def _export(sb, task: Task) -> dict[str, bytes]:
    """A repository task's diff (`artifacts["diff"]`, as rlbus-owned repo episodes export it)."""
    if not task.workspace:
        return {}
    from rollout_workers.repo_tools import export_diff

    try:
        diff, _ = await export_diff(sb, task.workspace)
    except Exception as exc:
        raise SandboxUnavailable(f"final repository state of task {task.task_id}: {exc}") from exc
    return {DIFF_ARTIFACT: diff.encode()}


async def run_one(endpoint, cfg, task: Task, sample_index: int, uds: str) -> Trajectory:
    """One harness-owned episode of `task` (see the module guarantees)."""
    ac, command = cfg.agent, cfg.sampler.domains[task.domain].command
    try:
        key = endpoint.open_episode(task, sample_index, call_tokens=task.max_tokens)
    except Exception as exc:
        raise SandboxUnavailable(f"no endpoint episode for task {task.task_id}: {exc}") from exc
    sb, epdir, closed = None, None, False
    try:
        epdir = _episode_dir(task)
        try:
            if harness_sandbox(cfg) == "docker":
                sb = await _open_docker(cfg, task, _docker_binds(ac, epdir, uds)[0])
            else:
                sb = await _open_bwrap(ac)
            if task.workspace:
                from rollout_workers.repo_tools import setup_workspace

                await setup_workspace(sb, task.workspace)
        except SandboxUnavailable:
            raise
        except Exception as exc:
            raise SandboxUnavailable(f"harness sandbox failed for task {task.task_id}: {exc}") from exc
        instruction = public_task(task)["instruction"]
        argv, options = _invocation(sb, ac, command, epdir, key, uds, endpoint.base_url, instruction)
        t0 = time.monotonic()
        res = await sb.execute_with(argv, ac.timeout_s, **options)
        seconds = time.monotonic() - t0
        status, reason, calls = _outcome(endpoint.episodes.episode(key), res, task)
        artifacts = await _export(sb, task)
        record = {
            "status": status,
            "exit_code": res.exit_code,
            "stderr_tail": _tail(res.stderr, ac.stderr_chars) if status != "ok" else "",
            "seconds": round(seconds, 3),
            "calls": calls,
            "isolation": sb.isolation,
        }
        artifacts[AGENT_ARTIFACT] = json.dumps(record).encode()
        traj = endpoint.close_episode(key, reason)
        closed = True
        finish = traj.finish_reason if status == "ok" else reason
        return traj.model_copy(update={"finish_reason": finish, "artifacts": {**traj.artifacts, **artifacts}})
    finally:
        if not closed:
            try:
                endpoint.close_episode(key, "error")
            except KeyError:
                pass
        if sb is not None:
            await sb.close()
        if epdir is not None:
            shutil.rmtree(epdir, ignore_errors=True)


async def run_agent_tasks(endpoint, cfg, tasks: list[Task], uds: str, slots: int = 8) -> list[Trajectory]:
    """Every sample of `tasks` as a harness-owned episode, at most `slots` at once; raises
    `SandboxUnavailable` for the batch when any episode hit an infrastructure error."""
    sem = asyncio.Semaphore(slots)

    async def one(task: Task, i: int) -> Trajectory:
        async with sem:
            return await run_one(endpoint, cfg, task, i, uds)

    results = await asyncio.gather(*(one(t, i) for t in tasks for i in range(t.group_size)), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            if isinstance(r, SandboxUnavailable):
                raise r
            raise SandboxUnavailable(f"harness episode failed: {type(r).__name__}: {r}") from r
    return list(results)


def socket_dir() -> str:
    """A fresh host directory (0755) for the endpoint's Unix socket; its socket path."""
    d = tempfile.mkdtemp(prefix="rlbus-endpoint-")
    os.chmod(d, 0o755)
    return os.path.join(d, "endpoint.sock")
