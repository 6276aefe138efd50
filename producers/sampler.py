"""The task sampler process: publishes `Task`s under a backpressure gate.

Guarantees:
- In-flight tasks (published but not yet consumed by the learner, minus dead letters)
  never exceed `sampler.max_inflight_tasks`; when the learner stalls, sampling stops
  instead of flooding the TASKS stream.
- Every published task is recorded in the LEDGER (`fate=published`) right after its
  publish is acknowledged by the stream, keyed by the task's msg_id; the run's
  accounting starts from these records.
- Problems of the held-out evaluation set are never used for training.
- Tasks come from the domain registry (`producers.domains`); a task's hidden payload
  (gold, tests) is stored in the run's hidden bucket under `task.hidden_ref` before the
  task is published, so a verifier can always resolve it.
- The published count survives restarts (KV `sampler.progress`).
- Each task's domain is drawn by the curriculum weights (KV `curriculum`, written by the
  scheduler: {"weights": {...}, "levels": {...}, "version": n}) and its `difficulty` is
  that domain's curriculum level; before the first update (or when the KV value names
  none of the configured domains) the static `sampler.domains.<d>.weight`s and
  `start_level`s apply. Weights of unknown domains are ignored and levels are clamped
  to the domain's [min_level, max_level].
"""

from __future__ import annotations

import asyncio
import random

import structlog

from bus.kv import CURRICULUM, LEARNER_PROGRESS, SAMPLER_PROGRESS, get_json, put_json
from bus.publish import publish, publish_many
from bus.hidden import put_hidden
from producers.domains import Drawn, make_source
from rlbus.runtime import worker_session
from schemas import TaskFate, TaskFates

log = structlog.get_logger()


def plan(domains: dict, curriculum: dict | None) -> tuple[dict[str, float], dict[str, int]]:
    """(weights, levels) to sample with: the curriculum's where it has them, else static."""
    static_w = {d: c.weight for d, c in domains.items()}
    levels = {d: c.initial_level for d, c in domains.items()}
    weights = static_w
    if curriculum:
        cw = {d: float(w) for d, w in (curriculum.get("weights") or {}).items() if d in domains}
        if cw and sum(max(0.0, w) for w in cw.values()) > 0:
            weights = {d: max(0.0, cw.get(d, 0.0)) for d in domains}
        for d, lvl in (curriculum.get("levels") or {}).items():
            if d in domains:
                levels[d] = min(max(int(lvl), domains[d].min_level), domains[d].max_level)
    if sum(weights.values()) <= 0:
        weights = {d: 1.0 for d in domains}
    return weights, levels


def choose(rng: random.Random, weights: dict[str, float]) -> str:
    """A domain drawn in proportion to `weights` (positive total)."""
    names = list(weights)
    return rng.choices(names, weights=[weights[d] for d in names])[0]


def make_tasks(sources: dict, rng: random.Random, start: int, n: int, weights: dict[str, float],
               levels: dict[str, int]) -> list[Drawn]:
    """`n` training tasks, each of a domain drawn by `weights`, at that domain's level."""
    out = []
    for i in range(n):
        domain = choose(rng, weights)
        out.append(sources[domain].make_task(rng, levels[domain], start + i))
    return out


async def inflight(js, reg, published: int) -> int:
    """Tasks published and not yet consumed by the learner nor dead-lettered as tasks.

    Dead-lettered trajectories/rewards are not subtracted: their task's other samples
    still reach the learner as a partial group, which it trains or filters (counted in
    `tasks_done`). Only a task whose every sample is dead-lettered keeps its slot.
    """
    progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
    done = int(progress.get("tasks_done", 0))
    subject = reg.dlq("rollout")
    try:
        info = await js.stream_info(reg.stream("DLQ"), subjects_filter=subject)
        dead = int((info.state.subjects or {}).get(subject, 0))
    except Exception:
        dead = 0
    return max(0, published - done - dead)


async def run(cfg, ctx) -> dict[str, float]:
    """Run the sampler until stopped (or `ctx.max_messages` tasks published)."""
    sc = cfg.sampler
    async with worker_session("sampler", cfg, ctx) as s:
        sources = {name: make_source(s.reg.run_id, name, cfg) for name in sc.domains}
        hidden_stored: set[str] = set()
        published = int((await get_json(s.js, s.reg, SAMPLER_PROGRESS) or {}).get("published", 0))
        rng = random.Random(f"sampler-{cfg.run.seed}-{published}")
        s.counters["published"] = published
        while not s.stop.is_set():
            if ctx.max_messages is not None and published >= ctx.max_messages:
                break
            room = sc.max_inflight_tasks - await inflight(s.js, s.reg, published)
            s.counters["inflight"] = sc.max_inflight_tasks - room
            if room <= 0:
                s.counters["gate_waits"] = s.counters.get("gate_waits", 0) + 1
                await asyncio.sleep(sc.poll_seconds)
                continue
            n = min(room, sc.publish_batch)
            if ctx.max_messages is not None:
                n = min(n, ctx.max_messages - published)
            weights, levels = plan(sc.domains, await get_json(s.js, s.reg, CURRICULUM))
            drawn = make_tasks(sources, rng, published, n, weights, levels)
            for d in drawn:
                if d.hidden is not None and d.task.hidden_ref not in hidden_stored:
                    await put_hidden(s.js, s.reg, d.task.hidden_ref, d.hidden)
                    hidden_stored.add(d.task.hidden_ref)
            tasks = [d.task for d in drawn]
            await publish_many(s.js, [(s.reg.tasks(t.domain), t) for t in tasks])
            await publish(s.js, s.reg.ledger("sampler"), TaskFates(
                run_id=s.reg.run_id, stage="sampler", fates=[TaskFate(task_msg_id=t.msg_id, fate="published") for t in tasks]))
            published += n
            s.counters["published"] = published
            await put_json(s.js, s.reg, SAMPLER_PROGRESS, {"published": published})
        return s.counters
