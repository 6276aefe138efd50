"""One-shot isolated runs in agent containers: `run_isolated` (the code verifier's checks),
`AgentPool`, `get_agent_pool`.

Guarantees: an agent container is a second kind of sandbox container whose main process
(behind docker-init) is a resident agent, `sandbox_workers.docker_agent` (its program,
`agent_source()`, travels in the container's command; read its docstring for a run and
the threat model, and `sandbox_workers.docker_agent_protocol` for the protocol). Same
isolation as the `DockerSandbox` containers (`docker_pool.container_kwargs`; see
`sandbox_workers.docker_backend`), except: the agent runs as uid 0 with only SETUID,
SETGID and KILL added back (every command still runs as 65534 with no capability),
`mem_limit` gets `AGENT_MEMORY_MB` more and `pids_limit` is `pids + AGENT_PID_HEADROOM`
(the command's tree gets `pids`), and the cpu rlimit is set per command by the agent.
`agent_source` refuses (ValueError: no container starts) a program whose parts import
any project module but an earlier part (`sandbox_workers.program_parts.join_parts`). A run is ONE request/reply over the
container's attached stdin/stdout (it has no network): the agent writes the files into
an empty /work, runs the command in a child forked before the request was read, kills
every process, wipes /work, /tmp, /dev/mqueue and SysV IPC and proves the container
clean; only then does the host put it back in its `AgentPool` (no docker API call per
run in the steady state). A container whose agent reports it unclean, used
`AGENT_MAX_USES` times, or whose agent dies or misses `timeout + AGENT_GRACE_S`, is
removed (the latter two raise `ContainerUnusable`: an infrastructure error, never a
result). The pool keeps max(warm_pool, most runs at once) containers in all.

Guarantees of `run_isolated` are those of `DockerSandbox.execute` (result flags, caps,
exit codes, nothing left running) plus the above. Blocking API: call it from a thread in
async code.
"""

from __future__ import annotations

import marshal
import os
import select
import time
from typing import Any

from sandbox_workers import docker_agent_protocol as _AGENT  # stdlib only: the protocol's constants
from sandbox_workers.base import MIB, ExecResult, HeadTailBuffer, Limits, decode_output
from sandbox_workers.docker_engine import env_int, log
from sandbox_workers.docker_pool import (
    DEFAULT_IMAGE,
    OOM_HINTS,
    Box,
    ContainerUnusable,
    FrameReader,
    WarmPool,
    container_kwargs,
    sandbox_path,
    shared_pool,
)
from sandbox_workers.program_parts import join_files

AGENT_LABEL = "rlbus.sandbox.agent"
AGENT_USER = "0:0"
AGENT_CAPS = ["SETUID", "SETGID", "KILL"]
AGENT_PID_HEADROOM = 2  # docker-init and the agent: the command (the zygote) and its tree get `pids`
AGENT_MEMORY_MB = 48  # the agent and its zygote, on top of the command's memory
AGENT_MAX_USES = 1000
AGENT_GRACE_S = 5.0
AGENT_START_S = 30.0
AGENT_PARTS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    for name in ("docker_agent_protocol.py", "docker_agent_clean.py", "docker_agent.py")
)
"""The files of the agent program, in the order they are joined (each imports only earlier ones)."""


def agent_source() -> str:
    """The agent program (`AGENT_PARTS` joined), passed in the container's command (the image
    has no project code)."""
    global _agent_source
    if _agent_source is None:
        _agent_source = join_files(AGENT_PARTS, "sandbox_workers")
    return _agent_source


_agent_source: str | None = None


def agent_container_kwargs(image: str, limits: Limits, cpus: float) -> dict:
    """`create_container` arguments of an agent container: as `container_kwargs`, but the agent
    (uid 0 with only SETUID/SETGID/KILL) is the main process behind docker-init, stdin kept
    open for the host's requests, and the cpu rlimit set per command by the agent."""
    kw = container_kwargs(image, limits, cpus)
    hc = kw["host_config"]
    hc["cap_add"] = list(AGENT_CAPS)
    hc["ulimits"] = [u for u in hc["ulimits"] if u["Name"] != "cpu"]
    hc["pids_limit"] = limits.pids + AGENT_PID_HEADROOM
    hc["mem_limit"] = hc["memswap_limit"] = (limits.memory_mb + AGENT_MEMORY_MB) * MIB
    kw.update(
        command=["python3", "-I", "-S", "-c", agent_source(), "rlbus-agent"],
        user=AGENT_USER,
        stdin_open=True,
        tty=False,
        labels={**kw["labels"], AGENT_LABEL: "1"},
    )
    return kw


