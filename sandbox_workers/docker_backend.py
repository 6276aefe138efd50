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
  returned one that passed `_CLEAN_SCRIPT` (every 65534 process killed, `/work`,
  `/tmp`, POSIX and SysV IPC wiped) and was then *proven* clean: the only pids are
  docker-init and `sleep`, and the wiped dirs are empty. A container that fails the
  proof, or was used `MAX_USES` times, is removed instead. `reset()` swaps in such a
  fresh container (the old one is cleaned or removed in the background).
- Warm pool: one pool per (image, limits, cpus) per process (module level, shared by
  every `DockerSandbox` of the process; `shutdown_pools()` and an `atexit` hook remove
  its containers). It keeps `warm_pool` containers ready (argument, else env
  `RLBUS_SANDBOX_WARM_POOL`, else 2 = `SandboxSection.warm_pool`), refilled and cleaned
  by a background thread pool of `REFILL_WORKERS` threads (bounded concurrency).
  With `warm_pool=0` containers are created on demand and removed on `close`.
- One `DockerClient` per process; its HTTP connection pool (`max_pool_size`) is sized
  to the largest `concurrency` asked for (argument, else env
  `RLBUS_SANDBOX_CONCURRENCY`, else 8) plus the refill threads, so concurrent
  sandboxes never queue on, or throw away, connections.
- Every container is labelled `rlbus.sandbox=1` with its owner
  (`rlbus.sandbox.owner=<host>:<pid>:<start time>`). `reap()` removes, in any state
  (`Created` included), labelled containers whose owner process is gone, and this
  process's containers that no pool tracks; `reap(all_owners=True)` removes them all.
  The first pool of a process reaps at start, then every `REAP_INTERVAL_S`.
- Files: `read_file`/`write_file` go through an exec (tar archives cannot reach a
  tmpfs nor a read-only root). Paths are relative to `/work` (or absolute under it);
  no component may be a symlink, like the process backend.
- A missing image raises `SandboxImageMissing`, which names the command that builds
  it: `rlbus sandbox build-image`.

