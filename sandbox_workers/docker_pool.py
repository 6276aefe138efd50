"""The warm pool of sandbox containers shared by the docker backends: container settings,
exec over the engine's multiplexed socket, clean-up and the per-process pool registry.

Guarantees (the full list is in `sandbox_workers.docker_backend`'s docstring):

- `container_kwargs`: the isolation of every sandbox container (no network, read-only
  root, tmpfs /work and /tmp, no swap, pids/CPU/ulimits, every capability dropped,
  `no-new-privileges`, no logs), labelled with this process as owner.
- `WarmPool.acquire` hands out only containers that were never used or passed
  `clean_container` (`_CLEAN_SCRIPT`, then proven clean: only docker-init and `sleep`
  left, wiped dirs empty); one that fails the proof or was used `MAX_USES` times is
  removed. Pools refill in the background with `REFILL_WORKERS` threads.
- One pool per key per process (`get_pool`, `shared_pool`), registered with
  `docker_engine.register_pool` so the reaper spares its containers; `shutdown_pools()` (also
  run at exit) removes every container of every pool.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import posixpath
import select
import socket
import threading
import time
from typing import Any

from sandbox_workers.base import MIB, WORK_DIR, HeadTailBuffer, Limits, sandbox_path_parts
from sandbox_workers.docker_engine import (
    LABEL,
    OWNER,
    OWNER_LABEL,
    REFILL_WORKERS,
    get_client,
    import_docker,
    log,
    register_pool,
    remove_container,
    start_reaper,
    unregister_pools,
)
from sandbox_workers.repo_image import REPO_TAG

DEFAULT_IMAGE = "rlbus-sandbox:latest"
BUILD_HINT = "rlbus sandbox build-image"
RUN_USER = "65534:65534"
HOLDER_USER = "65532:65532"
PID_HEADROOM = 4  # docker-init, sleep, wrapper sh, timeout
INSPECT_WAIT_S = 2.0
MAX_USES = 100
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OOM_HINTS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")

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


class SandboxImageMissing(RuntimeError):
    """The sandbox image is not on the engine; the message says how to build it."""


class ContainerUnusable(RuntimeError):
    """A container could not be proven clean or could not run an exec."""


# -- exec over the multiplexed socket ---------------------------------------------------


class FrameReader:
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


class Exec(FrameReader):
    """One running exec: its id and hijacked socket, read frame by frame."""

    def __init__(
        self,
        api,
        cid: str,
        argv: list[str],
        *,
        user: str,
        stdin: bool = False,
        workdir: str = WORK_DIR,
        environment: dict[str, str] | None = None,
    ) -> None:
        self.api = api
        self.id = api.exec_create(cid, argv, user=user, workdir=workdir, stdin=stdin, environment=environment)["Id"]
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


# -- containers and the warm pool --------------------------------------------------------


class Box:
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
        "tmpfs": {
            WORK_DIR: f"{tmpfs_opts},exec,uid=65534,gid=65534,mode=0700",
            "/tmp": f"{tmpfs_opts},noexec,mode=1777",
        },
        "mem_limit": limits.memory_mb * MIB,
        "memswap_limit": limits.memory_mb * MIB,
        "pids_limit": limits.pids + PID_HEADROOM,
        "nano_cpus": int(cpus * 1e9),
        "ulimits": [
            Ulimit(name="nofile", soft=limits.nofile, hard=limits.nofile),
            Ulimit(name="fsize", soft=limits.file_size_mb * MIB, hard=limits.file_size_mb * MIB),
            Ulimit(name="cpu", soft=limits.cpu_seconds, hard=limits.cpu_seconds + 1),
            Ulimit(name="core", soft=0, hard=0),
        ],
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "log_config": LogConfig(type="none"),
    }
    return {
        "image": image,
        "command": ["sleep", "infinity"],
        "user": HOLDER_USER,
        "working_dir": WORK_DIR,
        "hostname": "sandbox",
        "network_disabled": True,
        "labels": {LABEL: "1", OWNER_LABEL: OWNER},
        "environment": {
            "PATH": SANDBOX_PATH,
            "HOME": WORK_DIR,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        },
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
        self.idle: collections.deque[Box] = collections.deque()
        self.boxes: dict[str, Box] = {}
        self.pending = 0  # creations and cleanings in flight that may end in `idle`
        self.waiting = 0  # acquire() calls waiting for one of those
        self.broken: str | None = None  # why background creation stopped (e.g. no image)
        self.cond = threading.Condition()
        self.closed = False
        self.workers = concurrent.futures.ThreadPoolExecutor(REFILL_WORKERS, thread_name_prefix="rlbus-sbx-pool")

    # -- creating and removing --------------------------------------------------------
    def create(self) -> Box:
        """A new started container (blocking); SandboxImageMissing if the image is absent.

        The container is tracked in `boxes` from its creation on; if starting it fails, it is
        removed before the error propagates."""
        docker = import_docker()
        kwargs = self._container_kwargs()
        kwargs["host_config"] = self.api.create_host_config(**kwargs["host_config"])
        try:
            cid = self.api.create_container(**kwargs)["Id"]
        except docker.errors.ImageNotFound:
            raise SandboxImageMissing(missing_image_message(self.image)) from None
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

    def _new_box(self, cid: str) -> Box:
        return Box(cid)

    def _start(self, box: Box) -> None:
        self.api.start(box.id)

    def remove(self, box: Box) -> None:
        with self.cond:
            self.boxes.pop(box.id, None)
        remove_container(self.client, box.id)

    # -- hand-out and return ----------------------------------------------------------
    def acquire(self) -> Box:
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

    def release(self, box: Box) -> None:
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

    def kill(self, box: Box) -> None:
        """Kill a container now (its processes could not be stopped); remove it in the background."""
        try:
            self.api.kill(box.id)
        except Exception:  # noqa: BLE001 - the forced removal below kills it anyway
            pass
        self._submit(self.remove, box)

    def _submit(self, fn, box: Box) -> None:
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

    def _recycle(self, box: Box) -> None:
        try:
            clean_container(self.api, box.id)
        except Exception as exc:  # noqa: BLE001 - an unclean container is never reused
            log.info("sandbox.recycle_failed", container=box.id[:12], error=str(exc))
            self.remove(box)
            box = None
        self._settle(box)

    def _settle(self, box: Box | None) -> None:
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
    ex = Exec(api, cid, ["/bin/sh", "-c", _CLEAN_SCRIPT, "rlbus-clean"], user=RUN_USER)
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


def missing_image_message(image: str) -> str:
    """The error for an engine that lacks `image`, naming the command that builds it: the plain
    image (`DEFAULT_IMAGE`) `rlbus sandbox build-image`, the repository-task image
    (`repo_image.REPO_TAG`) `rlbus sandbox build-image --repo`, any other tag `--tag <image>`."""
    if image == DEFAULT_IMAGE:
        command = BUILD_HINT
    elif image == REPO_TAG:
        command = f"{BUILD_HINT} --repo"
    else:
        command = f"{BUILD_HINT} --tag {image} (add --repo for a repository-task image)"
    return f"sandbox image {image!r} is not on this Docker engine; build it with: {command}"


def get_pool(image: str, limits: Limits, cpus: float, size: int, concurrency: int | None) -> WarmPool:
    """The process's pool for (image, limits, cpus); its size grows to the largest asked."""
    return shared_pool(WarmPool, (image, limits, cpus), image, limits, cpus, size, concurrency)


def shared_pool(cls, key: tuple, image: str, limits: Limits, cpus: float, size: int, concurrency: int | None):
    """The process's open `cls` pool under `key` (a new one if none is open), registered with
    `docker_engine.register_pool` and its size raised to at least `size`; the reaper runs once
    any pool exists."""
    client = get_client(concurrency)
    pool = register_pool(key, lambda: cls(client, image, limits, cpus, size), size)
    start_reaper(client)
    return pool


def shutdown_pools() -> None:
    """Remove every container of every pool of this process (also run at exit)."""
    for pool in unregister_pools():
        pool.shutdown()


atexit.register(shutdown_pools)


def sandbox_path(path: str) -> tuple[str, str]:
    """(parent dir, name) of a path under /work, lexically normalized; ValueError outside."""
    parts = sandbox_path_parts(path)
    return posixpath.join(WORK_DIR, *parts[:-1]), parts[-1]
