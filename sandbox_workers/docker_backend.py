"""`docker` backend: one container per sandbox, handed out from a warm pool.

Guarantees (on top of those in `sandbox_workers.base`):

- Isolation: `network_mode=none` (no interface but loopback: the host is unreachable),
  read-only root, tmpfs `/work` (the cwd, owned by the sandbox user) and `/tmp`, no
  `/dev/shm` (`ipc_mode=none`), `mem_limit == memswap_limit` (no swap), `pids_limit`,
  a CPU quota (`nano_cpus`), nofile/fsize/cpu/core ulimits, every capability dropped,
  `no-new-privileges`, Docker's default seccomp profile, no logs kept (`log_config
  none`). Commands run as uid/gid 65534; the container's init (`docker-init`, pid 1)
  and its only child `sleep infinity` run as 65532, so a command can neither signal
  nor ptrace them, and `kill -9 -1` as 65534 kills every sandbox process and nothing
  else.
- `execute` is one exec through the Engine API. A wrapper shell (as 65534) runs the
  command under `timeout -s KILL <t>`, which puts itself and the command in their own
  process group (no `setsid`: no terminal is attached, and it would cost an exec),
  then `kill -9 -1` (every process the command started, double-forked daemons
  included), then reports the command's status and the memory cgroup's `oom_kill`
  delta on a last stderr line and exits 0. That line is trusted only when the exec
  itself exited 0, which the command cannot fake (killing the wrapper makes it
  nonzero); otherwise the host sweeps with a second exec. stdout and stderr are
  drained concurrently from the multiplexed socket, each into a `HeadTailBuffer`.
- Hard deadline: if the exec still runs `KILL_GRACE_S` after the timeout, the host
  kills every sandbox process with a second exec; if that cannot run (e.g. the pids
  limit is exhausted) or does not end the exec, the container is killed and replaced
  by a fresh one (the work dir is lost; logged as `sandbox.replaced`).
- `oom` is set when the memory cgroup counted an OOM kill during the command, or
  stderr shows an allocation failure (MemoryError, ...). `timed_out` when the command
  was killed by the timeout. `exit_code` is 128+N for signal N.
- Fresh on hand-out: a sandbox gets either a container that was never used, or a
  returned one that passed `docker_pool.clean_container` (every 65534 process killed, `/work`,
  `/tmp`, POSIX and SysV IPC wiped) and was then *proven* clean: the only pids are
  docker-init and `sleep`, and the wiped dirs are empty. A container that fails the
  proof, or was used `MAX_USES` times, is removed instead. `reset()` swaps in such a
  fresh container (the old one is cleaned or removed in the background).
- Warm pool: one pool per (image, limits, cpus) per process (module level, shared by
  every `DockerSandbox` of the process; `docker_pool.shutdown_pools()` and an `atexit` hook remove
  its containers). It keeps `warm_pool` containers ready (argument, else env
  `RLBUS_SANDBOX_WARM_POOL`, else 2 = `SandboxSection.warm_pool`), refilled and cleaned
  by a background thread pool of `REFILL_WORKERS` threads (bounded concurrency).
  With `warm_pool=0` containers are created on demand and removed on `close`.
- One `DockerClient` per process; its HTTP connection pool (`max_pool_size`) is sized
  to the largest `concurrency` asked for (argument, else env
  `RLBUS_SANDBOX_CONCURRENCY`, else 8) plus the refill threads, so concurrent
  sandboxes never queue on, or throw away, connections.
- Every container is labelled `rlbus.sandbox=1` with its owner
  (`rlbus.sandbox.owner=<host>:<pid>:<start time>`). `docker_engine.reap()` removes, in any state
  (`Created` included), labelled containers whose owner process is gone, and this
  process's containers that no pool tracks; `reap(all_owners=True)` removes them all.
  The first pool of a process reaps at start, then every `REAP_INTERVAL_S`.
- Files: `read_file`/`write_file` go through an exec (tar archives cannot reach a
  tmpfs nor a read-only root). Paths are relative to `/work` (or absolute under it);
  no component may be a symlink, like the process backend.
- A missing image raises `docker_pool.SandboxImageMissing`, which names the command that
  builds it (`docker_pool.missing_image_message`): `rlbus sandbox build-image`, with
  `--repo` for the repository-task image.

One-shot isolated runs (`run_isolated`, the code verifier's checks) use agent containers;
their guarantees are in `sandbox_workers.docker_oneshot`.

Module layout (each module's docstring states its own guarantees):
`sandbox_workers.docker_engine` (the client, ownership labels, the reaper),
`sandbox_workers.docker_pool` (container settings, exec over the socket, the warm pool
and clean-up), `sandbox_workers.docker_oneshot` (agent containers, `run_isolated`), the
agent program that runs inside them (`sandbox_workers.docker_agent`, with
`docker_agent_protocol` and `docker_agent_clean`), and this module (`DockerSandbox` only:
import every other name from the module that defines it).

Blocking API (like the process backend): call it from a thread in async code. The
methods of one sandbox are serialized by a lock; use one sandbox per concurrent task.
"""

