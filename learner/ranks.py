"""N learner ranks from one `rlbus worker learner`: this process is rank 0, ranks 1..N-1
are its children (`python -m learner.ranks --rank R ...`).

Rank 0 alone talks to the bus; it drives the others through commands it broadcasts
(`broadcast_object_list`): `step` (the packed batch, the learner section, the loss
scale), `gather` (full weights to rank 0 for publishing), `save` / `load` (DCP
checkpoints), `ping` (while idle, so a waiting rank's collective never times out) and
`stop`. Every command is a collective that every rank runs in the same order.

Guarantees:
- The process group rendezvouses through a TCPStore that rank 0 opens on a free port
  before it starts the children (no port race); collectives time out after
  `learner.dist_timeout_s`, and rank 0 pings at least every third of it while idle.
- A rank that dies takes the others down, with no hang and no orphan: rank 0 watches its
  children (every 0.2 s) and, when one exits unasked, kills the rest and exits with
  `RANK_DIED_EXIT` (the launcher restarts the learner, which resumes from its last
  checkpoint); a child dies with rank 0 (PR_SET_PDEATHSIG on Linux, and it checks its
  parent every second) or when a collective fails.
- The ranks' pids are in `<run>/learner_ranks.json` while they run.
- All of rank 0's collectives run on one dedicated thread, in submission order.
- `learner.launch = "external"` (`rendezvous`): the same commands, but no rank is a child of
  rank 0: every rank is started from outside (pods, srun tasks) and they rendezvous at
  MASTER_ADDR:MASTER_PORT (`learner.rendezvous.join`); rank 0 starts no process and watches
  none (a follower's death fails rank 0's next collective, which ends rank 0; its
  orchestrator restarts it). `learner_ranks.json` then lists rank 0 only, with `launch`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import structlog

log = structlog.get_logger()
RANK_DIED_EXIT = 70
"""Exit status of rank 0 (the learner worker) when another rank died."""
RANKS_FILE = "learner_ranks.json"


def _store(host: str, port: int, world: int, is_master: bool, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(
        host, port, world, is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_group(store, rank: int, world: int, backend: str, timeout_s: float) -> None:
    """Join the learner's process group (a collective of all ranks)."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


