"""The task sampler process: publishes `Task`s under a backpressure gate.

Guarantees:
- In-flight tasks (published but not yet consumed by the learner, minus dead letters)
  are bounded per duration pool (`sampler.inflight_caps`, derived with the config): the short pool by `sampler.max_inflight_tasks`
  and by what the learner consumes within `max_staleness` versions, each other pool by
  its own `max_inflight`; when the learner stalls, sampling stops instead of flooding
  the TASKS stream, and long tasks never take the short pool's room.
- Every published task is recorded in the LEDGER (`fate=published`) right after its
  publish is acknowledged by the stream, keyed by the task's msg_id; the run's
  accounting starts from these records.
- Problems of the held-out evaluation set are never used for training.
- Tasks come from the domain registry (`producers.domains`); a task's hidden payload
  (gold, tests) is stored in the run's hidden bucket under `task.hidden_ref` before the
  task is published, so a verifier can always resolve it; likewise the public payloads a
  task names by reference (`Drawn.payloads`: a large repository) are in the run's payload
  bucket (`bus.payloads`) before the task is published, and so is its check (verifier, params,
  reward weights, hidden ref: `bus.checks`), which is what the verifier scores it by.
- The published count survives restarts (KV `sampler.progress`).
- Each task's domain is drawn by the curriculum weights (KV `curriculum`, written by the
  scheduler: {"weights": {...}, "levels": {...}, "version": n}) and its `difficulty` is
  that domain's curriculum level; before the first update (or when the KV value names
  none of the configured domains) the static `sampler.domains.<d>.weight`s and
  `start_level`s apply. Weights of unknown domains are ignored and levels are clamped
  to the domain's [min_level, max_level].
- A `heldout` domain (zero-shot, evaluated only) has weight 0 whatever the curriculum or
  its static weight says: it is never drawn for training.
- KV `sampler.progress` counts the tasks published per domain too (`by_domain`).
- A domain whose source cannot start (`producers.domains.DomainUnavailable`) is disabled:
  logged, counted (`domains_disabled`) and never drawn; the run goes on with the rest
  (an error when that leaves none to train). A task a source cannot make (`TaskSkipped`) is not
  published and another is drawn (at most `publish_batch` such skips per round); what the
  sources skip is counted by reason (`skipped_<reason>`: e.g. prompts over a domain's
  `max_prompt_chars`, never truncated).
"""

from __future__ import annotations

import asyncio
import random

import structlog

from bus.checks import put_checks
from bus.hidden import put_hidden
from bus.kv import CURRICULUM, DURATIONS, LEARNER_PROGRESS, SAMPLER_PROGRESS, get_json, put_json
from bus.payloads import put_payloads
from bus.publish import publish, publish_many
from bus.session import WorkerContext, worker_session
from producers.domains import Drawn, TaskSkipped, make_sources
from schemas import TaskFate, TaskFates
from schemas.config import RunConfig

log = structlog.get_logger()


def plan(domains: dict, curriculum: dict | None) -> tuple[dict[str, float], dict[str, int]]:
    """(weights, levels) to sample with: the curriculum's where it has them, else static."""
    static_w = {d: 0.0 if c.heldout else c.weight for d, c in domains.items()}
    levels = {d: c.initial_level for d, c in domains.items()}
    weights = static_w
    if curriculum:
        cw = {d: float(w) for d, w in (curriculum.get("weights") or {}).items() if d in domains}
        if cw and sum(max(0.0, w) for w in cw.values()) > 0:
            weights = {d: 0.0 if domains[d].heldout else max(0.0, cw.get(d, 0.0)) for d in domains}
        for d, lvl in (curriculum.get("levels") or {}).items():
            if d in domains:
                levels[d] = min(max(int(lvl), domains[d].min_level), domains[d].max_level)
    if sum(weights.values()) <= 0:
        weights = {d: 0.0 if c.heldout else 1.0 for d, c in domains.items()}
    return weights, levels


def choose(rng: random.Random, weights: dict[str, float]) -> str:
    """A domain drawn in proportion to `weights` (positive total)."""
    names = list(weights)
    return rng.choices(names, weights=[weights[d] for d in names])[0]


def pool_for(domain: str, level: int, dc, durations: dict | None, pools) -> str:
    """The duration pool of a (domain, level): the domain's `pool`, or `long` once the
    measured mean episode time (KV `durations`) exceeds its `long_after_s` (and `pools`,
    any collection of pool names, has one)."""
    measured = ((durations or {}).get(domain) or {}).get(str(level))
    if measured is not None and measured > dc.long_after_s and "long" in pools:
        return "long"
    return dc.pool


def pool_caps(cfg) -> dict[str, int]:
    """In-flight bound per pool: `sampler.inflight_caps`, derived once when the config is
    resolved (`short`: `max_inflight_tasks` capped by what the learner consumes within
    `max_staleness` versions; other pools: their own `max_inflight`)."""
    return dict(cfg.sampler.inflight_caps)


async def inflight_by_pool(js, reg, published: dict[str, int]) -> dict[str, int]:
    """Tasks published and not yet consumed by the learner nor dead-lettered, per pool.

    Dead-lettered trajectories/rewards are not subtracted: their task's other samples
    still reach the learner as a partial group, which it trains or filters (counted in
    `tasks_done`). Only a task whose every sample is dead-lettered keeps its slot
    (rollout dead letters are counted against the `short` pool).
    """
    progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
    done = dict(progress.get("tasks_done_by_pool") or {"short": int(progress.get("tasks_done", 0))})
    subject = reg.dlq("rollout")
    try:
        info = await js.stream_info(reg.stream("DLQ"), subjects_filter=subject)
        dead = int((info.state.subjects or {}).get(subject, 0))
    except Exception:  # noqa: BLE001 - counting no dead letters overstates what is held: the gate only closes tighter
        dead = 0
    return {p: max(0, n - int(done.get(p, 0)) - (dead if p == "short" else 0)) for p, n in published.items()}


