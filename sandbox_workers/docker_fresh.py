"""Fresh, single-use containers for verifiers that need two uids: `run_fresh` (the `repo` verifier).

Guarantees:
- Every run gets a container that never ran anything (`FreshPool` keeps `warm` started,
  unused ones ready; a used container is always removed, never cleaned and reused).
- Same isolation as the `DockerSandbox` containers (`docker_pool.container_kwargs`: no
  network, read-only root, no swap, pids/CPU/ulimits, `no-new-privileges`, no logs,
  labelled for the reaper), except: only SETUID, SETGID and KILL are added back to the
  capability set, and `/work` is a tmpfs owned by uid 0 (mode 0755), so the program the
  exec starts as uid 0 may build a tree there that its uid-65534 children can read but
  never write. The holder process (`sleep infinity`) runs as uid 0 too (the engine gives
  an exec the added capabilities only then); uid-65534 processes cannot signal it.
- `run_fresh(program_argv, stdin, read_back, ...)` runs ONE exec as uid 0 with `stdin` on its
  standard input, waits for it (at most `timeout`), then reads the file `read_back` with
  a second exec and returns `FreshRun(exit_code, stdout, stderr, file, timed_out)`;
  `file` is None when it does not exist. The container is removed afterwards, whatever
  happened.
- Failures of the engine or the container (cannot create, exec broken, deadline passed)
  raise `ContainerUnusable` / `SandboxImageMissing`; they are infrastructure, the caller
  never turns them into a result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sandbox_workers.base import WORK_DIR, HeadTailBuffer, Limits
from sandbox_workers.docker_pool import ContainerUnusable, Exec, WarmPool, container_kwargs, shared_pool

FRESH_LABEL = "rlbus.sandbox.fresh"
FRESH_CAPS = ["SETUID", "SETGID", "KILL"]
ROOT_USER = "0:0"
FRESH_PID_HEADROOM = 4  # docker-init, sleep, the supervisor, the read-back exec


@dataclass
class FreshRun:
    exit_code: int | None
    stdout: str
    stderr: str
    file: bytes | None
    timed_out: bool


def fresh_container_kwargs(image: str, limits: Limits, cpus: float) -> dict:
    """`container_kwargs` with SETUID/SETGID/KILL added and a root-owned /work (see the guarantees)."""
    kw = container_kwargs(image, limits, cpus)
    hc = kw["host_config"]
    hc["cap_add"] = list(FRESH_CAPS)
    hc["tmpfs"][WORK_DIR] = f"rw,nosuid,nodev,size={max(limits.tmp_mb, 64)}m,exec,uid=0,gid=0,mode=0755"
    hc["pids_limit"] = limits.pids + FRESH_PID_HEADROOM
    kw["labels"] = {**kw["labels"], FRESH_LABEL: "1"}
    kw["user"] = ROOT_USER  # the engine grants an exec the added capabilities only when the container's user is 0
    return kw


class FreshPool(WarmPool):
    """Started, never-used containers; a returned one is removed (in the background)."""

    def _container_kwargs(self) -> dict:
        return fresh_container_kwargs(self.image, self.limits, self.cpus)

    def release(self, box) -> None:  # type: ignore[override]
        if self.closed or self.size == 0:
            self.remove(box)
        else:
            self._submit(self.remove, box)


def get_fresh_pool(
    image: str, limits: Limits, cpus: float = 1.0, warm: int = 1, concurrency: int | None = None
) -> FreshPool:
    """The process's fresh pool for (image, limits, cpus)."""
    return shared_pool(FreshPool, ("fresh", image, limits, cpus), image, limits, cpus, warm, concurrency)


def _exec(
    pool: FreshPool, cid: str, argv: list[str], stdin: bytes | None, deadline: float, cap: int
) -> tuple[int | None, bytes, bytes, bool]:
    ex = Exec(pool.api, cid, argv, user=ROOT_USER, stdin=stdin is not None)
    out, err = HeadTailBuffer(cap), HeadTailBuffer(64 * 1024)
    try:
        if stdin is not None:
            ex.send_stdin(stdin)
        finished = ex.pump({1: out, 2: err}, deadline)
        code = ex.exit_code() if finished else None
    finally:
        ex.close()
    return code, out.getvalue(), err.getvalue(), not finished


def run_fresh(
    argv: list[str],
    stdin: bytes,
    read_back: str,
    *,
    image: str,
    limits: Limits,
    timeout: float,
    cpus: float = 1.0,
    warm: int = 1,
) -> FreshRun:
    """Run `argv` as uid 0 in a fresh container, then read `read_back` (see the module guarantees)."""
    pool = get_fresh_pool(image, limits, cpus, warm)
    box = pool.acquire()
    try:
        code, out, err, timed_out = _exec(pool, box.id, argv, stdin, time.monotonic() + timeout, 1 << 20)
        if timed_out:
            raise ContainerUnusable(f"the verifier's program ran past {timeout:.0f} s")
        rc, data, rerr, late = _exec(
            pool,
            box.id,
            ["/bin/sh", "-c", f"[ -f {read_back} ] || exit 3; exec cat {read_back}"],
            None,
            time.monotonic() + 30,
            8 << 20,
        )
        if late or rc not in (0, 3):
            raise ContainerUnusable(f"reading {read_back} back failed (exit {rc}): {rerr[-300:]!r}")
        return FreshRun(
            code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), data if rc == 0 else None, timed_out
        )
    finally:
        pool.release(box)
