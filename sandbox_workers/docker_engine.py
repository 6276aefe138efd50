"""Docker engine plumbing shared by the docker backends: the process's client, container
ownership labels, and the reaper.

Guarantees:

- One `DockerClient` per process (`get_client`); its HTTP connection pool
  (`max_pool_size`) is sized to the largest `concurrency` asked for (argument, else env
  `RLBUS_SANDBOX_CONCURRENCY`, else 8) plus the refill threads, so concurrent sandboxes
  never queue on, or throw away, connections. The SDK is imported lazily: this module
  imports without an engine or the `docker` package.
- Every sandbox container is labelled `LABEL=1` with its owner
  (`OWNER_LABEL=<host>:<pid>:<start time>`, this process: `OWNER`). `reap()` removes, in
  any state, labelled containers whose owner process is gone, and this process's
  containers that no registered pool tracks (older than `REAP_MIN_AGE_S`);
  `reap(all_owners=True)` removes them all. `start_reaper` reaps once, then every
  `REAP_INTERVAL_S` in one daemon thread per process.
- The registry of this process's pools (`register_pool`, `unregister_pools`, one lock)
  lives here so the reaper can spare their containers without importing the pool code.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:  # the SDK is imported lazily: this module imports without an engine
    import docker

    from sandbox_workers.docker_pool import WarmPool

log = structlog.get_logger()

LABEL = "rlbus.sandbox"
OWNER_LABEL = "rlbus.sandbox.owner"
REFILL_WORKERS = 2
REAP_INTERVAL_S = 60.0
REAP_MIN_AGE_S = 60.0
DEFAULT_CONCURRENCY = 8

# -- the client ---------------------------------------------------------------------

_client_lock = threading.Lock()
_client: docker.DockerClient | None = None
_client_pool_size = 0


def import_docker():
    """The `docker` SDK module (imported on first use); RuntimeError naming the package if absent."""
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
            docker = import_docker()
            try:
                client = docker.from_env(max_pool_size=want, timeout=60)
                client.ping()
            except Exception as exc:
                raise RuntimeError(
                    f"no Docker engine answers ({exc}); start one, set DOCKER_HOST, "
                    "or use the process backend (--backend process)"
                ) from exc
            _client, _client_pool_size = client, want
        return _client


def env_int(name: str, default: int) -> int:
    """Env `name` as an integer >= 0 (`default` when unset or blank); ValueError if not an integer."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _concurrency(value: int | None) -> int:
    return max(1, value if value is not None else env_int("RLBUS_SANDBOX_CONCURRENCY", DEFAULT_CONCURRENCY))


# -- owners and the reaper ------------------------------------------------------------


def process_start_time(pid: int) -> str | None:
    """The start time (clock ticks since boot, field 22 of /proc/<pid>/stat) of `pid`; None if gone.
    With the pid it identifies a process across pid reuse (the owner label)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


OWNER = f"{socket.gethostname()}:{os.getpid()}:{process_start_time(os.getpid())}"


def _owner_alive(owner: str | None) -> bool | None:
    """True/False for an owner on this host; None when it lives elsewhere (unknown)."""
    if not owner or owner.count(":") != 2:
        return False
    host, pid, start = owner.split(":")
    if host != socket.gethostname():
        return None
    return pid.isdigit() and process_start_time(int(pid)) == start


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
        if remove_container(client, c["Id"]):
            removed.append(c["Id"])
    if removed:
        log.info("sandbox.reaped", count=len(removed), all_owners=all_owners)
    return removed


def remove_container(client, cid: str) -> bool:
    """Force-remove container `cid` with its volumes; True if this call removed it. Never raises
    for a container that is gone or already being removed (other engine errors are logged)."""
    docker = import_docker()
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


def start_reaper(client) -> None:
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


# -- the registry of this process's pools (read by the reaper) --------------------------

_pools: dict[tuple, WarmPool] = {}
_pools_lock = threading.Lock()


def register_pool(key: tuple, make: Callable[[], WarmPool], size: int) -> WarmPool:
    """The open pool registered under `key`, its size raised to at least `size`; when none is
    open, `make()` (called under the registry's lock) is registered and returned."""
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = make()
        else:
            with pool.cond:
                pool.size = max(pool.size, size)
    return pool


def unregister_pool(key: tuple) -> WarmPool | None:
    """The pool registered under `key`, removed from the registry (the caller shuts it down)."""
    with _pools_lock:
        return _pools.pop(key, None)


def unregister_pools() -> list[WarmPool]:
    """Every registered pool, each removed from the registry (the caller shuts them down)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    return pools


def _tracked_ids() -> set[str]:
    with _pools_lock:
        pools = list(_pools.values())
    ids: set[str] = set()
    for pool in pools:
        with pool.cond:
            ids.update(pool.boxes)
    return ids
