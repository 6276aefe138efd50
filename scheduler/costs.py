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

from bus.telemetry import CPU_SECONDS, GPU_SECONDS, TOKEN_COUNTER, TOKENS, Heartbeats

log = structlog.get_logger()


def totals(beats: Heartbeats) -> dict[str, dict[str, float]]:
    """role -> {cpu_seconds, gpu_seconds, tokens} summed over every worker seen (counter names: `bus.telemetry`)."""
    out: dict[str, dict[str, float]] = {}
    for m in beats.metrics():
        t = out.setdefault(m.role, {"cpu_seconds": 0.0, "gpu_seconds": 0.0, "tokens": 0.0})
        t["cpu_seconds"] += float(m.values.get(CPU_SECONDS, 0.0))
        t["gpu_seconds"] += float(m.values.get(GPU_SECONDS, 0.0))
        t["tokens"] += float(m.values.get(TOKEN_COUNTER.get(m.role, TOKENS), 0.0))
    return out


async def track_costs(nc, reg, store, stop: asyncio.Event, every_s: float = 10.0) -> dict[str, dict[str, float]]:
    """Run until `stop`; returns the last totals written."""
    beats = Heartbeats(reg.run_id)  # the newest heartbeat of every worker ever seen, of this run only

    async def write() -> dict:
        t = totals(beats)
        for role, v in t.items():
            await asyncio.to_thread(
                store.set_cost,
                reg.run_id,
                role,
                cpu_seconds=v["cpu_seconds"],
                gpu_seconds=v["gpu_seconds"],
                tokens=int(v["tokens"]),
            )
        return t

    sub = await beats.subscribe(nc, reg)
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