class AgentGone(ContainerUnusable):
    """The agent closed its stream, stopped answering, or sent garbage."""


class _AgentStream(FrameReader):
    """The attached stdin/stdout of an agent container: framed requests out, framed replies in."""

    def __init__(self, api, cid: str) -> None:
        super().__init__(api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}))
        self.sock.settimeout(None)
        self.out = bytearray()  # the agent's stdout, not yet parsed into frames
        self.diag = HeadTailBuffer(8192)  # the agent's stderr (diagnostics only)

    def send(self, obj: Any) -> None:
        data = marshal.dumps(obj, 4)
        self.sock.sendall(_AGENT.HEADER.pack(len(data)) + data)

    def recv(self, deadline: float) -> bytes:
        """The next reply's payload; AgentGone on EOF, TimeoutError past the deadline."""
        while True:
            if len(self.out) >= 4:
                n = _AGENT.HEADER.unpack_from(self.out)[0]
                if len(self.out) >= 4 + n:
                    payload = bytes(self.out[4 : 4 + n])
                    del self.out[: 4 + n]
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the sandbox agent did not answer in time")
            ready, _, _ = select.select([self.sock], [], [], left)
            if ready and not self._read_once():
                raise AgentGone(f"the sandbox agent closed its stream: {self.diagnostics()}")

    def _deliver(self, chunk: bytes) -> None:
        if self.stream == 1:
            self.out += chunk
        else:
            self.diag.feed(chunk)

    def diagnostics(self) -> str:
        return self.diag.getvalue().decode(errors="replace").strip()[-1000:] or "(no agent stderr)"


class _Reply:
    __slots__ = ("code", "duration", "exists", "flags", "kind", "message", "oom", "stderr", "stdout")

    def __init__(self, payload: bytes) -> None:
        reply = _AGENT.REPLY
        if len(payload) < reply.size:
            raise AgentGone(f"short reply from the sandbox agent ({len(payload)} bytes)")
        (self.kind, self.code, self.flags, self.oom, self.duration, self.exists, n_out, n_err, n_msg) = (
            reply.unpack_from(payload)
        )
        if reply.size + n_out + n_err + n_msg != len(payload):
            raise AgentGone("malformed reply from the sandbox agent")
        at = reply.size
        self.stdout, at = payload[at : at + n_out], at + n_out
        self.stderr, at = payload[at : at + n_err], at + n_err
        self.message = payload[at : at + n_msg].decode(errors="replace")

    @property
    def clean(self) -> bool:
        return bool(self.flags & _AGENT.CLEAN)


class _AgentBox(Box):
    __slots__ = ("stream",)

    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        self.stream: _AgentStream | None = None


class AgentPool(WarmPool):
    """Agent containers of one (image, limits, cpus): proven clean by their agent after every run,
    so a returned container is ready at once (no docker API call per run in the steady state).

    The pool keeps `max(size, most in use at once)` containers in all (idle + in use +
    starting): it grows to the concurrency it sees."""

    def __init__(self, client, image: str, limits: Limits, cpus: float, size: int) -> None:
        super().__init__(client, image, limits, cpus, size)
        self.in_use = 0
        self.peak = 0

    def _target(self) -> int:
        return max(self.size, self.peak)

    def _room_locked(self) -> int:
        return self._target() - len(self.idle) - self.in_use

    def _count_in_use_locked(self, delta: int) -> None:
        self.in_use += delta
        self.peak = max(self.peak, self.in_use)

    def _container_kwargs(self) -> dict:
        return agent_container_kwargs(self.image, self.limits, self.cpus)

    def _new_box(self, cid: str) -> _AgentBox:
        return _AgentBox(cid)

    def _start(self, box: _AgentBox) -> None:  # type: ignore[override]
        """`create` hands out only agent containers that said hello (and found themselves clean)."""
        box.stream = _AgentStream(self.api, box.id)  # attached before start: the hello is not lost
        self.api.start(box.id)
        hello = _Reply(box.stream.recv(time.monotonic() + AGENT_START_S))
        if hello.kind != _AGENT.HELLO or hello.code != _AGENT.VERSION or not hello.clean:
            raise AgentGone(f"the sandbox agent refused to start: {hello.message} {box.stream.diagnostics()}")

    def remove(self, box: Box) -> None:
        stream = getattr(box, "stream", None)
        if stream is not None:
            stream.close()
        super().remove(box)

    def release(self, box: Box, clean: bool = False) -> None:
        """Take back a container after a run: kept when its agent proved it clean, else removed."""
        with self.cond:
            self.in_use -= 1
            keep = clean and not self.closed and box.uses < AGENT_MAX_USES and self._room_locked() - self.pending > 0
            if keep:
                self.idle.append(box)
            self._refill_locked()
            self.cond.notify_all()
        if not keep:
            self._submit(self.remove, box)

    def kill(self, box: Box) -> None:
        with self.cond:
            self.in_use -= 1
            self._refill_locked()
        super().kill(box)


