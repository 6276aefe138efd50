"""Learner ranks started from outside (`learner.launch = "external"`): one rank per process, as
Kubernetes StatefulSet pods or srun tasks start them, possibly on different machines.

Every rank runs the same `rlbus worker learner`; this module tells it which rank it is and joins
it to the others. Rank 0 does what it does in spawn mode (`learner.ranks.RankGroup`: the bus,
the steps' batches, weight publishing, checkpoints); ranks 1..N-1 never touch the bus: they
serve rank 0's broadcast commands (`learner.ranks.serve`) in the same FSDP2 steps.

Guarantees:
- `resolve` reads torch's env:// variables: MASTER_ADDR and MASTER_PORT (rank 0's host and the
  port it listens on), RANK (else SLURM_PROCID, else the ordinal `-N` ending the host name, as a
  StatefulSet pod's `<sts>-N`), WORLD_SIZE (optional; must equal `learner.world_size`) and
  LOCAL_RANK (else SLURM_LOCALID, else 0: the CUDA device). Anything missing or malformed is a
  `RendezvousError` that names every variable to set, before any socket opens.
- `join` is the rendezvous: rank 0 opens a `torch.distributed.TCPStore` on MASTER_PORT; every
  rank registers under its rank number and waits until all `world_size` ranks registered (at
  most `learner.rendezvous_timeout_s`), then the process group forms over that store. A rank
  that is not there in time, a rank number taken twice, or a rank 0 that cannot be reached
  is a `RendezvousError` saying which ranks are missing and what to check; no rank hangs.
- Every rank builds its trainer from rank 0's learner section (broadcast once joined), so the
  shards, optimizer and reference agree even where a rank's own config file differs.
- A follower rank exits 0 after rank 0's `stop`, and with `learner.ranks.RANK_DIED_EXIT` (logged
  as `learner.rank_died`) when a collective fails (rank 0 died, or hung past
  `learner.dist_timeout_s`); its orchestrator restarts it, and it joins the restarted rank 0
  (which resumes from the last checkpoint). Rank 0 likewise exits when a rank is lost
  (`learner.ranks.RankGroup.peer_lost`).
- A follower serves `/metrics` (counters `rank`, `commands`, `steps`) where the run serves them
  (`run.metrics_port` / RLBUS_METRICS_PORT), so a pod's readiness probe and scrape work on
  every rank.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import structlog

log = structlog.get_logger()
_ORDINAL = re.compile(r"-(\d+)$")
ARRIVED = "rlbus/rendezvous/rank/"
"""Store key prefix: every rank adds 1 to ARRIVED + its rank on arrival (2 = a rank number taken twice)."""


class RendezvousError(RuntimeError):
    """A rank cannot find or join the others (the message says what to set or check)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where this rank stands: its rank, the world, rank 0's address, its local device index."""

    rank: int
    world: int
    addr: str
    port: int
    local_rank: int = 0
    rank_from: str = "RANK"
    """Where the rank came from: RANK, SLURM_PROCID or the host name (logged)."""


def _int(env, name: str, problems: list[str], what: str) -> int | None:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        problems.append(f"{name}={raw!r} is not an integer ({what})")
        return None


def _rank(env, hostname: str, problems: list[str]) -> tuple[int | None, str]:
    for name in ("RANK", "SLURM_PROCID"):
        value = _int(env, name, problems, "this process's rank, 0..world_size-1")
        if value is not None:
            return value, name
    match = _ORDINAL.search(hostname)
    if match:
        return int(match.group(1)), f"host name {hostname}"
    problems.append(
        f"RANK is not set and the host name {hostname!r} does not end in a StatefulSet ordinal '-N': "
        "set RANK (0..world_size-1; rank 0 is the one that talks to the bus)"
    )
    return None, ""


