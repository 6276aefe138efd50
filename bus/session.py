"""What every worker process shares: its context, bus session, stop signal, telemetry.

Guarantees:
- `worker_session` connects (unlimited reconnects), creates the run's topology
  idempotently, starts telemetry, and turns SIGTERM/SIGINT into `session.stop` being
  set so a worker finishes its current batch and exits cleanly. It always closes the
  connection (flushing acks) on the way out.
- A worker started by `rlbus up` (env `RLBUS_LAUNCHER_PID`) notices within about a
  second when its launcher is gone (it was re-parented) and stops the same clean way,
  so a killed launcher never leaves workers running on their own; `rlbus up --resume`
  starts fresh ones. Workers started otherwise (compose, by hand) have no such tie.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from bus.conn import connect, ensure_topology
from bus.roles import ROLES
from bus.subjects import Registry
from bus.telemetry import report_forever, start_metrics_server
from schemas.config import RunConfig
from schemas.redact import redact_url

log = structlog.get_logger()


ROLE_LIMIT: dict[str, str] = {r.name: r.limit_unit for r in ROLES}
"""What `WorkerContext.max_messages` (`rlbus worker ROLE --max-messages N`) counts in each
role (`bus.roles.Role.limit_unit`): every role reads it once, into a variable named for its own unit."""


@dataclass
class WorkerContext:
    """Where a worker runs: run id, bus URL, run folder, and test-friendly limits."""

    run_id: str
    nats_url: str
    run_path: Path
    max_messages: int | None = None
    """Stop after this many units of the role's work (see ROLE_LIMIT); None = no limit."""
    until_idle: float | None = None
    """Stop after this many seconds with nothing to do; None = never."""
    configured_model: str = ""

    @property
    def model_path(self) -> Path:
        """The starting checkpoint: the one the launcher prepared (after SFT) in the run
        folder, else `model.path` from the config."""
        prepared = self.run_path / "model" / "start"
        if prepared.exists() or not self.configured_model:
            return prepared
        return Path(self.configured_model)


@dataclass
class Session:
    """A live bus session of one worker."""

    nc: NATS
    js: JetStreamContext
    reg: Registry
    cfg: RunConfig
    ctx: WorkerContext
    stop: asyncio.Event
    counters: dict[str, float] = field(default_factory=dict)


LAUNCHER_PID_ENV = "RLBUS_LAUNCHER_PID"


async def watch_launcher(role: str, stop: asyncio.Event, every: float = 1.0) -> None:
    """Set `stop` once the launcher that started this worker is gone (no-op without one)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return
    while not stop.is_set():
        if os.getppid() != int(launcher):
            log.warning(f"{role}.orphaned", launcher_pid=int(launcher), why="launcher gone; stopping cleanly")
            stop.set()
            return
        await asyncio.sleep(every)


@contextlib.asynccontextmanager
async def worker_session(role: str, cfg: RunConfig, ctx: WorkerContext):
    """Connect, ensure topology, report telemetry, and map signals to `stop`."""
    from bus.auth import security_options, topology_role

    nc = await connect(ctx.nats_url, name=f"rlbus-{role}", **security_options(cfg.run))
    js = nc.jetstream(timeout=30)
    reg = Registry(ctx.run_id)
    await ensure_topology(js, reg, role=topology_role(role))  # a restricted user creates only its own parts
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    session = Session(nc, js, reg, cfg, ctx, stop)
    start_metrics_server(role, session.counters, cfg.run.metrics_port)  # /metrics when run.metrics_port is set
    reporter = asyncio.create_task(report_forever(nc, reg, role, session.counters))
    orphan_watch = asyncio.create_task(watch_launcher(role, stop))
    log.info(f"{role}.started", nats_url=redact_url(ctx.nats_url))  # never a password in a log line
    try:
        yield session
    finally:
        reporter.cancel()
        orphan_watch.cancel()
        with contextlib.suppress(Exception):
            await nc.flush(timeout=5)  # acks and publishes are on the wire
        with contextlib.suppress(Exception):
            await nc.close()
        log.info(f"{role}.stopped", **{k: v for k, v in session.counters.items() if isinstance(v, (int, float))})
