"""Measured episode durations per (domain, level), for the sampler's pool choice.

The scheduler reads REWARDS with an ordered consumer (it consumes nothing shared) and
keeps, per domain and difficulty level, an exponential moving average of each episode's
wall time: generation time plus every tool call's time. Every `every_s` seconds it
writes `{domain: {level: seconds}}` to the run's KV key `durations`, where the sampler
reads it: tasks of a (domain, level) whose average exceeds the domain's `long_after_s`
go to the `long` pool.

Guarantees: the KV value only ever holds finite, non-negative seconds; a reward that
fails to decode is skipped (the learner dead-letters it); stop leaves one last write.
"""

from __future__ import annotations

import asyncio
import math

import structlog

from bus.kv import DURATIONS, put_json
from schemas import DecodeError, RewardGlance, glance_reward

log = structlog.get_logger()


def episode_seconds(reward: RewardGlance) -> float:
    """Generation time plus tool time of the rewarded episode."""
    return max(0.0, float(reward.generate_seconds) + sum(ms for _, ms in reward.tool_calls) / 1000.0)


def update(table: dict[str, dict[str, float]], domain: str, level: int, seconds: float, alpha: float = 0.1) -> None:
    """Fold one episode into the EMA of its (domain, level)."""
    if not math.isfinite(seconds) or seconds < 0:
        return
    per = table.setdefault(domain, {})
    key = str(level)
    per[key] = seconds if key not in per else (1 - alpha) * per[key] + alpha * seconds


async def track_durations(js, reg, stop: asyncio.Event, every_s: float = 5.0) -> dict[str, dict[str, float]]:
    """Run until `stop`; returns the final table."""
    table: dict[str, dict[str, float]] = {}
    seen = 0

    async def on_msg(raw) -> None:
        nonlocal seen
        try:
            r = glance_reward(raw.data)  # every reward passes here: the observer's light view
        except DecodeError:
            return
        if r.purpose != "train":
            return
        update(table, r.domain, r.difficulty, episode_seconds(r))
        seen += 1

    sub = await js.subscribe(reg.all("rewards"), cb=on_msg, ordered_consumer=True)
    try:
        written = -1
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
            if seen != written and table:
                await put_json(js, reg, DURATIONS, table)
                written = seen
    finally:
        await sub.unsubscribe()
    return table
