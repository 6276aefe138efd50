"""The tools of a Harbor episode, run in the task's own container (`sandbox_workers.harbor_box`).

A Harbor task (`verifier == "harbor"`, its container spec public in
`verifier_params["harbor"]`) opens its container on the episode's first tool call; an
episode that calls no tool opens none (the verifier then scores a pristine container).

Guarantees:
- `bash` runs `bash -c COMMAND` (or `sh` when the image has no bash) as the task's agent
  user in its working directory (or the call's `cwd`), for at most the call's `timeout`,
  capped by `harbor.tool_timeout_s`; `read_file` / `write_file` go through the engine's
  archive API (any path; relative ones from the working directory); observations are
  clipped head + tail to the caller's caps, as the repo tools' are, and signed by the run's
  exec recorder (`sandbox_workers.integrity`) when the worker has one, so the verifier worker
  checks them like any other observation.
- After every `bash` or `write_file` call, whatever its exit code, a container whose
  writable layer passed the task's `storage_mb` ends the episode (`finish_reason = "error"`, the observation says why); the verifier scores it 0.
- `handover(episode)` ends the agent's turn: no call runs after it; the container keeps
  running (its services) and its id leaves in `artifacts["harbor_container"]` for the
  verifier, with whether it still ran then (`harbor_state`: a container that stopped after
  the handover is the engine's doing, an infrastructure error, never scored), which removes it; one nobody verifies is reaped after `handover_ttl_s`.
- Engine failures raise (the agent loop turns them into `SandboxUnavailable`: retried).
"""

from __future__ import annotations

import asyncio
import time

from rollout_workers.repo_tools import read_range
from sandbox_workers.async_sandbox import Observation
from sandbox_workers.base import ExecResult
from sandbox_workers.harbor_box import BoxSpec, HarborBox, HarborEngineError
from sandbox_workers.integrity import obs_caps, render_observation
from schemas import Task
from schemas.tool_protocol import Call

CONTAINER_ARTIFACT = "harbor_container"
STATE_ARTIFACT = "harbor_state"
_sweep = {"at": 0.0}


def is_harbor(task: Task) -> bool:
    """Whether `task` runs in a Harbor task container."""
    return task.verifier == "harbor" and isinstance(task.verifier_params.get("harbor"), dict)


def episode_key(task: Task, sample_index: int) -> str:
    """The label that ties a container to one episode (checked by the verifier)."""
    return f"{task.task_id}/{sample_index}"


class HarborEpisodeBox:
    """The episode's container, used from the agent loop (each call on a worker thread)."""

    def __init__(self, box: HarborBox, tool_timeout_s: float, recorder=None) -> None:
        self.box, self.tool_timeout_s, self.recorder = box, tool_timeout_s, recorder
        self.started = time.monotonic()
        self.storage_exceeded = False

    @classmethod
    async def open(cls, task: Task, sample_index: int, recorder=None) -> HarborEpisodeBox:
        """Start the episode's container; `recorder` (`integrity.ExecRecorder`) signs each observation."""
        p = task.verifier_params
        spec = BoxSpec.from_params(p["harbor"])
        await asyncio.to_thread(_reap_now_and_then)
        box = await asyncio.to_thread(HarborBox.create, spec, task.run_id, episode_key(task, sample_index))
        return cls(box, float(p.get("tool_timeout_s", 60.0)), recorder)

    async def run(self, call: Call, timeout: float | None, caps: tuple[int, int] | None) -> Observation:
        """Run one tool call (not `submit`) and its observation."""
        result = await asyncio.to_thread(self._run_sync, call, timeout)
        # any exit code: a command that fills the disk usually fails because it did
        if call.tool in ("bash", "write_file") and self.box.spec.storage_mb:
            used = await asyncio.to_thread(self.box.rw_bytes)
            if used > self.box.spec.storage_mb << 20:
                self.storage_exceeded = True
                result.stderr += f"\n[rlbus: the container holds {used >> 20} MiB > storage_mb; the episode ends]"
        if self.recorder is None:
            return Observation(result, render_observation(result, *obs_caps(caps)))
        exec_id, text = await self.recorder.record(self.box.id[:12], call.code, result, caps)
        return Observation(result, text, exec_id)

    def _run_sync(self, call: Call, timeout: float | None) -> ExecResult:
        args = call.args
        limit = min(float(args.get("timeout") or self.tool_timeout_s), self.tool_timeout_s, timeout or 1e9)
        if call.tool == "bash":
            return self.box.exec(["bash", "-c", args["command"]], limit, cwd=args.get("cwd", ""))
        t0 = time.monotonic()
        try:
            if call.tool == "read_file":
                text = self.box.read_file(args["path"]).decode("utf-8", "replace")
                lines = text.splitlines()
                first, last = read_range(args)  # offset/limit over start/end, as the repository tools
                lo, hi = int(first), int(last) or len(lines)
                body = "\n".join(f"{i:6d}  {line}" for i, line in enumerate(lines[lo - 1 : hi], start=lo))
                return _ok(
                    f"{self.box.path(args['path'])}: lines {lo}-{min(hi, len(lines))} of {len(lines)}\n{body}", t0
                )
            if call.tool == "write_file":
                data = args["content"].encode()
                self.box.write_file(args["path"], data)
                return _ok(f"wrote {self.box.path(args['path'])} ({len(data)} bytes)", t0)
        except (FileNotFoundError, IsADirectoryError, ValueError) as exc:
            return ExecResult(exit_code=1, stdout="", stderr=f"error: {exc}", isolation="docker")
        raise ValueError(f"{call.tool!r} is not a Harbor tool that runs")

    async def handover(self) -> tuple[str, str]:
        """End the agent's turn: (the container's id, "running" or "stopped" now) for the
        verifier, which refuses to score a container that stopped after this (the engine's doing)."""
        try:
            running = (await asyncio.to_thread(HarborBox.attach, self.box.id, self.box.spec)).running
        except HarborEngineError:
            running = False  # gone already: the verifier finds out
        return self.box.id, "running" if running else "stopped"

    async def close(self) -> None:
        """Remove the container (an episode whose batch failed: nothing will verify it)."""
        await asyncio.to_thread(self.box.remove)


def _ok(text: str, t0: float) -> ExecResult:
    return ExecResult(
        exit_code=0, stdout=text, stderr="", duration_ms=(time.monotonic() - t0) * 1000, isolation="docker"
    )


def _reap_now_and_then(every_s: float = 60.0) -> None:
    """Remove expired Harbor containers, at most once a minute per process."""
    if time.monotonic() - _sweep["at"] < every_s:
        return
    _sweep["at"] = time.monotonic()
    from sandbox_workers.harbor_box import reap_expired

    reap_expired()