def make_tasks(
    sources: dict,
    rng: random.Random,
    start: int,
    room: dict[str, int],
    limit: int,
    weights: dict[str, float],
    levels: dict[str, int],
    pools_of: dict[str, str],
) -> list[Drawn]:
    """Up to `limit` training tasks, each of a domain drawn by `weights` among the domains
    whose pool still has room, at that domain's level, tagged with its pool; a task the
    source skips (`TaskSkipped`) is left out (after `limit` skips the round ends short)."""
    room, out, skips = dict(room), [], 0
    while len(out) < limit:
        open_w = {d: w for d, w in weights.items() if w > 0 and room.get(pools_of[d], 0) > 0}
        if not open_w:
            break
        domain = choose(rng, open_w)
        try:
            drawn = sources[domain].make_task(rng, levels[domain], start + len(out))
        except TaskSkipped:
            skips += 1
            if skips > limit:
                break
            continue
        pool = pools_of[domain]
        if pool != drawn.task.pool:
            drawn.task = drawn.task.model_copy(update={"pool": pool})
        room[pool] -= 1
        out.append(drawn)
    return out


def skip_counts(sources: dict) -> dict[str, int]:
    """`skipped_<reason>` -> problems the sources skipped for that reason (their `skipped` counters)."""
    out: dict[str, int] = {}
    for src in sources.values():
        for reason, n in (getattr(src, "skipped", None) or {}).items():
            out[f"skipped_{reason}"] = out.get(f"skipped_{reason}", 0) + int(n)
    return out


async def run(cfg: RunConfig, ctx: WorkerContext) -> dict[str, float]:
    """Run the sampler until stopped (or `ctx.max_messages` tasks published)."""
    sc = cfg.sampler
    max_tasks = ctx.max_messages  # for the sampler the generic limit counts tasks published (None: no limit)
    async with worker_session("sampler", cfg, ctx) as s:
        # building sources and drawing tasks can take seconds (reasoning-gym generators): off the loop, so
        # the heartbeats go on
        sources, disabled = await asyncio.to_thread(make_sources, s.reg.run_id, cfg)
        domains = {d: dc for d, dc in sc.domains.items() if d in sources}
        if disabled and not any(not dc.heldout for dc in domains.values()):
            raise ValueError(f"no domain left to train: every other one is disabled ({disabled})")
        s.counters["domains_disabled"] = len(disabled)
        hidden_stored: set[str] = set()
        payloads_stored: set[str] = set()
        checks_stored: dict[str, bytes] = {}
        saved = await get_json(s.js, s.reg, SAMPLER_PROGRESS) or {}
        published = int(saved.get("published", 0))
        by_pool = {p: 0 for p in sc.inflight_caps} | dict(saved.get("by_pool") or {"short": published})
        by_domain: dict[str, int] = dict(saved.get("by_domain") or {})
        caps = pool_caps(cfg)
        rng = random.Random(f"sampler-{cfg.run.seed}-{published}")
        s.counters["published"] = published
        while not s.stop.is_set():
            if max_tasks is not None and published >= max_tasks:
                break
            held = await inflight_by_pool(s.js, s.reg, by_pool)
            room = {p: caps.get(p, 0) - held.get(p, 0) for p in caps}
            s.counters["inflight"] = sum(held.values())
            if all(r <= 0 for r in room.values()):  # gate closed: nothing can be drawn, no KV to read
                s.counters["gate_waits"] = s.counters.get("gate_waits", 0) + 1
                await asyncio.sleep(sc.poll_seconds)
                continue
            weights, levels = plan(domains, await get_json(s.js, s.reg, CURRICULUM))
            durations = await get_json(s.js, s.reg, DURATIONS)
            pools_of = {d: pool_for(d, levels[d], domains[d], durations, sc.inflight_caps) for d in domains}
            limit = sc.publish_batch if max_tasks is None else min(sc.publish_batch, max_tasks - published)
            drawn = await asyncio.to_thread(make_tasks, sources, rng, published, room, limit, weights, levels, pools_of)
            s.counters.update(skip_counts(sources))
            if not drawn:
                s.counters["gate_waits"] = s.counters.get("gate_waits", 0) + 1
                await asyncio.sleep(sc.poll_seconds)
                continue
            n = len(drawn)
            for d in drawn:
                if d.hidden is not None and d.task.hidden_ref not in hidden_stored:
                    await put_hidden(s.js, s.reg, d.task.hidden_ref, d.hidden)
                    hidden_stored.add(d.task.hidden_ref)
                await put_payloads(s.js, s.reg, d.payloads, payloads_stored)
            tasks = [d.task for d in drawn]
            await put_checks(s.js, s.reg, tasks, checks_stored)  # the verifier scores by these, never the trajectory's
            await publish_many(s.js, [(s.reg.tasks(t.domain, t.pool), t) for t in tasks])
            await publish(
                s.js,
                s.reg.ledger("sampler"),
                TaskFates(
                    run_id=s.reg.run_id,
                    stage="sampler",
                    fates=[TaskFate(task_msg_id=t.msg_id, fate="published") for t in tasks],
                ),
            )
            published += n
            for t in tasks:
                by_pool[t.pool] = by_pool.get(t.pool, 0) + 1
                by_domain[t.domain] = by_domain.get(t.domain, 0) + 1
            s.counters["published"] = published
            await put_json(
                s.js, s.reg, SAMPLER_PROGRESS, {"published": published, "by_pool": by_pool, "by_domain": by_domain}
            )
        return s.counters
