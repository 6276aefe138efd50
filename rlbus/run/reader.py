"""Reading a run's stored rewards back, from a live run or a finished one, changing nothing.

Shared by `rlbus samples` and `rlbus rescore`.

Guarantees:
- `reach_run(RUN_PATH, nats_url)` finds the run's JetStream and yields a `RunAccess`:
  - RUN_PATH must be one run's folder (`<run-dir>/<run_id>`, as `rlbus up` makes it);
    anything else is a `RunReadError` that says what RUN_PATH should be.
  - live: `--nats-url`, else `nats_url` in `<run>/run.json`, when a server answers there
    and holds the run's REWARDS stream;
  - finished: otherwise an embedded nats-server is started on the run's own store
    (`<run>/nats`), on a free loopback port, with its log in a temporary folder (not in
    the store). Nothing else is written to the store, beyond what starting a server
    does. That server is stopped when the block exits, on an error, Ctrl-C or SIGTERM
    too. A store is never opened twice: refused while any nats-server runs on it (the
    run's own, or another reader's; found by command line), and two readers are
    serialized by an flock on the store folder.
- Reads only: stream info and direct gets by sequence (`bus.streams.iter_stream`); no
  consumer is created, nothing is published, acked or put.
- `iter_rewards` yields the stored `Reward`s in stream order, optionally of one domain;
  undecodable messages are skipped and counted in `RewardCounts.skipped`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bus.subjects import Registry
from rlbus.run.folder import RunFolder
from schemas import DecodeError, Reward, decode


class RunReadError(RuntimeError):
    """The run cannot be read as asked; the message says why and what to do."""


@dataclass(frozen=True)
class RunAccess:
    """Where a run's JetStream is, and how it was reached (`live` or `store`)."""

    run_id: str
    run_path: Path
    url: str
    source: str

    @property
    def reg(self) -> Registry:
        return Registry(self.run_id)

    def describe(self) -> str:
        """One line for the console: which run, read from where."""
        where = (
            "its live nats-server at " + self.url.split("@")[-1]
            if self.source == "live"
            else f"its stored JetStream ({RunFolder(self.run_path).nats}, server stopped again at exit)"
        )
        return f"run {self.run_id}: read from {where}"


@dataclass
class RewardCounts:
    """What `iter_rewards` read: decoded rewards and skipped (undecodable) messages."""

    read: int = 0
    skipped: int = 0
    skipped_seqs: list[int] = field(default_factory=list)


def run_identity(run_path: Path) -> tuple[str, RunFolder]:
    """(run_id, folder) of a run folder; RunReadError when it is not one."""
    if not run_path.is_dir():
        raise RunReadError(
            f"{run_path} is not a folder: RUN_PATH is one run's folder, <run-dir>/<run_id> "
            "(e.g. runs/demo-20250101-120000), as `rlbus up` made it"
        )
    folder = RunFolder(run_path)
    if not folder.state() and not folder.config() and not folder.nats.is_dir():
        raise RunReadError(
            f"{run_path} holds no run.json, config.json or nats/ store: is it a run folder "
            "(<run-dir>/<run_id>)? List runs with `ls runs/`"
        )
    run_id = folder.recorded_run_id()
    try:
        Registry(run_id)
    except ValueError as exc:
        raise RunReadError(f"{run_path}: {exc}") from None
    return run_id, folder


def servers_on_store(store: Path) -> list[int]:
    """Pids of running nats-server processes whose JetStream store (`-sd`) is `store`."""
    store, found = store.resolve(), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if args and Path(args[0]).name == "nats-server" and "-sd" in args[:-1]:
            if Path(args[args.index("-sd") + 1]).resolve() == store:
                found.append(int(proc.name))
    return found


async def _holds_run(url: str, reg: Registry) -> bool:
    """True when a server answers at `url` and has the run's REWARDS stream."""
    from nats.js.errors import NotFoundError

    from bus.conn import connect
    from rlbus.run.server import server_reachable

    if not await server_reachable(url):
        return False
    nc = await connect(url, name="rlbus-read-probe", max_reconnect_attempts=0, allow_reconnect=False)
    try:
        await nc.jetstream(timeout=10).stream_info(reg.stream("REWARDS"))
        return True
    except NotFoundError:
        return False
    finally:
        await nc.close()


@contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into SystemExit inside the block, so `finally` clauses run."""

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _store_lock(store: Path) -> Iterator[None]:
    """An exclusive flock on the store folder itself (writes nothing): one reader starts a server at a time."""
    import fcntl

    fd = os.open(store, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunReadError(
                f"another `rlbus samples` or `rescore` is reading {store} right now; retry when it is done"
            ) from None
        yield
    finally:
        os.close(fd)


@contextmanager
def _store_server(run_path: Path, run_id: str, url: str | None) -> Iterator[str]:
    """An embedded nats-server on the run's stored JetStream, for the block's duration; its URL."""
    from bus.server import EmbeddedNats

    store = RunFolder(run_path).nats
    where = f"at {url}" if url else "(no nats_url in run.json; none given with --nats-url)"
    if not (store / "jetstream").is_dir():
        raise RunReadError(
            f"no NATS server {where} holds run {run_id}, and {store} has no stored JetStream: "
            "start the run's server (`rlbus up --resume RUN_PATH`, or its compose stack) or "
            "pass --nats-url URL of the server it ran on"
        )
    with _store_lock(store), tempfile.TemporaryDirectory(prefix="rlbus-read-") as tmp, _stop_on_sigterm():
        running = servers_on_store(store)
        if running:
            pids = " ".join(map(str, running))
            raise RunReadError(
                f"no NATS server {where} holds run {run_id}, but nats-server pid {pids} runs on its "
                f"store {store}, which is never opened twice: wait for it to answer or end (the "
                f"run's own server: `kill {pids}` once its launcher is gone) and retry"
            )
        server = EmbeddedNats(store)
        server.log_path = Path(tmp) / "nats-server.log"  # the run's own log stays as it was
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise RunReadError(f"could not start a nats-server on {store}: {exc}") from None
        try:
            yield server.url
        finally:
            server.stop()


@contextmanager
def reach_run(run_path: str | os.PathLike, nats_url: str | None = None) -> Iterator[RunAccess]:
    """The run's JetStream for the block: its live server, else its store under a server of ours."""
    run_path = Path(run_path).resolve()
    run_id, folder = run_identity(run_path)
    reg = Registry(run_id)
    url = nats_url or folder.server_url()
    if url and asyncio.run(_holds_run(url, reg)):
        yield RunAccess(run_id, run_path, url, "live")
        return
    if nats_url:
        raise RunReadError(
            f"no NATS server at {nats_url} holds run {run_id} (no stream {reg.stream('REWARDS')}); "
            "check the URL, or leave --nats-url out to read the run's stored JetStream"
        )
    with _store_server(run_path, run_id, url) as store_url:
        if not asyncio.run(_holds_run(store_url, reg)):
            raise RunReadError(
                f"{folder.nats} has no stream {reg.stream('REWARDS')}: the run stored no "
                "rewards there (was it run against another NATS server? pass --nats-url)"
            )
        yield RunAccess(run_id, run_path, store_url, "store")


async def reward_domains(js, reg: Registry) -> dict[str, int]:
    """Domain -> number of stored rewards, from the REWARDS stream's subject counts."""
    info = await js.stream_info(reg.stream("REWARDS"), subjects_filter=reg.all("rewards"))
    prefix = f"rewards.{reg.run_id}."
    return {s[len(prefix) :]: n for s, n in sorted((info.state.subjects or {}).items()) if s.startswith(prefix)}


async def iter_rewards(
    js, reg: Registry, domain: str | None = None, counts: RewardCounts | None = None
) -> AsyncIterator[tuple[int, Reward]]:
    """(stream sequence, Reward) of every stored reward (of `domain`), in order; reads only."""
    from bus.streams import iter_stream

    counts = counts if counts is not None else RewardCounts()
    subject = reg.rewards(domain) if domain else reg.all("rewards")
    async for seq, data in iter_stream(js, reg.stream("REWARDS"), subject):
        try:
            reward = decode(data, Reward)
        except DecodeError:
            counts.skipped += 1
            counts.skipped_seqs.append(seq)
            continue
        counts.read += 1
        yield seq, reward


@asynccontextmanager
async def jetstream(access: RunAccess, name: str) -> AsyncIterator:
    """A JetStream context on the reached run's server (the connection closed after the block)."""
    from bus.conn import connect

    nc = await connect(access.url, name=name)
    try:
        yield nc.jetstream(timeout=30)
    finally:
        await nc.close()


async def check_domain(js, reg: Registry, domain: str | None) -> dict[str, int]:
    """The run's domains with stored rewards; RunReadError when `domain` is given and has none."""
    domains = await reward_domains(js, reg)
    if domain is not None and domain not in domains:
        known = ", ".join(f"{d} ({n})" for d, n in domains.items()) or "none"
        raise RunReadError(
            f"run {reg.run_id} has no stored rewards of domain {domain!r}; domains with rewards: {known}"
        )
    return domains