from __future__ import annotations

import errno
import posixpath
import threading
import time
import uuid

from sandbox_workers.base import MIB, WORK_DIR, ExecResult, HeadTailBuffer, Limits, Sandbox, decode_output
from sandbox_workers.docker_engine import env_int, import_docker, log
from sandbox_workers.docker_pool import DEFAULT_IMAGE, OOM_HINTS, RUN_USER, Box, Exec, WarmPool, get_pool, sandbox_path

KILL_GRACE_S = 1.5
MAX_READ_FILE = 256 * MIB
EXIT_MARK = b"\x1erlbus-exit "
_MARK_HOLD = 64  # stderr bytes held back until EOF, to find and strip the exit line

# $0 = name, $1 = timeout seconds, $2... = argv. See the module docstring. The shell's
# own messages (e.g. "Killed") go to /dev/null; the command's stderr is fd 3. The
# subshell execs (no extra process): the redirections must not be in effect while
# this shell waits, or dash would print job status to fd 3.
_WRAPPER = r"""
exec 3>&2 2>/dev/null
f=/sys/fs/cgroup/memory/memory.oom_control
[ -r "$f" ] || f=/sys/fs/cgroup/memory.events
oom() { n=0; if [ -r "$f" ]; then while read -r k v; do [ "$k" = oom_kill ] && n=$v; done < "$f"; fi; }
oom; before=$n
t=$1; shift
(exec timeout -s KILL "$t" "$@" </dev/null 2>&3 3>&-)
rc=$?
kill -9 -1; kill -9 -1
oom
printf '\036rlbus-exit %d %d\n' "$rc" "$((n - before))" >&3
exit 0
"""

_SWEEP = "kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; exit 0"

_READ_SCRIPT = r"""
p=$1
[ -e "$p" ] || [ -L "$p" ] || exit 2
r=$(realpath -e -- "$p") || exit 2
[ "$r" = "$p" ] || exit 3
[ -f "$p" ] || exit 4
s=$(stat -c %s -- "$p") || exit 4
[ "$s" -le "$2" ] || exit 5
exec cat -- "$p"
"""

_WRITE_SCRIPT = r"""
d=$1; t=$1/$2
r=$(realpath -m -- "$d") || exit 3
[ "$r" = "$d" ] || exit 3
mkdir -p -- "$d" || exit 6
[ -L "$t" ] && exit 3
if [ -e "$t" ] && [ ! -f "$t" ]; then exit 4; fi
exec cat > "$t"
"""

_FILE_ERRORS = {
    2: (FileNotFoundError, errno.ENOENT, "no such file"),
    3: (OSError, errno.ELOOP, "a symlink on the path (symlinks are never followed)"),
    4: (OSError, errno.EINVAL, "not a regular file"),
    5: (OSError, errno.EFBIG, "file too large"),
    6: (OSError, errno.ENOTDIR, "cannot create the parent directory"),
}


class _StderrHold:
    """Feeds stderr to a HeadTailBuffer, holding back the last bytes (the exit line)."""

    def __init__(self, buf: HeadTailBuffer) -> None:
        self.buf = buf
        self.hold = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.hold += chunk
        extra = len(self.hold) - _MARK_HOLD
        if extra > 0:
            self.buf.feed(bytes(self.hold[:extra]))
            del self.hold[:extra]

    def finish(self) -> tuple[int, int] | None:
        """Strip the wrapper's exit line; returns (status, oom kills) if it was there."""
        found = None
        at = self.hold.rfind(EXIT_MARK)
        if at >= 0 and self.hold.endswith(b"\n"):
            try:
                rc, oom = self.hold[at + len(EXIT_MARK) :].split()
                found = (int(rc), int(oom))
                del self.hold[at:]
            except ValueError:
                found = None
        self.buf.feed(bytes(self.hold))
        self.hold.clear()
        return found


