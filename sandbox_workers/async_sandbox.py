"""The async sandbox interface rollout workers and verifiers use, and its local backend.

Guarantees:
- `AsyncSandbox` mirrors `sandbox_workers.base.Sandbox` (same results, same file-path
  rules, same errors: ValueError for a bad path, FileNotFoundError for a missing file)
  and adds `observe`, which also returns the canonical observation text and, when the
  execution was recorded, its exec_id (see `sandbox_workers.integrity`).
- `LocalAsyncSandbox` runs every call of its blocking backend, `start` and `close`
  included, on ONE dedicated thread that lives exactly as long as the sandbox (bwrap's
  --die-with-parent follows the thread that spawned it), so calls on one sandbox are
  serialized and never block the event loop. `close` is idempotent; any call after
  it raises `SandboxClosed`.
- `open_async_sandbox(sc, nc, run_id, image=...)` gives a local sandbox, or a session of the
  sandbox service (`RemoteSandbox`) when `sc.remote` is true; `image` (e.g. `sc.repo_image`)
  replaces `sc.image` locally and is asked of the service remotely, which starts it only if
  it is one of the images it was configured with (`ImageNotAllowed` otherwise).
"""

from __future__ import annotations

import abc
import asyncio
import functools
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from sandbox_workers.base import ExecResult, Limits, Sandbox
from sandbox_workers.factory import open_sandbox

if TYPE_CHECKING:
    from sandbox_workers.integrity import ExecRecorder
    from schemas.config import SandboxSection


class SandboxClosed(RuntimeError):
    """The sandbox was closed (or reaped); open a new one."""


@dataclass(frozen=True)
class Observation:
    """One execution: its result, the text to append to the model's context, and the
    exec_id of its integrity record (None when it was not recorded)."""

    result: ExecResult
    text: str
    exec_id: str | None = None


class AsyncSandbox(abc.ABC):
    """One isolated place to run commands (work dir `/work`), for async code."""

    session: str = ""
    isolation: str = "degraded"

    @abc.abstractmethod
    async def observe(
        self, cmd: list[str] | str, timeout: float | None = None, caps: tuple[int, int] | None = None
    ) -> Observation:
        """Run `cmd`; the result plus its observation text (and exec_id when recorded), stdout and
        stderr clipped to `caps` chars (`integrity.obs_caps`: the defaults when None)."""

    async def execute(self, cmd: list[str] | str, timeout: float | None = None) -> ExecResult:
        """Run `cmd` (argv list, or a string run by `/bin/sh -c`) in the work dir."""
        return (await self.observe(cmd, timeout)).result

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Bytes of a regular file in the work dir."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file in the work dir (parents created)."""

    async def write_files(self, files: list[tuple[str, bytes]]) -> None:
        """Create or replace several files (default: one `write_file` each; backends may batch)."""
        for path, data in files:
            await self.write_file(path, data)

    @abc.abstractmethod
    async def reset(self) -> None:
        """Kill everything and empty the work dir."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release everything; idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class LocalAsyncSandbox(AsyncSandbox):
    """A blocking backend driven from one dedicated thread."""

    def __init__(
        self,
        sandbox: Sandbox,
        executor: ThreadPoolExecutor,
        recorder: ExecRecorder | None = None,
        session: str | None = None,
    ) -> None:
        self._sandbox = sandbox
        self._executor = executor
        self._recorder = recorder
        self._closed = False
        self.session = session or uuid.uuid4().hex
        self.isolation = getattr(sandbox, "isolation", "degraded")

    @classmethod
    async def open(
        cls,
        backend: str = "process",
        *,
        image: str | None = None,
        limits: Limits | None = None,
        timeout: float = 30.0,
        recorder: ExecRecorder | None = None,
        session: str | None = None,
        warm_pool: int | None = None,
        allow_degraded: bool = False,
    ) -> LocalAsyncSandbox:
        """Start a backend sandbox on a fresh dedicated thread (`warm_pool`: docker's ready containers;
        `allow_degraded`: see `open_sandbox`, else a process sandbox without bwrap raises `SandboxRefused`)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox")
        loop = asyncio.get_running_loop()
        try:
            sandbox = await loop.run_in_executor(
                executor,
                lambda: open_sandbox(
                    backend,
                    image=image,
                    limits=limits,
                    timeout=timeout,
                    warm_pool=warm_pool,
                    allow_degraded=allow_degraded,
                ),
            )
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(sandbox, executor, recorder, session)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def default_timeout(self) -> float:
        return float(getattr(self._sandbox, "default_timeout", 30.0))

    async def _call(self, fn, *args) -> Any:
        if self._closed:
            raise SandboxClosed(f"sandbox session {self.session} is closed; open a new one")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def observe(
        self, cmd: list[str] | str, timeout: float | None = None, caps: tuple[int, int] | None = None
    ) -> Observation:
        result = await self._call(self._sandbox.execute, cmd, timeout)
        if self._recorder is None:
            from sandbox_workers.integrity import obs_caps, render_observation

            return Observation(result, render_observation(result, *obs_caps(caps)))
        exec_id, text = await self._recorder.record(self.session, cmd, result, caps)
        return Observation(result, text, exec_id)

    async def execute_with(self, cmd: list[str] | str, timeout: float | None = None, **options) -> ExecResult:
        """`execute` with the backend's own options (the process backend's `ro_binds`, `env`:
        an agent harness's binds and variables), unrecorded: the caller owns what it runs."""
        return await self._call(functools.partial(self._sandbox.execute, cmd, timeout, **options))

    async def read_file(self, path: str) -> bytes:
        return await self._call(self._sandbox.read_file, path)

    async def write_file(self, path: str, data: bytes) -> None:
        await self._call(self._sandbox.write_file, path, bytes(data))

    async def write_files(self, files: list[tuple[str, bytes]]) -> None:
        await self._call(self._sandbox.write_files, [(p, bytes(d)) for p, d in files])

    async def reset(self) -> None:
        await self._call(self._sandbox.reset)

    async def close(self) -> None:
        """Close the backend on its own thread (after any call in flight), then end the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._sandbox.close)
        finally:
            self._executor.shutdown(wait=False)


def limits_from(sc: SandboxSection) -> Limits:
    """Backend limits from the config section."""
    return Limits(memory_mb=sc.memory_mb, pids=sc.pids)


async def open_async_sandbox(
    sc: SandboxSection,
    nc=None,
    run_id: str | None = None,
    *,
    recorder: ExecRecorder | None = None,
    image: str | None = None,
) -> AsyncSandbox:
    """A local sandbox from `sc.backend`, or a sandbox-service session when `sc.remote`.

    Remote needs `nc` (a NATS connection) and `run_id` (exec records go to its bucket);
    `recorder` (local only) records executions, see `integrity.LocalRecorder`; `image`: the
    docker image instead of `sc.image` (remote: asked of the service; None: its default).
    """
    if sc.remote:
        if nc is None or not run_id:
            raise ValueError(
                "sandbox.remote=true needs a NATS connection and a run id: open_async_sandbox(sc, nc=nc, run_id=run_id)"
            )
        from bus.subjects import Registry
        from sandbox_workers.remote import RemoteSandbox

        return await RemoteSandbox.open(nc, Registry(run_id), sc.pool, image=image)
    return await LocalAsyncSandbox.open(
        sc.backend,
        image=image or sc.image,
        limits=limits_from(sc),
        timeout=sc.timeout_s,
        recorder=recorder,
        warm_pool=sc.warm_pool,
        allow_degraded=sc.allow_degraded,
    )