One-shot isolated runs (`run_isolated`; the code verifier's checks): a second kind of
container whose main process (behind docker-init) is a resident agent,
`sandbox_workers.docker_agent` (its source travels in the container's command; read its
docstring for the protocol and the threat model). Same isolation as above, except: the
agent runs as uid 0 with only SETUID, SETGID and KILL added back (every command still
runs as 65534 with no capability), `mem_limit` gets `AGENT_MEMORY_MB` more and
`pids_limit` is `pids + AGENT_PID_HEADROOM` (the command's tree gets `pids`), and the
cpu rlimit is set per command by the agent. A run is ONE request/reply over the
container's attached stdin/stdout (it has no network): the agent writes the files into
an empty /work, runs the command in a child forked before the request was read, kills
every process, wipes /work, /tmp, /dev/mqueue and SysV IPC and proves the container
clean; only then does the host put it back in its `AgentPool` (no docker API call per
run in the steady state). A container whose agent reports it unclean, used
`AGENT_MAX_USES` times, or whose agent dies or misses `timeout + AGENT_GRACE_S`, is
removed (the latter two raise `ContainerUnusable`: an infrastructure error, never a
result). The pool keeps max(warm_pool, most runs at once) containers in all.

Blocking API (like the process backend): call it from a thread in async code. The
methods of one sandbox are serialized by a lock; use one sandbox per concurrent task.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import errno
import marshal
import os
import posixpath
import select
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import structlog

from sandbox_workers import docker_agent as _AGENT  # stdlib only: the protocol's constants
from sandbox_workers.base import (
    MIB,
    WORK_DIR,
    ExecResult,
    HeadTailBuffer,
    Limits,
    Sandbox,
    decode_output,
    sandbox_path_parts,
)

if TYPE_CHECKING:  # the SDK is imported lazily: this module imports without an engine
    import docker

log = structlog.get_logger()

DEFAULT_IMAGE = "rlbus-sandbox:latest"
BUILD_HINT = "rlbus sandbox build-image"
LABEL = "rlbus.sandbox"
OWNER_LABEL = "rlbus.sandbox.owner"
RUN_USER = "65534:65534"
HOLDER_USER = "65532:65532"
PID_HEADROOM = 4  # docker-init, sleep, wrapper sh, timeout
KILL_GRACE_S = 1.5
INSPECT_WAIT_S = 2.0
MAX_USES = 100
REFILL_WORKERS = 2
REAP_INTERVAL_S = 60.0
REAP_MIN_AGE_S = 60.0
MAX_READ_FILE = 256 * MIB
DEFAULT_CONCURRENCY = 8
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OOM_HINTS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
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

# Wipes and then proves: prints `pid <pid> <comm>` for every other process and
# `left <path>` for anything left in the wiped dirs, then `clean-done`.
_CLEAN_SCRIPT = r"""
kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null
chmod 0700 /work 2>/dev/null
chmod -R u+rwX /work /tmp 2>/dev/null
rm -rf /work/* /work/.[!.]* /work/..?* /tmp/* /tmp/.[!.]* /tmp/..?* /dev/mqueue/* 2>/dev/null
ipcrm -a 2>/dev/null
i=0
while [ $i -lt 400 ]; do
  n=0
  for p in /proc/[0-9]*; do [ "${p#/proc/}" = "$$" ] || n=$((n + 1)); done
  [ $n -le 2 ] && break
  i=$((i + 1)); sleep 0.005
done
for p in /proc/[0-9]*; do
  [ "${p#/proc/}" = "$$" ] && continue
  c=?; read -r c < "$p/comm" 2>/dev/null
  echo "pid ${p#/proc/} $c"
done
for e in /work/* /work/.[!.]* /work/..?* /tmp/* /tmp/.[!.]* /tmp/..?* /dev/mqueue/*; do
  if [ -e "$e" ] || [ -L "$e" ]; then echo "left $e"; fi
done
echo clean-done
"""

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


class SandboxImageMissing(RuntimeError):
    """The sandbox image is not on the engine; the message says how to build it."""


class ContainerUnusable(RuntimeError):
    """A container could not be proven clean or could not run an exec."""


# -- the client ---------------------------------------------------------------------

_client_lock = threading.Lock()
_client: docker.DockerClient | None = None
_client_pool_size = 0


def _import_docker():
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - dependency of the project
        raise RuntimeError("the docker backend needs the `docker` package: pip install docker") from exc
    return docker


def get_client(concurrency: int | None = None) -> docker.DockerClient:
    """The process's DockerClient, its connection pool sized for `concurrency` workers."""
    global _client, _client_pool_size
    want = _concurrency(concurrency) + REFILL_WORKERS + 2  # +2: reaper, one-off calls
    with _client_lock:
        if _client is None or _client_pool_size < want:
            docker = _import_docker()
            try:
                client = docker.from_env(max_pool_size=want, timeout=60)
                client.ping()
            except Exception as exc:
                raise RuntimeError(
                    f"no Docker engine answers ({exc}); start one, set DOCKER_HOST, "
                    "or use the process backend (--backend process)") from exc
            _client, _client_pool_size = client, want
        return _client


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _concurrency(value: int | None) -> int:
    return max(1, value if value is not None else _env_int("RLBUS_SANDBOX_CONCURRENCY", DEFAULT_CONCURRENCY))


# -- owners and the reaper ------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


OWNER = f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _owner_alive(owner: str | None) -> bool | None:
    """True/False for an owner on this host; None when it lives elsewhere (unknown)."""
    if not owner or owner.count(":") != 2:
        return False
    host, pid, start = owner.split(":")
    if host != socket.gethostname():
        return None
    return pid.isdigit() and _start_time(int(pid)) == start


def reap(all_owners: bool = False, client: docker.DockerClient | None = None) -> list[str]:
    """Remove labelled sandbox containers in any state; returns the removed ids.

    Default: those whose owner process is gone (or unlabelled), and this process's own
    containers that no pool tracks and are older than `REAP_MIN_AGE_S`. Containers of
    live owners elsewhere are kept. `all_owners=True`: every labelled container.
    """
    client = client or get_client()
    tracked = _tracked_ids()
    removed = []
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        owner = (c.get("Labels") or {}).get(OWNER_LABEL)
        if not all_owners:
            if owner == OWNER:
                if c["Id"] in tracked or time.time() - c.get("Created", 0) < REAP_MIN_AGE_S:
                    continue
            elif _owner_alive(owner) is not False:
                continue
        if _remove(client, c["Id"]):
            removed.append(c["Id"])
    if removed:
        log.info("sandbox.reaped", count=len(removed), all_owners=all_owners)
    return removed


def _remove(client, cid: str) -> bool:
    docker = _import_docker()
    try:
        client.api.remove_container(cid, force=True, v=True)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as exc:
        if exc.status_code == 409:  # removal already in progress
            return False
        log.warning("sandbox.remove_failed", container=cid[:12], error=str(exc))
        return False


_reaper_started = False


def _start_reaper(client) -> None:
    """Reap once now, then every REAP_INTERVAL_S in a daemon thread (once per process)."""
    global _reaper_started
    with _client_lock:
        if _reaper_started:
            return
        _reaper_started = True
    try:
        reap(client=client)
    except Exception as exc:  # noqa: BLE001 - a failed sweep must not block sandboxes
        log.warning("sandbox.reap_failed", error=repr(exc))

    def loop() -> None:
        while True:
            time.sleep(REAP_INTERVAL_S)
            try:
                reap(client=client)
            except Exception as exc:  # noqa: BLE001
                log.warning("sandbox.reap_failed", error=repr(exc))

    threading.Thread(target=loop, name="rlbus-sbx-reaper", daemon=True).start()


# -- exec over the multiplexed socket ---------------------------------------------------

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
                rc, oom = self.hold[at + len(EXIT_MARK):].split()
                found = (int(rc), int(oom))
                del self.hold[at:]
            except ValueError:
                found = None
        self.buf.feed(bytes(self.hold))
        self.hold.clear()
        return found


class _Frames:
    """Docker's multiplexed stream on a hijacked socket: 8-byte headers (stream id, length), then
    that many payload bytes.

    `_read_once` does one recv and hands each payload chunk, in order and unchanged, to
    `_deliver(chunk)` with `self.stream` naming its stream (1 stdout, 2 stderr); it returns
    False once the engine closed the stream. A recv never asks for more than the rest of the
    current header or frame, nor more than 1 MiB.
    """

    def __init__(self, resp) -> None:
        self.resp = resp
        self.sock: socket.socket = getattr(resp, "_sock", resp)
        self.header = bytearray()
        self.stream = 0
        self.remaining = 0

    def _deliver(self, chunk: bytes) -> None:
        raise NotImplementedError

    def _read_once(self) -> bool:
        if self.remaining == 0:
            chunk = self.sock.recv(8 - len(self.header))
            if not chunk:
                return False
            self.header += chunk
            if len(self.header) == 8:
                self.stream = self.header[0]
                self.remaining = int.from_bytes(self.header[4:8], "big")
                self.header.clear()
            return True
        chunk = self.sock.recv(min(self.remaining, MIB))
        if not chunk:
            return False
        self.remaining -= len(chunk)
        self._deliver(chunk)
        return True

    def close(self) -> None:
        """Close the socket and the response; idempotent, never raises OSError."""
        for thing in (self.sock, self.resp):
            try:
                thing.close()
            except OSError:
                pass


class _Exec(_Frames):
    """One running exec: its id and hijacked socket, read frame by frame."""

    def __init__(self, api, cid: str, argv: list[str], *, user: str, stdin: bool = False) -> None:
        self.api = api
        self.id = api.exec_create(cid, argv, user=user, workdir=WORK_DIR, stdin=stdin)["Id"]
        super().__init__(api.exec_start(self.id, socket=True))
        self.sinks: dict[int, Any] = {}

    def send_stdin(self, data: bytes) -> None:
        """Write all of `data` to the command's stdin, then close it."""
        self.sock.sendall(data)
        self.sock.shutdown(socket.SHUT_WR)

    def pump(self, sinks: dict[int, Any], deadline: float) -> bool:
        """Feed frames to sinks[1] (stdout) / sinks[2] (stderr) until EOF (True) or deadline."""
        self.sinks = sinks
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if not ready:
                continue
            if not self._read_once():
                return True

    def _deliver(self, chunk: bytes) -> None:
        sink = self.sinks.get(self.stream)
        if sink is not None:
            sink.feed(chunk)

    def exit_code(self, wait_s: float = INSPECT_WAIT_S) -> int | None:
        """The exec's exit code once the engine has recorded it (None if still running)."""
        end = time.monotonic() + wait_s
        while True:
            info = self.api.exec_inspect(self.id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            if time.monotonic() > end:
                return None
            time.sleep(0.005)


class _Bytes:
    """An uncapped sink (file reads), refusing more than `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.data = bytearray()
        self.limit = limit

    def feed(self, chunk: bytes) -> None:
        if len(self.data) + len(chunk) > self.limit:
            raise OSError(errno.EFBIG, f"more than {self.limit} bytes")
        self.data += chunk


# -- containers and the warm pool --------------------------------------------------------

class _Box:
    """A container the pool owns."""

    __slots__ = ("id", "uses")

    def __init__(self, cid: str) -> None:
        self.id = cid
        self.uses = 0


def container_kwargs(image: str, limits: Limits, cpus: float) -> dict:
    """Keyword arguments of `APIClient.create_container` for one sandbox container."""
    from docker.types import LogConfig, Ulimit

    tmpfs_opts = f"rw,nosuid,nodev,size={limits.tmp_mb}m"
    host_config = {
        "init": True,
        "network_mode": "none",
        "read_only": True,
        "ipc_mode": "none",
        "tmpfs": {WORK_DIR: f"{tmpfs_opts},exec,uid=65534,gid=65534,mode=0700",
                  "/tmp": f"{tmpfs_opts},noexec,mode=1777"},
        "mem_limit": limits.memory_mb * MIB,
        "memswap_limit": limits.memory_mb * MIB,
        "pids_limit": limits.pids + PID_HEADROOM,
        "nano_cpus": int(cpus * 1e9),
        "ulimits": [Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
                    Ulimit(name="fsize", soft=limits.file_size_mb * MIB, hard=limits.file_size_mb * MIB),
                    Ulimit(name="cpu", soft=limits.cpu_seconds, hard=limits.cpu_seconds + 1),
                    Ulimit(name="core", soft=0, hard=0)],
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "log_config": LogConfig(type="none"),
    }
    return {
        "image": image, "command": ["sleep", "infinity"], "user": HOLDER_USER, "working_dir": WORK_DIR,
        "hostname": "sandbox", "network_disabled": True, "labels": {LABEL: "1", OWNER_LABEL: OWNER},
        "environment": {"PATH": SANDBOX_PATH, "HOME": WORK_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                        "PYTHONDONTWRITEBYTECODE": "1"},
        "host_config": host_config,
    }


class WarmPool:
    """Clean containers of one (image, limits, cpus), kept ready and refilled in the background."""

    def __init__(self, client, image: str, limits: Limits, cpus: float, size: int) -> None:
        self.client = client
        self.api = client.api
        self.image = image
        self.limits = limits
        self.cpus = cpus
        self.size = size
        self.idle: collections.deque[_Box] = collections.deque()
        self.boxes: dict[str, _Box] = {}
        self.pending = 0  # creations and cleanings in flight that may end in `idle`
        self.waiting = 0  # acquire() calls waiting for one of those
        self.broken: str | None = None  # why background creation stopped (e.g. no image)
        self.cond = threading.Condition()
        self.closed = False
        self.workers = concurrent.futures.ThreadPoolExecutor(REFILL_WORKERS, thread_name_prefix="rlbus-sbx-pool")

    # -- creating and removing --------------------------------------------------------
    def create(self) -> _Box:
        """A new started container (blocking); SandboxImageMissing if the image is absent.

        The container is tracked in `boxes` from its creation on; if starting it fails, it is
        removed before the error propagates."""
        docker = _import_docker()
        kwargs = self._container_kwargs()
        kwargs["host_config"] = self.api.create_host_config(**kwargs["host_config"])
        try:
            cid = self.api.create_container(**kwargs)["Id"]
        except docker.errors.ImageNotFound:
            raise SandboxImageMissing(_missing_image_message(self.image)) from None
        box = self._new_box(cid)
        with self.cond:
            self.boxes[cid] = box
        try:
            self._start(box)
        except BaseException:
            self.remove(box)
            raise
        return box

    def _container_kwargs(self) -> dict:
        return container_kwargs(self.image, self.limits, self.cpus)

    def _new_box(self, cid: str) -> _Box:
        return _Box(cid)

    def _start(self, box: _Box) -> None:
        self.api.start(box.id)

    def remove(self, box: _Box) -> None:
        with self.cond:
            self.boxes.pop(box.id, None)
        _remove(self.client, box.id)

    # -- hand-out and return ----------------------------------------------------------
    def acquire(self) -> _Box:
        """A fresh container: an idle one, one finishing its clean-up, or a new one."""
        with self.cond:
            self._count_in_use_locked(1)
            # wait only for containers nobody waiting before us will take
            if not self.idle and self.pending > self.waiting and not self.closed and self.broken is None:
                self.waiting += 1
                try:
                    self.cond.wait_for(lambda: self.idle or not self.pending or self.closed, timeout=10)
                finally:
                    self.waiting -= 1
            box = self.idle.popleft() if self.idle else None
            self._refill_locked()
        if box is None:
            try:
                box = self.create()
            except BaseException:
                with self.cond:
                    self._count_in_use_locked(-1)
                raise
            with self.cond:
                self.broken = None  # creation works (again): background refills may resume
        box.uses += 1
        return box

    def _count_in_use_locked(self, delta: int) -> None:
        """Hook (under `cond`): a container was handed out (+1) or failed to be (-1). The plain
        pool does not count them; AgentPool sizes itself by them."""

    def _room_locked(self) -> int:
        """How many more containers the pool wants idle (under `cond`); `pending` not subtracted."""
        return self.size - len(self.idle)

    def release(self, box: _Box) -> None:
        """Take back a used container: cleaned and proven clean for reuse, or removed.

        Recycling (one exec) is much cheaper than creating, so a returned container is
        always cleaned while the pool is open; if the pool is full by the time it is
        clean, it is removed then.
        """
        with self.cond:
            keep = not self.closed and self.size > 0 and box.uses < MAX_USES
            if keep:
                self.pending += 1
        if keep:
            self._submit(self._recycle, box)
        elif self.size == 0 or self.closed:
            self.remove(box)  # no pool to return to: remove now, in the caller
        else:
            self._submit(self.remove, box)

    def kill(self, box: _Box) -> None:
        """Kill a container now (its processes could not be stopped); remove it in the background."""
        try:
            self.api.kill(box.id)
        except Exception:  # noqa: BLE001, S110 - the forced removal below kills it anyway
            pass
        self._submit(self.remove, box)

    def _submit(self, fn, box: _Box) -> None:
        try:
            self.workers.submit(fn, box)
        except RuntimeError:  # shut down: do it here
            fn(box)

    def _refill_locked(self) -> None:
        if self.closed or self.broken is not None:
            return
        for _ in range(self._room_locked() - self.pending):
            try:
                self.workers.submit(self._fill)
            except RuntimeError:  # interpreter shutting down
                return
            self.pending += 1

    def _fill(self) -> None:
        box = None
        try:
            box = self.create()
        except Exception as exc:  # noqa: BLE001 - recorded; acquire() raises it in the caller
            with self.cond:
                self.broken = str(exc)
            log.warning("sandbox.pool_refill_failed", image=self.image, error=str(exc))
        self._settle(box)

    def _recycle(self, box: _Box) -> None:
        try:
            clean_container(self.api, box.id)
        except Exception as exc:  # noqa: BLE001 - an unclean container is never reused
            log.info("sandbox.recycle_failed", container=box.id[:12], error=str(exc))
            self.remove(box)
            box = None
        self._settle(box)

    def _settle(self, box: _Box | None) -> None:
        with self.cond:
            self.pending -= 1
            if box is not None and not self.closed and self._room_locked() > 0:
                self.idle.append(box)
                box = None
            self._refill_locked()
            self.cond.notify_all()
        if box is not None:
            self.remove(box)

    def shutdown(self) -> None:
        """Stop refilling and remove every container of this pool (idle and in use)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.workers.shutdown(wait=True, cancel_futures=True)
        with self.cond:
            boxes = list(self.boxes.values())
            self.idle.clear()
        for box in boxes:
            self.remove(box)


def clean_container(api, cid: str) -> None:
    """Wipe a used container and prove it clean; ContainerUnusable if it is not."""
    ex = _Exec(api, cid, ["/bin/sh", "-c", _CLEAN_SCRIPT, "rlbus-clean"], user=RUN_USER)
    out = HeadTailBuffer(64 * 1024)
    try:
        if not ex.pump({1: out, 2: HeadTailBuffer(4096)}, time.monotonic() + 10):
            raise ContainerUnusable("clean-up did not finish in 10 s")
        rc = ex.exit_code()
    finally:
        ex.close()
    lines = out.getvalue().decode(errors="replace").splitlines()
    procs = sorted(line.split(maxsplit=2)[-1] for line in lines if line.startswith("pid "))
    left = [line for line in lines if line.startswith("left ")]
    if rc != 0 or lines[-1:] != ["clean-done"] or procs != ["docker-init", "sleep"] or left:
        raise ContainerUnusable(f"not clean: rc={rc} procs={procs} left={left[:5]}")


def _missing_image_message(image: str) -> str:
    tag = "" if image == DEFAULT_IMAGE else f" --tag {image}"
    return (f"sandbox image {image!r} is not on this Docker engine; build it with: "
            f"{BUILD_HINT}{tag}")


_pools: dict[tuple, WarmPool] = {}
_pools_lock = threading.Lock()


def _tracked_ids() -> set[str]:
    with _pools_lock:
        pools = list(_pools.values())
    ids: set[str] = set()
    for pool in pools:
        with pool.cond:
            ids.update(pool.boxes)
    return ids


def get_pool(image: str, limits: Limits, cpus: float, size: int, concurrency: int | None) -> WarmPool:
    """The process's pool for (image, limits, cpus); its size grows to the largest asked."""
    return _shared_pool(WarmPool, (image, limits, cpus), image, limits, cpus, size, concurrency)


def _shared_pool(cls, key: tuple, image: str, limits: Limits, cpus: float, size: int, concurrency: int | None):
    """The open `cls` pool under `key` in `_pools` (a new one if none is open), its size raised
    to at least `size`; the reaper runs once any pool exists."""
    client = get_client(concurrency)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = cls(client, image, limits, cpus, size)
        else:
            with pool.cond:
                pool.size = max(pool.size, size)
    _start_reaper(client)
    return pool


def shutdown_pools() -> None:
    """Remove every container of every pool of this process (also run at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown()


atexit.register(shutdown_pools)


# -- the resident agent: one round trip per isolated run -----------------------------------

AGENT_LABEL = "rlbus.sandbox.agent"
AGENT_USER = "0:0"
AGENT_CAPS = ["SETUID", "SETGID", "KILL"]
AGENT_PID_HEADROOM = 2  # docker-init and the agent: the command (the zygote) and its tree get `pids`
AGENT_MEMORY_MB = 48  # the agent and its zygote, on top of the command's memory
AGENT_MAX_USES = 1000
AGENT_GRACE_S = 5.0
AGENT_START_S = 30.0
AGENT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docker_agent.py")


def agent_source() -> str:
    """The agent's source, passed in the container's command (the image has no project code)."""
    global _agent_source
    if _agent_source is None:
        with open(AGENT_PATH, encoding="utf-8") as f:
            _agent_source = f.read()
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
    kw.update(command=["python3", "-I", "-S", "-c", agent_source(), "rlbus-agent"], user=AGENT_USER,
              stdin_open=True, tty=False, labels={**kw["labels"], AGENT_LABEL: "1"})
    return kw


class AgentGone(ContainerUnusable):
    """The agent closed its stream, stopped answering, or sent garbage."""


class _AgentStream(_Frames):
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
                    payload = bytes(self.out[4:4 + n])
                    del self.out[:4 + n]
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
    __slots__ = ("kind", "code", "flags", "oom", "duration", "exists", "stdout", "stderr", "message")

    def __init__(self, payload: bytes) -> None:
        reply = _AGENT.REPLY
        if len(payload) < reply.size:
            raise AgentGone(f"short reply from the sandbox agent ({len(payload)} bytes)")
        (self.kind, self.code, self.flags, self.oom, self.duration, self.exists,
         n_out, n_err, n_msg) = reply.unpack_from(payload)
        if reply.size + n_out + n_err + n_msg != len(payload):
            raise AgentGone("malformed reply from the sandbox agent")
        at = reply.size
        self.stdout, at = payload[at:at + n_out], at + n_out
        self.stderr, at = payload[at:at + n_err], at + n_err
        self.message = payload[at:at + n_msg].decode(errors="replace")

    @property
    def clean(self) -> bool:
        return bool(self.flags & _AGENT.CLEAN)


class _AgentBox(_Box):
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
            raise AgentGone(f"the sandbox agent refused to start: {hello.message} "
                            f"{box.stream.diagnostics()}")

    def remove(self, box: _Box) -> None:
        stream = getattr(box, "stream", None)
        if stream is not None:
            stream.close()
        super().remove(box)

    def release(self, box: _Box, clean: bool = False) -> None:
        """Take back a container after a run: kept when its agent proved it clean, else removed."""
        with self.cond:
            self.in_use -= 1
            keep = (clean and not self.closed and box.uses < AGENT_MAX_USES
                    and self._room_locked() - self.pending > 0)
            if keep:
                self.idle.append(box)
            self._refill_locked()
            self.cond.notify_all()
        if not keep:
            self._submit(self.remove, box)

    def kill(self, box: _Box) -> None:
        with self.cond:
            self.in_use -= 1
            self._refill_locked()
        super().kill(box)


def get_agent_pool(image: str, limits: Limits, cpus: float, size: int, concurrency: int | None) -> AgentPool:
    """The process's agent pool for (image, limits, cpus); its size grows to the largest asked."""
    return _shared_pool(AgentPool, (image, limits, cpus, "agent"), image, limits, cpus, size, concurrency)


class IsolatedRun:
    """What `run_isolated` did: the command's result and which `report` paths existed after it."""

    __slots__ = ("result", "exists", "container", "clean")

    def __init__(self, result: ExecResult, exists: frozenset[str], container: str, clean: bool) -> None:
        self.result, self.exists, self.container, self.clean = result, exists, container, clean


def run_isolated(files: list[tuple[str, bytes]], *, argv: list[str] | None = None, python: str | None = None,
                 timeout: float = 30.0, limits: Limits | None = None, image: str | None = None,
                 cpus: float = 1.0, warm_pool: int | None = None, concurrency: int | None = None,
                 report: tuple[str, ...] = ()) -> IsolatedRun:
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
        _sandbox_path(path)
    size = warm_pool if warm_pool is not None else _env_int("RLBUS_SANDBOX_WARM_POOL", 2)
    pool = get_agent_pool(image or DEFAULT_IMAGE, limits, cpus, size, concurrency)
    req = {"op": "run", "files": [(str(p), bytes(d)) for p, d in files], "timeout": max(float(timeout), 0.001),
           "cap": limits.output_cap_bytes, "report": list(report),
           "limits": {"cpu": limits.cpu_seconds, "fsize": limits.file_size_mb * MIB, "nofile": limits.nofile}}
    if argv is not None:
        req["argv"] = [str(a) for a in argv]
    else:
        req["python"] = str(python)
    box = pool.acquire()
    try:
        box.stream.send(req)
        reply = _Reply(box.stream.recv(time.monotonic() + req["timeout"] + AGENT_GRACE_S))
    except (OSError, TimeoutError, ContainerUnusable) as exc:
        log.warning("sandbox.agent_failed", container=box.id[:12], error=str(exc),
                    agent_stderr=box.stream.diagnostics())
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
        exit_code=reply.code, stdout=decode_output(reply.stdout), stderr=decode_output(err),
        timed_out=bool(flags & _AGENT.TIMED_OUT), oom=oom,
        truncated=bool(flags & (_AGENT.TRUNC_OUT | _AGENT.TRUNC_ERR)),
        duration_ms=round(reply.duration * 1000, 3), isolation="docker")
    exists = frozenset(p for i, p in enumerate(report[:32]) if reply.exists >> i & 1)
    return IsolatedRun(result, exists, box.id, clean)


# -- the sandbox ------------------------------------------------------------------------

def _sandbox_path(path: str) -> tuple[str, str]:
    """(parent dir, name) of a path under /work, lexically normalized; ValueError outside."""
    parts = sandbox_path_parts(path)
    return posixpath.join(WORK_DIR, *parts[:-1]), parts[-1]


class DockerSandbox(Sandbox):
    """A sandbox backed by one container from the process's warm pool."""

    def __init__(self, warm_pool: int | None = None, concurrency: int | None = None,
                 cpus: float = 1.0) -> None:
        """warm_pool: containers kept ready (None: env RLBUS_SANDBOX_WARM_POOL, else 2);
        concurrency: sandboxes used at once by this process (sizes the HTTP pool);
        cpus: CPU quota per container."""
        self.warm_pool = warm_pool if warm_pool is not None else _env_int("RLBUS_SANDBOX_WARM_POOL", 2)
        self.concurrency = concurrency
        self.cpus = cpus
        self.id = uuid.uuid4().hex[:12]
        self.isolation = "docker"
        self.limits = Limits()
        self.default_timeout = 30.0
        self.image = DEFAULT_IMAGE
        self._pool: WarmPool | None = None
        self._box: _Box | None = None
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------
    def start(self, image: str | None = None, limits: Limits | None = None,
              timeout: float = 30.0) -> None:
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

    def _require(self) -> _Box:
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
            exit_code=rc, stdout=decode_output(out.getvalue()), stderr=decode_output(err.getvalue()),
            timed_out=timed_out, oom=oom, truncated=out.truncated or err.truncated,
            duration_ms=round(elapsed * 1000, 3), isolation="docker")

    def _start_exec(self, argv: list[str]) -> _Exec:
        """Start the wrapper exec; a container that cannot run one is replaced, once."""
        docker = _import_docker()
        try:
            return _Exec(self._pool.api, self._require().id, argv, user=RUN_USER)
        except docker.errors.APIError as exc:
            self._replace(f"exec failed: {exc}")
        return _Exec(self._pool.api, self._require().id, argv, user=RUN_USER)

    def _stop_stuck(self, ex: _Exec, out: HeadTailBuffer, hold: _StderrHold) -> bool:
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
            ex = _Exec(self._pool.api, self._box.id, ["/bin/sh", "-c", _SWEEP], user=RUN_USER)
        except Exception as exc:  # noqa: BLE001 - e.g. the pids limit is exhausted
            log.info("sandbox.sweep_failed", sandbox=self.id, error=str(exc))
            return False
        try:
            return ex.pump({}, time.monotonic() + KILL_GRACE_S) and ex.exit_code() == 0
        finally:
            ex.close()

    def processes(self) -> list[tuple[int, str]]:
        """(pid, command name) of every process in the container, the listing one excluded."""
        script = ('for p in /proc/[0-9]*; do [ "${p#/proc/}" = "$$" ] && continue; '
                  'c=?; read -r c < "$p/comm" 2>/dev/null; echo "${p#/proc/} $c"; done')
        out = self._run_simple(["/bin/sh", "-c", script], b"", 10.0)[1]
        return [(int(pid), name) for pid, name in (line.split(maxsplit=1) for line in out.decode().splitlines())]

    # -- files -----------------------------------------------------------------------
    def _run_simple(self, argv: list[str], stdin: bytes | None, timeout: float,
                    limit: int = 16 * MIB) -> tuple[int, bytes, bytes]:
        """Run a helper exec as the sandbox user: (exit code, stdout, stderr)."""
        with self._lock:
            box = self._require()
            ex = _Exec(self._pool.api, box.id, argv, user=RUN_USER, stdin=stdin is not None)
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
        parent, name = _sandbox_path(path)
        full = posixpath.join(parent, name)
        rc, data, err = self._run_simple(["/bin/sh", "-c", _READ_SCRIPT, "rlbus-read", full, str(MAX_READ_FILE)],
                                         None, 60.0, limit=MAX_READ_FILE)
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
                parent, name = _sandbox_path(path)
                info = tarfile.TarInfo(posixpath.relpath(posixpath.join(parent, name), WORK_DIR))
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                tar.addfile(info, io.BytesIO(bytes(data)))
        rc, _, err = self._run_simple(["/bin/sh", "-c", "cd /work && exec tar -x -f - --no-same-owner --unlink-first",
                                       "rlbus-untar"], buf.getvalue(), 60.0)
        _raise_file_error(rc, ",".join(p for p, _ in files), err)

    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file under /work (parents created; no symlinks followed)."""
        parent, name = _sandbox_path(path)
        rc, _, err = self._run_simple(["/bin/sh", "-c", _WRITE_SCRIPT, "rlbus-write", parent, name],
                                      bytes(data), 60.0)
        _raise_file_error(rc, path, err)


def _raise_file_error(rc: int, path: str, err: bytes) -> None:
    if rc == 0:
        return
    kind, code, what = _FILE_ERRORS.get(rc, (OSError, errno.EIO, f"failed (exit {rc})"))
    detail = err.decode(errors="replace").strip()
    raise kind(code, f"{what}: {path!r}" + (f" ({detail})" if detail else ""))
