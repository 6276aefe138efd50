"""The answer pool: answer-dependent scoring out of the verifier process, under limits.

A reasoning-gym `score_answer` may `eval` the policy's answer, sympy's `parse_expr` is
eval-based, and an untrusted plugin verifier is code we do not vouch for. None of that runs
in the verifier process (which holds the NATS credential and the hidden bucket): `call()`
runs it here instead.

How (parent = the verifier process, template = one child, job = a grandchild):
- The template is a FRESH interpreter (`python -m verifier_workers.answer_pool`, never a fork
  of the verifier, whose sockets and memory hold credentials), started with `close_fds`
  (its only descriptors: the two pipes to the parent), in its own session, with a scrubbed
  environment (`child_env`: an allow-list: PATH, LANG/LC_*, TZ, PYTHONPATH (the parent's
  import path), PYTHONHASHSEED, VIRTUAL_ENV, thread caps; HOME and TMPDIR are /tmp; no name
  holding NATS, SECRET, TOKEN, KEY, PASSWORD, CREDS, AUTH ever passes). Where bubblewrap
  runs it, the template lives in new user/pid/net/ipc namespaces: read-only root, private
  /tmp (the code it imports bound back read-only when it lives there), no network, the verifier's processes invisible and unsignalable, and the run dir
  (`RLBUS_RUN_DIR`) and every file a secret-named variable points at masked
  (`isolation == "bwrap"`); elsewhere `isolation == "degraded"` (logged once).
- The template imports the heavy libraries once (`PRELOAD`), then serves requests: it runs
  a request's `warm` step itself (controlled-side data only: e.g. building a dataset from
  the hidden recipe, cached), and hands the answer-dependent step to a job forked from it
  (spares are forked ahead, so an answer does not wait for the fork). The template never
  runs answer-derived code, so no answer can poison the next: EVERY answer runs in a pristine
  copy of the imported modules, and its rebinding of a scorer or of builtins dies with it.
- A job closes every descriptor but its two pipes, sets RLIMIT_CPU (`cpu_s`), RLIMIT_AS
  (`memory_mb` above the template's address space), RLIMIT_FSIZE 0 (it can write no file),
  RLIMIT_CORE 0, replaces the bare `eval(text)` that scorers call with `ast.literal_eval`
  (a Python literal still parses, nothing else runs), and installs an audit hook that
  refuses processes, signals, sockets, ctypes, gc walks and, from code compiled out of a
  string, frame access (the gold lives in the scorer's frame). The hook is defence in
  depth, not the boundary: the boundary is the process and its namespaces.
- The template kills a job at `wall_s` (SIGKILL); the kernel at `cpu_s`; a MemoryError that
  reaches answer code or the call counts as the memory limit. Any limit: `Outcome.kind ==
  "limit"` (the caller scores 0 with status `answer_limit`; never infra, never a freeze).
- Results come back as length-prefixed JSON, parsed with caps, never pickle: a job that
  ran answer code cannot make its parent run anything.
- Failures that are nobody's answer raise `VerifierInfraError` (retried by the worker): the
  pool cannot start, the template dies (it is replaced at once, in the background), or
  a job dies otherwise than at a limit (`kind == "crash"` is raised by `call`). A template
  that answers no request within `wall_s + GRACE_S` is killed and replaced.
- Process-global, lazily started on the first `call()`, thread-safe (requests are
  multiplexed over one template, up to `max_jobs` at once); `shutdown()` runs at exit and
  kills the template's process group by PID.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from verifier_workers.errors import VerifierInfraError

PRELOAD = (
    "reasoning_gym",
    "sympy",
    "math_verify",
    "verifier_workers.verifiers.reasoning_gym",
    "verifier_workers.verifiers.math",
    "verifier_workers.registry",
)
"""Modules every template imports before it reports ready (a missing one is skipped)."""

START_TIMEOUT_S = 180.0
GRACE_S = 10.0
MAX_RESULT_BYTES = 1 << 20
SECRET_WORDS = ("NATS", "SECRET", "TOKEN", "KEY", "PASSWORD", "CREDS", "AUTH")
ALLOWED_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED", "VIRTUAL_ENV")
_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class Limits:
    """Per-answer limits (see the module docstring)."""

    cpu_s: float = 5.0
    memory_mb: int = 1024
    wall_s: float = 10.0


@dataclass
class Outcome:
    """What a job produced: `ok` (value), `raised` (error: 'Type: message'), `limit` (limit:
    cpu|memory|wall|output), `infra` (the template's warm step failed: error)."""

    kind: str
    value: Any = None
    error: str = ""
    limit: str = ""
    blocked: list[str] = field(default_factory=list)
    """Operations the answer attempted and the audit hook refused (for the verdict's details)."""


# -- framing ----------------------------------------------------------------------------


def _write_frame(fd: int, payload: bytes) -> None:
    data = _LEN.pack(len(payload)) + payload
    while data:
        data = data[os.write(fd, data) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def _read_frame(fd: int, cap: int = 64 << 20) -> bytes | None:
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > cap:
        raise ValueError(f"frame of {n} bytes exceeds {cap}")
    return _read_exact(fd, n)


# -- the parent side --------------------------------------------------------------------


def child_env(parent: dict[str, str] | None = None) -> dict[str, str]:
    """The template's environment: the allow-list of the module docstring, nothing else."""
    parent = dict(os.environ if parent is None else parent)
    env = {
        k: v
        for k, v in parent.items()
        if (k in ALLOWED_ENV or k.startswith("LC_")) and not any(w in k.upper() for w in SECRET_WORDS)
    }
    env.update(
        HOME="/tmp",
        TMPDIR="/tmp",
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
    )
    env.setdefault("PATH", "/usr/bin:/bin")
    return env


def masked_paths(parent: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(directories, files) the bwrap template must not see: the run dir and every existing
    path a secret-named variable holds."""
    parent = dict(os.environ if parent is None else parent)
    dirs, files = [], []
    for name, value in parent.items():
        secretish = any(w in name.upper() for w in SECRET_WORDS) or name == "RLBUS_RUN_DIR"
        if not secretish or not value or not os.path.isabs(value):
            continue
        (dirs if os.path.isdir(value) else files if os.path.isfile(value) else []).append(os.path.realpath(value))
    return dirs, files


def code_paths_under_tmp() -> list[str]:
    """The interpreter's, the venv's, this project's and the import path's directories that live under /tmp (a
    checkout in /tmp, as CI's fresh clone is): the template's private /tmp would hide them, so
    they are bound back read-only (everything outside /tmp is visible read-only anyway)."""
    found: list[str] = []
    project = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # an editable install's source tree
    for p in [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable), project, *sys.path]:
        if not p or not os.path.isabs(p) or not os.path.isdir(p):
            continue
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if (q == "/tmp" or q.startswith("/tmp/")) and q != "/tmp" and q not in found:
                found.append(q)
    return sorted(found, key=len)  # parents first: a child bind lands inside its parent's


def _argv(bwrap: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "verifier_workers.answer_pool", ",".join(PRELOAD)]
    if bwrap is None:
        return cmd
    dirs, files = masked_paths()
    masks: list[str] = []
    for d in code_paths_under_tmp():  # after `--tmpfs /tmp`, before the masks (a run dir inside stays hidden)
        masks += ["--ro-bind", d, d]
    for d in dirs:
        masks += ["--tmpfs", d]
    for f in files:
        masks += ["--ro-bind", "/dev/null", f]
    return [
        bwrap,
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        *masks,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--chdir",
        "/tmp",
        *cmd,
    ]


class _Template:
    """One template process, its reader thread and its pending requests."""

    def __init__(self, bwrap: str | None) -> None:
        self.proc = subprocess.Popen(
            _argv(bwrap),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=child_env(),
            close_fds=True,
            start_new_session=True,
            cwd="/tmp",
        )
        self.isolation = "bwrap" if bwrap else "degraded"
        self.ready = threading.Event()
        self.dead = False
        self.reason = ""
        self.pending: dict[int, list] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="answer-pool-reader", daemon=True).start()

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        try:
            while (frame := _read_frame(fd, cap=4 * MAX_RESULT_BYTES)) is not None:
                msg = json.loads(frame)
                if msg.get("ready"):
                    self.ready.set()
                    continue
                with self.lock:
                    slot = self.pending.pop(int(msg["id"]), None)
                if slot is not None:
                    slot[1] = msg
                    slot[0].set()
        except (OSError, ValueError) as exc:
            self.reason = f"{type(exc).__name__}: {exc}"
        self.kill(self.reason or f"exited with status {self.proc.wait()}")

    def kill(self, reason: str) -> None:
        with self.lock:
            if not self.dead:
                self.dead, self.reason = True, reason
            pending, self.pending = self.pending, {}
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.ready.set()
        for slot in pending.values():
            slot[0].set()

    def send(self, rid: int, request: dict) -> list:
        slot = [threading.Event(), None]
        with self.lock:
            if self.dead:
                raise VerifierInfraError(f"answer pool child died ({self.reason}); the next call starts another")
            self.pending[rid] = slot
            _write_frame(self.proc.stdin.fileno(), pickle.dumps(request))
        return slot


class AnswerPool:
    """The pool (see the module docstring); use the process-global one through `call()`."""

    def __init__(self, limits: Limits | None = None, max_jobs: int = 8, bwrap: str | None | bool = True) -> None:
        self.limits = limits or Limits()
        self.max_jobs = max(1, max_jobs)
        self.bwrap = (shutil.which("bwrap") if bwrap is True else bwrap) or None
        self.slots = threading.BoundedSemaphore(self.max_jobs)
        self.lock = threading.Lock()
        self.template: _Template | None = None
        self.next_id = 0
        self.closed = False

    @property
    def isolation(self) -> str:
        return self.template.isolation if self.template else ("bwrap" if self.bwrap else "degraded")

    def _spawn(self) -> _Template:
        try:
            t = _Template(self.bwrap)
        except OSError as exc:
            raise VerifierInfraError(f"answer pool cannot start: {exc}") from exc
        if t.isolation == "degraded":
            import structlog

            structlog.get_logger().warning(
                "answer_pool.degraded",
                why="bubblewrap not found: answers are "
                "scored without namespaces (rlimits, scrubbed env, audit hook only)",
            )
        return t

    def _live(self) -> _Template:
        with self.lock:
            if self.closed:
                raise VerifierInfraError("answer pool is shut down")
            if self.template is None or self.template.dead:
                if self.template is not None and self.bwrap and not self.template.ready.is_set():
                    self.bwrap = None  # bwrap cannot run here: fall back rather than never score
                self.template = self._spawn()
            t = self.template
        if not t.ready.wait(START_TIMEOUT_S) or t.dead:
            reason = t.reason or f"not ready after {START_TIMEOUT_S:.0f} s"
            t.kill(reason)
            raise VerifierInfraError(f"answer pool child failed to start ({reason}); is the venv importable?")
        return t

    def _respawn_soon(self, dead: _Template) -> None:
        def go() -> None:
            with self.lock:
                if self.template is dead and not self.closed:
                    self.template = self._spawn()

        threading.Thread(target=go, name="answer-pool-respawn", daemon=True).start()

    def call(
        self,
        ref: str,
        args: tuple = (),
        warm: tuple[str, tuple] | None = None,
        limits: Limits | None = None,
        trusted_eval: tuple[str, ...] = (),
    ) -> Outcome:
        """Run `ref(*args)` ("module:attr") in a fresh job, after `warm` (ref, args) in the template.
        `trusted_eval`: controlled-side texts a bare `eval` in the job may really evaluate.

        Returns an Outcome of kind ok / raised / limit / infra; raises VerifierInfraError when
        the job died otherwise than at a limit or the pool could not run it."""
        lim = limits or self.limits
        with self.slots:
            t = self._live()
            with self.lock:
                self.next_id += 1
                rid = self.next_id
            req = {
                "id": rid,
                "ref": ref,
                "args": args,
                "warm": warm,
                "cpu_s": lim.cpu_s,
                "memory_mb": lim.memory_mb,
                "wall_s": lim.wall_s,
                "trusted_eval": list(trusted_eval),
            }
            try:
                slot = t.send(rid, req)
            except OSError as exc:
                t.kill(f"pipe: {exc}")
                raise VerifierInfraError(f"answer pool child unreachable: {exc}") from exc
            if not slot[0].wait(lim.wall_s + GRACE_S) and slot[1] is None:
                t.kill(f"no answer within {lim.wall_s + GRACE_S:.0f} s")
            if slot[1] is None:
                self._respawn_soon(t)
                raise VerifierInfraError(f"answer pool child died ({t.reason}); retry")
        return _outcome(slot[1])

    def shutdown(self) -> None:
        """Kill the template (and its jobs, by process group)."""
        with self.lock:
            self.closed = True
            t, self.template = self.template, None
        if t is not None:
            t.kill("shut down")
            t.proc.wait(5)


def _outcome(msg: dict) -> Outcome:
    kind = msg.get("kind")
    blocked = [str(b)[:80] for b in msg.get("blocked") or []][:20]
    if kind == "crash":
        raise VerifierInfraError(f"answer pool job died: {str(msg.get('error'))[:300]}")
    if kind not in ("ok", "raised", "limit", "infra"):
        raise VerifierInfraError(f"answer pool returned an unknown outcome {str(kind)[:40]!r}")
    return Outcome(kind, msg.get("value"), str(msg.get("error") or "")[:2000], str(msg.get("limit") or ""), blocked)


_pool: AnswerPool | None = None
_pool_lock = threading.Lock()
_limits = Limits()


def configure(limits: Limits | None = None, section=None) -> None:
    """Set the limits of the process-global pool (from `limits`, or a `VerifierSection`)."""
    global _limits
    if section is not None:
        limits = Limits(section.answer_cpu_s, section.answer_memory_mb, section.answer_wall_s)
    with _pool_lock:
        _limits = limits or Limits()
        if _pool is not None:
            _pool.limits = _limits


def pool() -> AnswerPool:
    """The process-global pool (created on first use; started on its first call)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.closed:
            _pool = AnswerPool(_limits)
        return _pool


def call(
    ref: str,
    args: tuple = (),
    warm: tuple[str, tuple] | None = None,
    limits: Limits | None = None,
    trusted_eval: tuple[str, ...] = (),
) -> Outcome:
    """`AnswerPool.call` on the process-global pool."""
    return pool().call(ref, args, warm, limits, trusted_eval)


@atexit.register
def shutdown() -> None:
    """Shut the process-global pool down (at exit; tests)."""
    global _pool
    with _pool_lock:
        p, _pool = _pool, None
    if p is not None:
        p.shutdown()


if __name__ == "__main__":
    from verifier_workers.answer_pool_child import main

    main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(PRELOAD))