class _Bytes:
    """An uncapped sink (file reads), refusing more than `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.data = bytearray()
        self.limit = limit

    def feed(self, chunk: bytes) -> None:
        if len(self.data) + len(chunk) > self.limit:
            raise OSError(errno.EFBIG, f"more than {self.limit} bytes")
        self.data += chunk


# -- the sandbox ------------------------------------------------------------------------


class DockerSandbox(Sandbox):
    """A sandbox backed by one container from the process's warm pool."""

    def __init__(self, warm_pool: int | None = None, concurrency: int | None = None, cpus: float = 1.0) -> None:
        """warm_pool: containers kept ready (None: env RLBUS_SANDBOX_WARM_POOL, else 2);
        concurrency: sandboxes used at once by this process (sizes the HTTP pool);
        cpus: CPU quota per container."""
        self.warm_pool = warm_pool if warm_pool is not None else env_int("RLBUS_SANDBOX_WARM_POOL", 2)
        self.concurrency = concurrency
        self.cpus = cpus
        self.id = uuid.uuid4().hex[:12]
        self.isolation = "docker"
        self.limits = Limits()
        self.default_timeout = 30.0
        self.image = DEFAULT_IMAGE
        self._pool: WarmPool | None = None
        self._box: Box | None = None
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------
    def start(self, image: str | None = None, limits: Limits | None = None, timeout: float = 30.0) -> None:
        """Take a fresh container (image default `rlbus-sandbox:latest`)."""
        self.image = image or DEFAULT_IMAGE
        self.limits = limits or Limits()
        self.default_timeout = timeout
        with self._lock:
            self._pool = get_pool(self.image, self.limits, self.cpus, self.warm_pool, self.concurrency)
            self._box = self._pool.acquire()
        log.debug("sandbox.started", sandbox=self.id, container=self._box.id[:12], image=self.image)

    @property
    def container_id(self) -> str | None:
        """The id of the container behind this sandbox now (changes on reset)."""
        return self._box.id if self._box else None

    def reset(self) -> None:
        """Swap in a fresh container; the used one is cleaned (or removed) in the background."""
        with self._lock:
            box = self._require()
            self._box = None
            self._pool.release(box)
            self._box = self._pool.acquire()

    def close(self) -> None:
        """Give the container back (cleaned for reuse, or removed); idempotent."""
        with self._lock:
            if self._box is None:
                return
            box, self._box = self._box, None
            self._pool.release(box)

    def _require(self) -> Box:
        if self._box is None:
            raise RuntimeError("sandbox not started (or closed)")
        return self._box

    def _replace(self, why: str) -> None:
        """Kill the container (its processes could not be stopped) and take a fresh one."""
        box = self._require()
        log.warning("sandbox.replaced", sandbox=self.id, container=box.id[:12], reason=why)
        self._box = None
        self._pool.kill(box)
        self._box = self._pool.acquire()

    # -- execute ---------------------------------------------------------------------
    def execute(self, cmd: list[str] | str, timeout: float | None = None) -> ExecResult:
        """Run `cmd` in the container; see the module docstring for the guarantees."""
        timeout = self.default_timeout if timeout is None else float(timeout)
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        with self._lock:
            cap = self.limits.output_cap_bytes
            out, err = HeadTailBuffer(cap), HeadTailBuffer(cap)
            hold = _StderrHold(err)
            t0 = time.monotonic()
            # `timeout 0` would mean "no limit": the shortest limit is 1 ms
            ex = self._start_exec(["/bin/sh", "-c", _WRAPPER, "rlbus-exec", f"{max(timeout, 0.001):.3f}", *argv])
            try:
                finished = ex.pump({1: out, 2: hold}, t0 + timeout + KILL_GRACE_S)
                if not finished:
                    finished = self._stop_stuck(ex, out, hold)
                mark = hold.finish()
                wrapper_rc = ex.exit_code() if finished else None
            finally:
                ex.close()
            elapsed = time.monotonic() - t0
            if wrapper_rc != 0 or mark is None:
                rc, oom_kills = self._after_broken_wrapper(finished, wrapper_rc)
            else:
                rc, oom_kills = mark
        timed_out = not finished or (rc == 137 and elapsed >= timeout)
        oom = oom_kills > 0 or any(h in err.head or h in err.tail for h in OOM_HINTS)
        return ExecResult(
            exit_code=rc,
            stdout=decode_output(out.getvalue()),
            stderr=decode_output(err.getvalue()),
            timed_out=timed_out,
            oom=oom,
            truncated=out.truncated or err.truncated,
            duration_ms=round(elapsed * 1000, 3),
            isolation="docker",
        )

    def _start_exec(self, argv: list[str]) -> Exec:
        """Start the wrapper exec; a container that cannot run one is replaced, once."""
        docker = import_docker()
        try:
            return Exec(self._pool.api, self._require().id, argv, user=RUN_USER)
        except docker.errors.APIError as exc:
            self._replace(f"exec failed: {exc}")
        return Exec(self._pool.api, self._require().id, argv, user=RUN_USER)

    def _stop_stuck(self, ex: Exec, out: HeadTailBuffer, hold: _StderrHold) -> bool:
        """Past the deadline: kill every sandbox process from outside; True if the exec ended."""
        log.info("sandbox.timeout_kill", sandbox=self.id, container=self._box.id[:12])
        if self._sweep() and ex.pump({1: out, 2: hold}, time.monotonic() + KILL_GRACE_S):
            return True
        self._replace("command still running after the host-side kill")
        return False

    def _after_broken_wrapper(self, finished: bool, wrapper_rc: int | None) -> tuple[int, int]:
        """The wrapper did not report (it was killed, or the exec hung): sweep, keep its status."""
        if finished and not self._sweep():
            self._replace("could not sweep after the wrapper died")
        if wrapper_rc is None:
            return 137, 0
        return wrapper_rc, 0

    def _sweep(self) -> bool:
        """`kill -9 -1` as the sandbox user in a new exec; False if that cannot run."""
        try:
            ex = Exec(self._pool.api, self._box.id, ["/bin/sh", "-c", _SWEEP], user=RUN_USER)
        except Exception as exc:  # noqa: BLE001 - e.g. the pids limit is exhausted
            log.info("sandbox.sweep_failed", sandbox=self.id, error=str(exc))
            return False
        try:
            return ex.pump({}, time.monotonic() + KILL_GRACE_S) and ex.exit_code() == 0
        finally:
            ex.close()

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command name) of every process in the container, the listing one excluded."""
        script = (
            'for p in /proc/[0-9]*; do [ "${p#/proc/}" = "$$" ] && continue; '
            'c=?; read -r c < "$p/comm" 2>/dev/null; echo "${p#/proc/} $c"; done'
        )
        out = self._run_simple(["/bin/sh", "-c", script], b"", 10.0)[1]
        return [(int(pid), name) for pid, name in (line.split(maxsplit=1) for line in out.decode().splitlines())]

    # -- files -----------------------------------------------------------------------
    def _run_simple(
        self, argv: list[str], stdin: bytes | None, timeout: float, limit: int = 16 * MIB
    ) -> tuple[int, bytes, bytes]:
        """Run a helper exec as the sandbox user: (exit code, stdout, stderr)."""
        with self._lock:
            box = self._require()
            ex = Exec(self._pool.api, box.id, argv, user=RUN_USER, stdin=stdin is not None)
            out, err = _Bytes(limit), _Bytes(64 * 1024)
            try:
                if stdin is not None:
                    ex.send_stdin(stdin)
                if not ex.pump({1: out, 2: err}, time.monotonic() + timeout):
                    raise TimeoutError(f"sandbox file operation took more than {timeout} s")
                rc = ex.exit_code()
            finally:
                ex.close()
        return (-1 if rc is None else rc), bytes(out.data), bytes(err.data)

    def read_file(self, path: str) -> bytes:
        """Bytes of a regular file under /work (no symlink anywhere on the path)."""
        parent, name = sandbox_path(path)
        full = posixpath.join(parent, name)
        rc, data, err = self._run_simple(
            ["/bin/sh", "-c", _READ_SCRIPT, "rlbus-read", full, str(MAX_READ_FILE)], None, 60.0, limit=MAX_READ_FILE
        )
        _raise_file_error(rc, path, err)
        return data

    def write_files(self, files: list[tuple[str, bytes]]) -> None:
        """Write several files under /work with ONE exec: a tar we build (regular files only,
        names checked like `write_file`'s) unpacked by the sandbox user; an existing
        symlink at a target is replaced, never followed."""
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for path, data in files:
                parent, name = sandbox_path(path)
                info = tarfile.TarInfo(posixpath.relpath(posixpath.join(parent, name), WORK_DIR))
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(bytes(data)))
        rc, _, err = self._run_simple(
            ["/bin/sh", "-c", "cd /work && exec tar -x -f - --no-same-owner --unlink-first", "rlbus-untar"],
            buf.getvalue(),
            60.0,
        )
        _raise_file_error(rc, ",".join(p for p, _ in files), err)

    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file under /work (parents created; no symlinks followed)."""
        parent, name = sandbox_path(path)
        rc, _, err = self._run_simple(["/bin/sh", "-c", _WRITE_SCRIPT, "rlbus-write", parent, name], bytes(data), 60.0)
        _raise_file_error(rc, path, err)


def _raise_file_error(rc: int, path: str, err: bytes) -> None:
    if rc == 0:
        return
    kind, code, what = _FILE_ERRORS.get(rc, (OSError, errno.EIO, f"failed (exit {rc})"))
    detail = err.decode(errors="replace").strip()
    raise kind(code, f"{what}: {path!r}" + (f" ({detail})" if detail else ""))
