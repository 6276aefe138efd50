"""Periodic worker telemetry and heartbeats on core NATS (`metrics.<run>.<role>.<id>`).

Guarantees: publishing telemetry never blocks or fails the work; a failed publish is
logged and skipped. Values are the live `counters` dict of the worker.
"""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

from bus.subjects import Registry
from schemas import Metric, encode

log = structlog.get_logger()


def worker_id(role: str) -> str:
    """A process-unique id: role-host-pid."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:24]
    return f"{role}-{host}-{os.getpid()}"


async def report_forever(nc, reg: Registry, role: str, counters: dict[str, float], every: float = 1.0) -> None:
    """Publish `counters` every `every` seconds until cancelled."""
    wid = worker_id(role)
    subject = reg.metrics(role, wid)
    while True:
        t = os.times()
        counters["cpu_seconds"] = t.user + t.system  # this process's CPU so far (the run store's cost)
        try:
            await nc.publish(subject, encode(Metric(run_id=reg.run_id, role=role, worker_id=wid, values=dict(counters),
                                                    host=socket.gethostname(), pid=os.getpid())))
        except Exception as exc:  # telemetry must never take the worker down
            log.warning("telemetry.publish_failed", error=str(exc))
        await asyncio.sleep(every)