def get_agent_pool(image: str, limits: Limits, cpus: float, size: int, concurrency: int | None) -> AgentPool:
    """The process's agent pool for (image, limits, cpus); its size grows to the largest asked."""
    return shared_pool(AgentPool, (image, limits, cpus, "agent"), image, limits, cpus, size, concurrency)


class IsolatedRun:
    """What `run_isolated` did: the command's result and which `report` paths existed after it."""

    __slots__ = ("clean", "container", "exists", "result")

    def __init__(self, result: ExecResult, exists: frozenset[str], container: str, clean: bool) -> None:
        self.result, self.exists, self.container, self.clean = result, exists, container, clean


def run_isolated(
    files: list[tuple[str, bytes]],
    *,
    argv: list[str] | None = None,
    python: str | None = None,
    timeout: float = 30.0,
    limits: Limits | None = None,
    image: str | None = None,
    cpus: float = 1.0,
    warm_pool: int | None = None,
    concurrency: int | None = None,
    report: tuple[str, ...] = (),
) -> IsolatedRun:
    """Run one command in a clean agent container: `files` written in order into an empty /work,
    then `argv` (or the file `python` as `python3 -I -S <file>` in the agent's pre-imported
    interpreter), as the sandbox user, with the limits and `timeout`; then everything is
    killed and wiped and the container proven clean before anyone else gets it.

    Guarantees as `DockerSandbox.execute` (result flags, caps, exit codes, nothing left
    running), plus: one request/reply over the container's attached stream (no docker API
    call in the steady state). ContainerUnusable (the container is killed and replaced)
    when the agent dies, stops answering or cannot write the files; ValueError for a bad
    path."""
    if (argv is None) == (python is None):
        raise ValueError("give exactly one of argv and python")
    limits = limits or Limits()
    for path, _ in files:
        sandbox_path(path)
    size = warm_pool if warm_pool is not None else env_int("RLBUS_SANDBOX_WARM_POOL", 2)
    pool = get_agent_pool(image or DEFAULT_IMAGE, limits, cpus, size, concurrency)
    req = {
        "op": "run",
        "files": [(str(p), bytes(d)) for p, d in files],
        "timeout": max(float(timeout), 0.001),
        "cap": limits.output_cap_bytes,
        "report": list(report),
        "limits": {"cpu": limits.cpu_seconds, "fsize": limits.file_size_mb * MIB, "nofile": limits.nofile},
    }
    if argv is not None:
        req["argv"] = [str(a) for a in argv]
    else:
        req["python"] = str(python)
    box = pool.acquire()
    try:
        box.stream.send(req)
        reply = _Reply(box.stream.recv(time.monotonic() + req["timeout"] + AGENT_GRACE_S))
    except (OSError, TimeoutError, ContainerUnusable) as exc:
        log.warning(
            "sandbox.agent_failed", container=box.id[:12], error=str(exc), agent_stderr=box.stream.diagnostics()
        )
        pool.kill(box)
        raise ContainerUnusable(f"sandbox agent failed: {type(exc).__name__}: {exc}") from exc
    except BaseException:
        pool.kill(box)
        raise
    clean = reply.clean
    pool.release(box, clean)
    if not clean:
        log.warning("sandbox.agent_unclean", container=box.id[:12], reason=reply.message)
    if reply.kind != _AGENT.RESULT:
        raise ContainerUnusable(f"sandbox agent refused the run: {reply.message}")
    err = reply.stderr
    oom = reply.oom > 0 or any(h in err for h in OOM_HINTS)
    flags = reply.flags
    result = ExecResult(
        exit_code=reply.code,
        stdout=decode_output(reply.stdout),
        stderr=decode_output(err),
        timed_out=bool(flags & _AGENT.TIMED_OUT),
        oom=oom,
        truncated=bool(flags & (_AGENT.TRUNC_OUT | _AGENT.TRUNC_ERR)),
        duration_ms=round(reply.duration * 1000, 3),
        isolation="docker",
    )
    exists = frozenset(p for i, p in enumerate(report[:32]) if reply.exists >> i & 1)
    return IsolatedRun(result, exists, box.id, clean)
