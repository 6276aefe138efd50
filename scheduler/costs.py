"""Cost per stage for the run store: CPU seconds, GPU seconds and tokens, from heartbeats.

Every worker's heartbeat (`metrics.<run>.<role>.<worker>`, see `bus.telemetry`) carries its
process CPU seconds and its token counters (rollout: generated tokens; learner: trained
tokens). This keeps the latest heartbeat of every worker ever seen (a restarted worker is
a new id, so its predecessor's spend still counts) and writes cumulative totals per role
to the `costs` table every `every_s` seconds and at stop.

Guarantees: totals only grow for a given worker (the latest heartbeat replaces the
previous one); writes are idempotent upserts keyed on (run, stage). GPU seconds are 0
until a worker reports `gpu_seconds` (the CPU-only engines do not).
"""

from __future__ import annotations

import asyncio

import structlog

from schemas import DecodeError, Metric, decode

log = structlog.get_logger()

TOKEN_COUNTER = {"rollout": "tokens", "learner": "tokens_trained"}


def totals(latest: dict[str, Metric]) -> dict[str, dict[str, float]]:
    """role -> {cpu_seconds, gpu_seconds, tokens} summed over every worker seen."""
    out: dict[str, dict[str, float]] = {}
    for m in latest.values():
        t = out.setdefault(m.role, {"cpu_seconds": 0.0, "gpu_seconds": 0.0, "tokens": 0.0})
        t["cpu_seconds"] += float(m.values.get("cpu_seconds", 0.0))
        t["gpu_seconds"] += float(m.values.get("gpu_seconds", 0.0))
        t["tokens"] += float(m.values.get(TOKEN_COUNTER.get(m.role, "tokens"), 0.0))
    return out


async def track_costs(nc, reg, store, stop: asyncio.Event, every_s: float = 10.0) -> dict[str, dict[str, float]]:
    """Run until `stop`; returns the last totals written."""
    latest: dict[str, Metric] = {}

    async def on_msg(raw) -> None:
        try:
            m = decode(raw.data, Metric)
        except DecodeError:
            return
        if m.run_id == reg.run_id:
            latest[m.worker_id] = m

    async def write() -> dict:
        t = totals(latest)
        for role, v in t.items():
            await asyncio.to_thread(store.set_cost, reg.run_id, role, cpu_seconds=v["cpu_seconds"],
                                    gpu_seconds=v["gpu_seconds"], tokens=int(v["tokens"]))
        return t

    sub = await nc.subscribe(reg.metrics(), cb=on_msg)
    written: dict = {}
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
            written = await write()
    finally:
        await sub.unsubscribe()
    return written
