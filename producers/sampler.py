"""The task sampler process: publishes `Task`s under a backpressure gate.

Guarantees:
- In-flight tasks (published but not yet consumed by the learner, minus dead letters)
  never exceed `sampler.max_inflight_tasks`; when the learner stalls, sampling stops
  instead of flooding the TASKS stream.
- Every published task is recorded in the LEDGER (`fate=published`) right after its
  publish is acknowledged by the stream, keyed by the task's msg_id; the run's
  accounting starts from these records.
- Problems of the held-out evaluation set are never used for training.
- The published count survives restarts (KV `sampler.progress`).
"""

from __future__ import annotations

import asyncio
import random

import structlog

from bus.kv import LEARNER_PROGRESS, SAMPLER_PROGRESS, get_json, put_json
from bus.publish import publish, publish_many
from producers import arith
from rlbus.runtime import worker_session
from schemas import ChatMessage, Task, TaskFate, TaskFates

log = structlog.get_logger()


def make_arith_task(run_id: str, rng: random.Random, cfg, index: int, heldout: set[str]) -> Task:
    """One arith training task (never a held-out problem)."""
    sc = cfg.sampler
    while True:
        problem = arith.generate(rng, sc.difficulty)
        if problem.expression not in heldout:
            break
    return Task(
        run_id=run_id, task_id=f"arith-{sc.difficulty}-{index}", domain="arith", difficulty=sc.difficulty,
        group_size=sc.group_size, prompt=[ChatMessage(role="user", content=problem.prompt)],
        max_tokens=sc.max_tokens, temperature=sc.temperature, verifier="arith",
        verifier_params={"expression": problem.expression},
    )


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
    if sc.domain != "arith":
        raise ValueError(f"sampler.domain {sc.domain!r}: only 'arith' is built in so far")
    async with worker_session("sampler", cfg, ctx) as s:
        ev = cfg.scheduler
        heldout = {p.expression for p in arith.heldout_set(ev.eval_seed, ev.eval_n, ev.eval_difficulty)}
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
            tasks = [make_arith_task(s.reg.run_id, rng, cfg, published + i, heldout) for i in range(n)]
            await publish_many(s.js, [(s.reg.tasks(t.domain), t) for t in tasks])
            await publish(s.js, s.reg.ledger("sampler"), TaskFates(
                run_id=s.reg.run_id, stage="sampler", fates=[TaskFate(task_msg_id=t.msg_id, fate="published") for t in tasks]))
            published += n
            s.counters["published"] = published
            await put_json(s.js, s.reg, SAMPLER_PROGRESS, {"published": published})
        return s.counters