class RankGroup:
    """Rank 0's handle on the learner's ranks: start them, send them commands, stop them."""

    def __init__(self, lc, model_path: Path, run_path: Path, *, exit_on_rank_death: bool = True, rendezvous=None):
        from learner.distributed import resolve_backend

        self.rendezvous = rendezvous  # learner.rendezvous.Rendezvous of rank 0 (external launch), else None

        self.lc, self.model_path, self.run_path = lc, Path(model_path), Path(run_path)
        self.world, self.backend = lc.world_size, resolve_backend(lc.backend)
        self.exit_on_rank_death = exit_on_rank_death
        self.children: dict[int, subprocess.Popen] = {}
        self.trainer = None
        self.closing = False
        self.dead: str | None = None  # why a rank died (with exit_on_rank_death False)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-rank0")
        self.last_command = time.monotonic()
        self.ping_every = min(10.0, lc.dist_timeout_s / 3)
        self._keepalive: asyncio.Task | None = None

    @property
    def pad_id(self) -> int:
        return self.trainer.pad_id

    def spawn(self) -> None:
        """Open the rendezvous store and start ranks 1..N-1 (call from the main thread:
        a child's death signal follows the thread that started it)."""
        self.store = _store("127.0.0.1", 0, self.world, True, self.lc.dist_timeout_s)
        for rank in range(1, self.world):
            cmd = [
                sys.executable,
                "-m",
                "learner.ranks",
                "--rank",
                str(rank),
                "--world",
                str(self.world),
                "--port",
                str(self.store.port),
                "--backend",
                self.backend,
                "--model",
                str(self.model_path),
                "--parent",
                str(os.getpid()),
                "--run-path",
                str(self.run_path),
            ]
            env = dict(os.environ, RLBUS_LEARNER_SECTION=self.lc.model_dump_json())
            self.children[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self.write_pids()
        threading.Thread(target=self.watch, name="learner-rank-watch", daemon=True).start()

    def write_pids(self) -> None:
        """`<run>/learner_ranks.json`: rank -> pid (how tests and operators find a rank)."""
        pids = {"0": os.getpid(), **{str(r): p.pid for r, p in self.children.items()}}
        launch = "external" if self.rendezvous else "spawn"
        self.run_path.mkdir(parents=True, exist_ok=True)
        tmp = self.run_path / f"{RANKS_FILE}.tmp"
        tmp.write_text(json.dumps({"world_size": self.world, "backend": self.backend, "launch": launch, "pids": pids}))
        os.replace(tmp, self.run_path / RANKS_FILE)

    def watch(self) -> None:
        """Until closing: when a child exits unasked, kill the others and (by default) exit."""
        while not self.closing:
            for rank, proc in self.children.items():
                if proc.poll() is not None and not self.closing:
                    self.rank_died(rank, proc)
                    return
            time.sleep(0.2)

    def rank_died(self, rank: int, proc: subprocess.Popen) -> None:
        self.dead = f"learner rank {rank} (pid {proc.pid}) exited with {proc.returncode}"
        log.error(
            "learner.rank_died",
            rank=rank,
            pid=proc.pid,
            code=proc.returncode,
            why="a rank died: stopping every rank; the learner restarts from its last checkpoint",
        )
        self.kill_children()
        if self.exit_on_rank_death:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RANK_DIED_EXIT)

    def kill_children(self) -> None:
        for proc in self.children.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.children.values():
            proc.wait()

    async def call(self, fn, *args):
        """Run `fn(*args)` on the rank-0 collective thread."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.last_command = time.monotonic()

    def command(self, name: str, payload=None) -> None:
        """Broadcast one command to ranks 1..N-1 (rank-0 thread)."""
        import torch.distributed as dist

        dist.broadcast_object_list([(name, payload)], src=0)

    # ------------------------------------------------------------------ rank-0 API

    async def start(self) -> None:
        """Start every rank (external launch: wait for them) and build rank 0's shard (returns
        once the group is up)."""
        if self.rendezvous:
            self.write_pids()
        else:
            self.spawn()
        await self.call(self._join)
        self._keepalive = asyncio.create_task(self.keepalive())
        log.info(
            "learner.ranks_started",
            world_size=self.world,
            backend=self.backend,
            pids={r: p.pid for r, p in self.children.items()},
        )

    def _join(self) -> None:
        from learner.sharded import RankTrainer

        if self.rendezvous:
            from learner.rendezvous import join

            join(self.rendezvous, self.lc, self.backend)
            local = self.rendezvous.local_rank
        else:
            join_group(self.store, 0, self.world, self.backend, self.lc.dist_timeout_s)
            local = None
        self.trainer = RankTrainer(self.lc, self.model_path, 0, self.world, self.backend, local_rank=local)

    async def keepalive(self) -> None:
        """Ping the ranks whenever no command went out for `ping_every` seconds. External launch:
        a failed ping is a lost rank (`peer_lost`); spawn mode's watcher sees a dead child first."""
        while not self.closing:
            await asyncio.sleep(1.0)
            if time.monotonic() - self.last_command >= self.ping_every and not self.closing:
                try:
                    await self.call(self.command, "ping")
                except Exception as exc:
                    if self.closing or not self.rendezvous:
                        raise
                    self.peer_lost(exc)
                    return

    def peer_lost(self, exc: BaseException) -> None:
        """External launch: a collective with the other ranks failed (one died or hung): log it and
        (by default) exit with `RANK_DIED_EXIT`, so every rank restarts and meets again at a fresh
        rendezvous (a restarted rank cannot join this group: its rank number is taken here)."""
        self.dead = f"a learner rank left the group: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        log.error(
            "learner.rank_died",
            error=self.dead,
            why="a rank died: stopping this rank 0; the ranks meet again and resume from the last checkpoint",
        )
        if self.exit_on_rank_death:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RANK_DIED_EXIT)

    async def step(self, batch: dict, lc, loss_scale: float = 1.0) -> dict[str, float]:
        """One sharded update on the packed `batch`; the step's metrics."""

        def run():
            self.command("step", (batch, lc, loss_scale))
            return self.trainer.step(batch, lc, loss_scale)

        return await self.call(run)

    async def train(self, samples: list, lc, loss_scale: float = 1.0) -> dict[str, float]:
        """`learner.step.train_step` across the ranks: pack the pooled samples, step."""
        from learner.batch import pack_samples

        return await self.step(pack_samples([s.reward for s in samples], self.pad_id), lc, loss_scale)

    async def full_state(self) -> dict:
        """Full weights on rank 0's CPU (for `learner.weights.publish_version`)."""

        def run():
            self.command("gather")
            return self.trainer.full_state()

        return await self.call(run)

    async def save(self, root: Path, state: dict) -> None:
        """A DCP checkpoint of every rank under `root`, made LATEST once complete."""
        name = f"step{int(state.get('step', 0)):08d}-{uuid.uuid4().hex[:8]}"

        def run():
            self.command("save", (str(root), name, state))
            self.trainer.save(Path(root), name, state)

        await self.call(run)

    async def load(self, root: Path) -> dict | None:
        """Restore LATEST under `root` on every rank; its state, or None without one."""
        from learner.checkpoint import latest_dcp

        path = latest_dcp(root)
        if path is None:
            return None

        def run():
            self.command("load", str(path))
            return self.trainer.load(path)

        return await self.call(run)

    async def close(self) -> None:
        """Stop every rank cleanly (they leave the group and exit), then this one."""
        self.closing = True  # first: the watcher must not take the children's exit for a death
        if self._keepalive:
            self._keepalive.cancel()  # a ping it already queued runs before `stop` (one thread, FIFO)
        if self.trainer is not None and self.dead is None:
            await self.call(self.command, "stop")
        for proc in self.children.values():
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
        await self.call(_leave)
        self.pool.shutdown()
        (self.run_path / RANKS_FILE).unlink(missing_ok=True)

    def abort(self) -> None:
        """Kill every child now (error paths: a failed collective when a rank died lands
        here, logged as `learner.rank_died`); safe to call twice."""
        if not self.closing:
            for rank, proc in self.children.items():
                if _exit_code(proc) is not None and self.dead is None:
                    self.dead = f"learner rank {rank} (pid {proc.pid}) exited with {proc.returncode}"
                    log.error(
                        "learner.rank_died",
                        rank=rank,
                        pid=proc.pid,
                        code=proc.returncode,
                        why="a rank died: stopping every rank; the learner restarts from its last checkpoint",
                    )
        self.closing = True
        self.kill_children()
        (self.run_path / RANKS_FILE).unlink(missing_ok=True)


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The child's exit code, or None while it runs. `poll()` alone answers None while another
    thread (the watcher) holds the Popen's wait lock, which hid a killed rank from `abort`."""
    code = proc.poll()
    if code is None:
        try:
            code = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return None
    return code


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ ranks 1..N-1


