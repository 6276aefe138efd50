"""The recorder: copies the run's REWARDS, WEIGHTS, EVAL and DLQ streams into the run store.

Guarantees:
- Each stream is read by its own durable pull consumer (`recorder-rewards`,
  `recorder-weights`, `recorder-eval`, `recorder-dlq`) with explicit settings; the
  recorder never shares a durable with the learner or any other reader.
- A batch is acked only after its rows are committed. Redelivery (a crash before the
  ack, a recreated consumer) rewrites the same `msg_id`s, which the store ignores:
  at-least-once delivery + idempotent writes = exactly one row per message.
- A message that does not decode, or belongs to another run, is acked and counted
  (`undecodable`, `foreign`), never dead-lettered again: the stage that produced or
  consumed it dead-letters it.
- A database that is unreachable (OperationalError) is not a bug: the batch is nak'ed
  with a delay and retried; max_deliver is unlimited so the recorder never turns a
  database outage into dead letters. Other errors propagate.
- `record` returns when `stop` is set, or when every stream has been idle for
  `until_idle` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy.exc import OperationalError

from bus.pull import fetch
from bus.subjects import Registry
from scheduler.store import Store
from schemas import DeadLetter, DecodeError, EvalResult, Message, Reward, WeightVersion, decode

log = structlog.get_logger()


@dataclass(frozen=True)
class Feed:
    """One stream the recorder copies: which messages, and which store method writes them."""

    family: str
    durable: str
    subject: Callable[[Registry], str]
    kind: type[Message]
    write: Callable[[Store, list], int]


FEEDS = (
    Feed("REWARDS", "recorder-rewards", lambda r: r.all("rewards"), Reward, Store.record_rewards),
    Feed("WEIGHTS", "recorder-weights", lambda r: r.weights, WeightVersion, Store.record_weights),
    Feed("EVAL", "recorder-eval", lambda r: r.all("eval"), EvalResult, Store.record_evals),
    Feed("DLQ", "recorder-dlq", lambda r: r.all("dlq"), DeadLetter, Store.record_dead_letters),
)


def consumer_config(
    reg: Registry, feed: Feed, *, ack_wait_s: float = 60.0, max_ack_pending: int = 4096
) -> ConsumerConfig:
    """The explicit config of one recorder durable."""
    return ConsumerConfig(
        durable_name=feed.durable,
        name=feed.durable,
        filter_subject=feed.subject(reg),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_ack_pending,
    )


async def _subscribe(js: JetStreamContext, reg: Registry, feed: Feed):
    stream = reg.stream(feed.family)
    await js.add_consumer(stream, config=consumer_config(reg, feed))
    return await js.pull_subscribe_bind(feed.durable, stream=stream)


def _decode_all(reg: Registry, feed: Feed, raws, counters: dict[str, float]) -> list[Message]:
    msgs = []
    for raw in raws:
        try:
            msg = decode(raw.data, feed.kind)
        except DecodeError as exc:
            counters["undecodable"] = counters.get("undecodable", 0) + 1
            log.warning(
                "recorder.undecodable", stream=feed.family, subject=raw.subject, field=exc.field, reason=exc.reason
            )
            continue
        if msg.run_id != reg.run_id:
            counters["foreign"] = counters.get("foreign", 0) + 1
            continue
        msgs.append(msg)
    return msgs


async def _copy(
    js: JetStreamContext,
    reg: Registry,
    store: Store,
    feed: Feed,
    stop: asyncio.Event,
    until_idle: float | None,
    counters: dict[str, float],
    batch: int,
    fetch_timeout: float,
) -> None:
    sub = await _subscribe(js, reg, feed)
    key = feed.family.lower()
    last_work = time.monotonic()
    try:
        while not stop.is_set():
            raws = await fetch(sub, batch, fetch_timeout)
            if not raws:
                if until_idle is not None and time.monotonic() - last_work >= until_idle:
                    break
                continue
            last_work = time.monotonic()
            msgs = _decode_all(reg, feed, raws, counters)
            try:
                new = await asyncio.to_thread(feed.write, store, msgs) if msgs else 0
            except OperationalError as exc:
                log.warning("recorder.db_unavailable", stream=feed.family, error=str(exc).splitlines()[0])
                for raw in raws:
                    await raw.nak(delay=2.0)
                await asyncio.sleep(1.0)
                continue
            for raw in raws:  # only after the commit
                await raw.ack()
            counters[key] = counters.get(key, 0) + new
            counters[f"{key}_seen"] = counters.get(f"{key}_seen", 0) + len(msgs)
    finally:
        await sub.unsubscribe()


async def record(
    js: JetStreamContext,
    reg: Registry,
    store: Store,
    *,
    stop: asyncio.Event,
    until_idle: float | None = None,
    batch: int = 256,
    fetch_timeout: float = 0.5,
) -> dict[str, float]:
    """Copy the run's streams into `store` until `stop` (or `until_idle` seconds idle).

    Returns counters: new rows per stream (`rewards`, `weights`, `eval`, `dlq`), messages
    seen per stream (`<stream>_seen`), and `undecodable` / `foreign` acks."""
    await asyncio.to_thread(store.ensure_run, reg.run_id)
    counters: dict[str, float] = {}
    await asyncio.gather(
        *(_copy(js, reg, store, feed, stop, until_idle, counters, batch, fetch_timeout) for feed in FEEDS)
    )
    log.info("recorder.stopped", run_id=reg.run_id, **counters)
    return counters
