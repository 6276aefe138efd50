"""The curriculum service: turns the run's rewards into domain weights and levels.

`run_curriculum` runs inside the scheduler process, next to the recorder.

Guarantees:
- It reads REWARDS with its own durable pull consumer `curriculum` (explicit settings,
  unlimited deliveries); it shares no durable with the learner or the recorder.
- Rewards are grouped per trajectory group (`group_id`); a group is observed once, as
  (domain, difficulty, rewards, lowest policy version of its samples), when all `group_size` samples are in, or as a partial
  group after `learner.group_deadline_s` (the rest may be dead-lettered). Rewards of
  `purpose != "train"`, of domains not in `sampler.domains` or held out, or of other runs
  are acked and counted, never observed. Redelivered rewards (same msg_id) are not counted twice.
- Messages are acked only after the curriculum state that includes them is published,
  so a crash re-observes them against the last published state. Messages of groups
  still incomplete stay unacked (`in_progress` keeps them).
- However many domains, the whole state is ONE KV value, published at most once per
  `scheduler.curriculum.every_s` (and once at stop): every `every_s`, if anything was
  observed since the last publish, the state is published to the run's KV under `curriculum` as
  {"version": n, "weights": {...}, "levels": {...}, "updates": u, "snapshot": {...}} and,
  when a store is given, recorded with `record_curriculum_update` under the msg_id
  `curriculum-<run>-<n>` (deterministic: a repeated record is ignored). Before the first
  publish the sampler uses the static weights.
- On start the state is restored from KV `curriculum` when its snapshot has exactly the
  configured domains (otherwise it starts fresh, keeping the version counter).
- On stop: observed state is published one last time, then the consumer is left.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.kv import CURRICULUM, get_json, put_json
from bus.pull import fetch
from scheduler.curriculum import Curriculum, DomainSpec
from schemas import DecodeError, Reward, decode

log = structlog.get_logger()

DURABLE = "curriculum"
SEEN_MAX = 100_000
LOG_TOP = 10  # domains (largest weights) named in each `curriculum.published` log line


def build(cfg) -> Curriculum:
    """A fresh curriculum from the run config."""
    ec = cfg.scheduler.curriculum
    domains = {
        name: DomainSpec(
            target_reward=d.target_reward,
            floor_share=d.floor_share,
            levels=(d.min_level, d.max_level),
            start_level=d.initial_level,
            heldout=d.heldout,
        )
        for name, d in cfg.sampler.domains.items()
    }
    return Curriculum(
        domains,
        temperature=ec.temperature,
        ema_alpha=ec.ema_alpha,
        promote_at=ec.promote_at,
        demote_at=ec.demote_at,
        window=ec.window,
        min_share=ec.min_share,
        max_share=ec.max_share,
    )


def consumer_config(reg, *, ack_wait_s: float = 120.0, max_ack_pending: int = 16384) -> ConsumerConfig:
    """The explicit config of the `curriculum` durable."""
    return ConsumerConfig(
        durable_name=DURABLE,
        name=DURABLE,
        filter_subject=reg.all("rewards"),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_ack_pending,
    )


def kv_value(cur: Curriculum, version: int) -> dict:
    """What goes under KV `curriculum`."""
    snap = cur.snapshot()
    return {
        "version": version,
        "weights": snap["weights"],
        "levels": {d: cur.level(d) for d in cur.domains},
        "updates": cur.updates,
        "snapshot": snap,
    }


async def restore(js, reg, cfg) -> tuple[Curriculum, int]:
    """(curriculum, last published version) from KV, or a fresh one."""
    fresh = build(cfg)
    prev = await get_json(js, reg, CURRICULUM) or {}
    version = int(prev.get("version", 0))
    snap = prev.get("snapshot")
    if snap and set(snap.get("domains", {})) == set(fresh.domains):
        try:
            return Curriculum.restore(snap), version
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("curriculum.restore_failed", error=repr(exc))
    elif snap:
        log.warning("curriculum.domains_changed", was=sorted(snap.get("domains", {})), now=sorted(fresh.domains))
    return fresh, version


KEEP_ALIVE_S = 20.0  # how often messages of incomplete groups are marked in progress


class _Observer:
    """The service's state between fetches: groups being filled, messages waiting for the
    publish that includes them, redelivery memory and the published version."""

    def __init__(self, js, reg, cur: Curriculum, version: int, store) -> None:
        self.js, self.reg, self.cur, self.version, self.store = js, reg, cur, version, store
        self.counters: dict[str, float] = {"curriculum_version": version}
        self.groups: dict[str, dict] = {}  # group_id -> {domain, level, size, rewards, raws, first}
        self.to_ack: list = []
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.observed_since = 0
        self.reasons: list[str] = []

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    async def _drop(self, raw, counter: str) -> None:
        """A message that is counted and acked, never observed."""
        self.count(counter)
        await raw.ack()

    async def take(self, raw, now: float) -> None:
        """File one fetched message into its group; observe the group once it is complete."""
        try:
            msg = decode(raw.data, Reward)
        except DecodeError:
            await self._drop(raw, "curriculum_undecodable")
            return
        t = msg.trajectory
        if (
            msg.run_id != self.reg.run_id
            or t.purpose != "train"
            or t.domain not in self.cur.domains
            or self.cur.domains[t.domain].heldout
        ):
            await self._drop(raw, "curriculum_skipped")
            return
        if msg.msg_id in self.seen:
            await self._drop(raw, "curriculum_duplicates")
            return
        self.seen[msg.msg_id] = None
        if len(self.seen) > SEEN_MAX:
            self.seen.popitem(last=False)
        g = self.groups.setdefault(
            t.group_id,
            {
                "domain": t.domain,
                "level": t.difficulty,
                "size": t.group_size,
                "rewards": [],
                "raws": [],
                "first": now,
                "version": None,
            },
        )
        if t.policy_version >= 0:  # -1: an episode without a model turn records no version
            g["version"] = t.policy_version if g["version"] is None else min(g["version"], t.policy_version)
        g["rewards"].append(msg.reward)
        g["raws"].append(raw)
        if len(g["rewards"]) >= g["size"]:
            self.observe(t.group_id)

    def observe(self, gid: str) -> None:
        """Feed the group to the curriculum; its messages wait for the next publish."""
        g = self.groups.pop(gid)
        change = self.cur.observe(g["domain"], g["level"], g["rewards"], version=g["version"] or 0)
        self.to_ack.extend(g["raws"])
        self.observed_since += 1
        self.count("curriculum_groups")
        if change is not None:
            self.count(f"curriculum_{change.kind}s")
            self.reasons.append(f"{change.kind} {change.domain} {change.old_level}->{change.new_level}")
            log.info(
                "curriculum.level",
                domain=change.domain,
                old=change.old_level,
                new=change.new_level,
                success_rate=round(change.success_rate, 3),
            )

    def expire(self, now: float, deadline: float) -> None:
        """Observe, as partial groups, the groups older than `deadline` seconds."""
        for gid in [gid for gid, g in self.groups.items() if now - g["first"] >= deadline]:
            self.count("curriculum_partial_groups")
            self.observe(gid)

    async def keep_alive(self) -> None:
        """Keep the messages of incomplete groups from redelivery."""
        for g in self.groups.values():
            for raw in g["raws"]:
                await raw.in_progress()

    async def publish(self) -> None:
        """Publish (and record) the next version, then ack the messages it includes."""
        self.version += 1
        value = kv_value(self.cur, self.version)
        await put_json(self.js, self.reg, CURRICULUM, value)
        if self.store is not None:
            run_id = self.reg.run_id
            await asyncio.to_thread(
                self.store.record_curriculum_update,
                run_id,
                f"curriculum-{run_id}-{self.version}",
                value["weights"],
                value["levels"],
                "; ".join(self.reasons) or "periodic",
            )
        for raw in self.to_ack:
            await raw.ack()
        top = sorted(value["weights"].items(), key=lambda kv: -kv[1])[:LOG_TOP]
        log.info(
            "curriculum.published",
            version=self.version,
            domains=len(value["weights"]),
            weights={d: round(w, 3) for d, w in top},
            levels={d: value["levels"][d] for d, _ in top},
            groups=self.observed_since,
        )
        self.to_ack, self.reasons, self.observed_since = [], [], 0
        self.counters["curriculum_version"] = self.version


async def run_curriculum(
    js, reg, cfg, stop: asyncio.Event, store=None, *, batch: int = 256, fetch_timeout: float = 0.5
) -> dict[str, float]:
    """Observe rewards and publish the curriculum until `stop`; returns counters."""
    every = cfg.scheduler.curriculum.every_s
    deadline = cfg.learner.group_deadline_s
    cur, version = await restore(js, reg, cfg)
    state = _Observer(js, reg, cur, version, store)
    stream = reg.stream("REWARDS")
    await js.add_consumer(stream, config=consumer_config(reg))
    sub = await js.pull_subscribe_bind(DURABLE, stream=stream)
    last_publish = last_progress = time.monotonic()
    try:
        while not stop.is_set():
            raws = await fetch(sub, batch, fetch_timeout)
            now = time.monotonic()
            for raw in raws:
                await state.take(raw, now)
            state.expire(now, deadline)
            if state.groups and now - last_progress >= KEEP_ALIVE_S:
                await state.keep_alive()
                last_progress = now
            if state.observed_since and now - last_publish >= every:
                await state.publish()
                last_publish = now
        if state.observed_since:
            await state.publish()
    finally:
        await sub.unsubscribe()
    log.info("curriculum.stopped", **state.counters)
    return state.counters