def die_with_parent(parent: int) -> None:
    """Exit when rank 0 is gone: PR_SET_PDEATHSIG where Linux has it, and a watcher thread."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(RANK_DIED_EXIT)
            time.sleep(1.0)

    if os.getppid() != parent:
        os._exit(RANK_DIED_EXIT)
    threading.Thread(target=watch, daemon=True).start()


def serve(trainer, counters: dict | None = None) -> None:
    """Run rank 0's commands until `stop` (a failing collective raises: the rank exits);
    `counters` (optional) counts `commands` and `steps`."""
    import torch.distributed as dist

    counters = {} if counters is None else counters
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        name, payload = box[0]
        counters["commands"] = counters.get("commands", 0) + 1
        counters["steps"] = counters.get("steps", 0) + (name == "step")
        if name == "stop":
            return
        if name == "step":
            trainer.step(*payload)
        elif name == "gather":
            trainer.full_state()
        elif name == "save":
            root, ckpt, state = payload
            trainer.save(Path(root), ckpt, state)
        elif name == "load":
            trainer.load(Path(payload))
        elif name != "ping":
            raise RuntimeError(f"learner rank: unknown command {name!r}")


def follower_main(argv: list[str] | None = None) -> int:
    """Entry of ranks 1..N-1 (`python -m learner.ranks`)."""
    p = argparse.ArgumentParser(prog="learner.ranks")
    for flag in ("--rank", "--world", "--port", "--parent"):
        p.add_argument(flag, type=int, required=True)
    for flag in ("--backend", "--model", "--run-path"):
        p.add_argument(flag, required=True)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    from learner.sharded import RankTrainer
    from schemas.config import LearnerSection

    lc = LearnerSection.model_validate_json(os.environ["RLBUS_LEARNER_SECTION"])
    store = _store("127.0.0.1", args.port, args.world, False, lc.dist_timeout_s)
    join_group(store, args.rank, args.world, args.backend, lc.dist_timeout_s)
    trainer = RankTrainer(lc, Path(args.model), args.rank, args.world, args.backend)
    serve(trainer)
    _leave()
    return 0


if __name__ == "__main__":
    sys.exit(follower_main())