def resolve(lc, env=None, hostname: str | None = None) -> Rendezvous:
    """This rank's `Rendezvous` from the environment (see the module guarantees)."""
    env = os.environ if env is None else env
    hostname = hostname if hostname is not None else socket.gethostname()
    problems: list[str] = []
    addr = (env.get("MASTER_ADDR") or "").strip()
    if not addr:
        problems.append(
            "MASTER_ADDR is not set: set it to rank 0's host name or IP (Kubernetes: <statefulset>-0.<headless service>)"
        )
    port = _int(env, "MASTER_PORT", problems, "the TCP port rank 0 listens on")
    if port is None and not any(p.startswith("MASTER_PORT") for p in problems):
        problems.append("MASTER_PORT is not set: set it to a free TCP port on rank 0 (e.g. 29500)")
    elif port is not None and not 1 <= port <= 65535:
        problems.append(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    rank, rank_from = _rank(env, hostname, problems)
    world = _int(env, "WORLD_SIZE", problems, "the number of learner ranks")
    if world is not None and world != lc.world_size:
        problems.append(
            f"WORLD_SIZE={world} but learner.world_size = {lc.world_size}: set both to the number of ranks started"
        )
    if rank is not None and not 0 <= rank < lc.world_size:
        problems.append(
            f"rank {rank} (from {rank_from}) is outside 0..{lc.world_size - 1} (learner.world_size = {lc.world_size})"
        )
    local = _int(env, "LOCAL_RANK", problems, "this process's device index")
    if local is None:
        local = _int(env, "SLURM_LOCALID", problems, "this process's device index")
    if problems:
        raise RendezvousError(
            "learner.launch = 'external' (one rank per process, torch env:// rendezvous): " + "; ".join(problems)
        )
    return Rendezvous(rank, lc.world_size, addr, port, local or 0, rank_from)


LAUNCH_ENV = "RLBUS_LEARNER_LAUNCH"
"""Set to `external` in a per-rank learner pod (the k8s render): `health learner` then checks a rank > 0
by its `/metrics` (it has no bus heartbeat)."""


def follower_rank(env=None, hostname: str | None = None) -> int | None:
    """This container's rank when it is rank 1..N-1 of an external launch (env `RLBUS_LEARNER_LAUNCH` =
    `external`; the rank as `resolve` reads it), else None (rank 0, or not an external launch)."""
    env = os.environ if env is None else env
    if env.get(LAUNCH_ENV) != "external":
        return None
    rank, _ = _rank(env, hostname if hostname is not None else socket.gethostname(), [])
    return rank or None


def metrics_answer(port: int, timeout: float = 5.0) -> str | None:
    """Why this container's `/metrics` on `port` does not answer 200, or None when it does."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
            return None if resp.status == 200 else f"/metrics answered {resp.status}"
    except OSError as exc:
        return f"/metrics on port {port} does not answer: {exc}"


def _registered(store, world: int) -> list[int]:
    return [r for r in range(world) if store.check([f"{ARRIVED}{r}"])]


def _open_store(rv: Rendezvous, timeout_s: float):
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            rv.addr,
            rv.port,
            rv.world,
            is_master=rv.rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        where = f"listen on port {rv.port}" if rv.rank == 0 else f"reach rank 0 at {rv.addr}:{rv.port}"
        raise RendezvousError(
            f"learner rank {rv.rank}: could not {where} within {timeout_s:g} s "
            f"(learner.rendezvous_timeout_s): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. "
            "Check that rank 0 is running, MASTER_ADDR resolves to it and MASTER_PORT is free there and reachable"
        ) from exc


def wait_for_ranks(store, rv: Rendezvous, timeout_s: float, poll_s: float = 0.2) -> None:
    """Register this rank and wait until every rank did (see the module guarantees)."""
    if store.add(f"{ARRIVED}{rv.rank}", 1) > 1:
        raise RendezvousError(
            f"learner rank {rv.rank} joined twice: two processes claim rank {rv.rank} (check RANK / the pod "
            "ordinals: every rank 0..world_size-1 exactly once), or this rank restarted while rank 0 still runs "
            "the group it left (rank 0 exits at its next collective, within learner.dist_timeout_s; then the "
            "ranks meet again)"
        )
    deadline = time.monotonic() + timeout_s
    while True:
        here = _registered(store, rv.world)
        if len(here) == rv.world:
            return
        if time.monotonic() >= deadline:
            missing = sorted(set(range(rv.world)) - set(here))
            raise RendezvousError(
                f"learner rank {rv.rank}: only ranks {here} of {rv.world} joined at {rv.addr}:{rv.port} within "
                f"{timeout_s:g} s (learner.rendezvous_timeout_s); missing ranks {missing}: start them with "
                "MASTER_ADDR/MASTER_PORT pointing here, or raise learner.rendezvous_timeout_s"
            )
        time.sleep(poll_s)


def join(rv: Rendezvous, lc, backend: str):
    """Rendezvous with every rank and form the learner's process group (every rank calls it);
    returns rank 0's learner section, which every rank builds its trainer from (a follower
    whose own config differs logs `learner.section_differs` and follows rank 0)."""
    import torch
    import torch.distributed as dist

    from learner.ranks import join_group
    from schemas.config import LearnerSection

    if backend == "nccl":
        torch.cuda.set_device(rv.local_rank)  # before the first collective (NCCL uses the current device)
    store = _open_store(rv, lc.rendezvous_timeout_s)
    wait_for_ranks(store, rv, lc.rendezvous_timeout_s)
    join_group(store, rv.rank, rv.world, backend, lc.dist_timeout_s)
    box = [lc.model_dump_json() if rv.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    rank0 = LearnerSection.model_validate_json(box[0])
    if rank0 != lc:
        log.warning(
            "learner.section_differs",
            rank=rv.rank,
            why="this rank's learner config differs from rank 0's; using rank 0's",
        )
    log.info("learner.rendezvous", rank=rv.rank, world=rv.world, master=f"{rv.addr}:{rv.port}", rank_from=rv.rank_from)
    return rank0


def run_follower(cfg, model_path: Path, rv: Rendezvous) -> int:
    """Rank 1..N-1 of an external launch: join, build this rank's shard, serve rank 0 until `stop`."""
    from bus.telemetry import start_metrics_server
    from learner.distributed import resolve_backend
    from learner.ranks import RANK_DIED_EXIT, _leave, serve
    from learner.sharded import RankTrainer

    lc = cfg.learner
    counters: dict[str, float] = {"rank": float(rv.rank), "commands": 0.0, "steps": 0.0}
    start_metrics_server("learner", counters, cfg.run.metrics_port, worker=f"learner-rank{rv.rank}-{os.getpid()}")
    backend = resolve_backend(lc.backend)
    lc = join(rv, lc, backend)
    trainer = RankTrainer(lc, Path(model_path), rv.rank, rv.world, backend, local_rank=rv.local_rank)
    try:
        serve(trainer, counters)
    except RuntimeError as exc:  # torch's DistBackendError / DistNetworkError: rank 0 (or another rank) left
        log.error(
            "learner.rank_died",
            rank=rv.rank,
            error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            why="a collective with the other ranks failed: exiting so every rank restarts and meets again",
        )
        raise SystemExit(RANK_DIED_EXIT) from None
    _leave()
    log.info("learner.rank_stopped", rank=rv.rank, commands=int(counters["commands"]))
    return 0
