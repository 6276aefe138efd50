"""The pull loop: fetch, decode, run a handler, and turn its outcome into an ack.

Outcomes are raised, never returned (per message, or per batch for `run_pull_loop`):
- the handler returns (None): ack;
- it raises `Retry(delay)`: nak with that delay (JetStream counts the attempt);
- it raises `Reject(reason)`: a `DeadLetter` with the reason and the original bytes goes
  to the stage's DLQ subject, then the message is termed.
A handler that returns anything but None has a bug: `TypeError`, propagated like any
other bug (nothing is acked).

Guarantees:
- A message that fails to decode, has an unexpected kind, or belongs to another run
  is dead-lettered with the reason and termed; the worker keeps going.
- While a handler runs, every message it holds gets `in_progress` at a third of the
  consumer's ack_wait (one keep-alive for both loops), so long work is not redelivered.
- Fetch time-outs are normal and only mean "idle".
- Bugs in a handler propagate (the process crashes and is restarted; the message is
  redelivered), they are never turned into an ack.

Two loops share these outcomes:
- `run_pull_loop` handles a fetched batch as one unit (batched generation needs that):
  the handler's one outcome applies to every message of the batch.
- `run_pull_stream` handles each message on its own and acks it the moment its
  handler finishes, fetching more while others are still running (at most `inflight`
  at once). A slow message never holds back its neighbours: there is no batch barrier,
  which is what keeps a verifier with variable latency busy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.publish import publish
from bus.subjects import Registry
from schemas import DeadLetter, DecodeError, Message, decode, new_msg_id

log = structlog.get_logger()


@dataclass
class Retry(Exception):
    """Raised by a handler: transient failure, redeliver after `delay` seconds."""

    delay: float = 1.0
    reason: str = ""


@dataclass
class Reject(Exception):
    """Raised by a handler: this message can never succeed; dead-letter it with `reason`."""

    reason: str
    error_type: str = "rejected"


Outcome = Retry | Reject | None  # None: ack


@dataclass
class Delivery:
    """A decoded message with its raw NATS message."""

    raw: Msg
    msg: Message

    @property
    def delivered(self) -> int:
        """JetStream delivery count (1 on first delivery)."""
        return self.raw.metadata.num_delivered


async def dead_letter(
    js: JetStreamContext,
    reg: Registry,
    stage: str,
    raw: Msg,
    reason: str,
    error_type: str,
    task_msg_id: str | None = None,
) -> None:
    """Publish the original message to the DLQ with its reason, then term it."""
    try:
        delivered = raw.metadata.num_delivered
    except (nats.errors.NotJSMessageError, ValueError, IndexError):  # not a JetStream delivery
        delivered = 1
    headers = dict(raw.headers or {})
    try:
        origin = headers.get("Nats-Msg-Id") or f"seq{raw.metadata.sequence.stream}"
    except (nats.errors.NotJSMessageError, ValueError, IndexError):  # not a JetStream delivery
        origin = headers.get("Nats-Msg-Id") or new_msg_id()
    letter = DeadLetter(
        # derived id: a crash between this publish and the term cannot dead-letter twice
        run_id=reg.run_id,
        msg_id=f"dlq-{stage}-{origin}-{delivered}",
        stage=stage,
        reason=reason,
        error_type=error_type,
        original_subject=raw.subject,
        original_data=raw.data or b"",
        original_headers=headers,
        original_msg_id=headers.get("Nats-Msg-Id"),
        delivery_count=delivered,
        task_msg_id=task_msg_id,
    )
    await publish(js, reg.dlq(stage), letter)
    await raw.term()
    log.warning("bus.dead_lettered", stage=stage, reason=reason, error_type=error_type, subject=raw.subject)


def _task_msg_id_of(msg: Message) -> str | None:
    if hasattr(msg, "task_msg_id"):
        return msg.task_msg_id
    traj = getattr(msg, "trajectory", None)
    if traj is not None:
        return traj.task_msg_id
    if msg.KIND == "task":
        return msg.msg_id
    return None


async def decode_batch(
    js: JetStreamContext, reg: Registry, stage: str, raws: Sequence[Msg], expect: type[Message]
) -> list[Delivery]:
    """Decode fetched messages; dead-letter undecodable and foreign ones; return the rest."""
    good: list[Delivery] = []
    for raw in raws:
        try:
            msg = decode(raw.data, expect)
        except DecodeError as exc:
            await dead_letter(js, reg, stage, raw, f"decode error in {exc.field}: {exc.reason}", "decode_error")
            continue
        if msg.run_id != reg.run_id:
            await dead_letter(
                js,
                reg,
                stage,
                raw,
                f"message of run {msg.run_id!r} on run {reg.run_id!r}",
                "foreign_run",
                _task_msg_id_of(msg),
            )
            continue
        good.append(Delivery(raw, msg))
    return good


async def fetch(sub, batch: int, timeout: float) -> list[Msg]:
    """Fetch up to `batch` messages; an idle time-out returns [], and so does a consumer that is
    briefly unavailable (503: its stream electing a leader in a cluster), after a short pause."""
    try:
        return await sub.fetch(batch, timeout=timeout)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []
    except nats.js.errors.ServiceUnavailableError:
        await asyncio.sleep(min(timeout, 0.5))
        return []


async def outcome_of(call: Awaitable[object]) -> Outcome:
    """Await a handler call: None when it returned None (ack), the Retry or Reject it raised.
    Any other exception propagates, and a returned value is a TypeError (a handler bug)."""
    try:
        returned = await call
    except (Retry, Reject) as exc:
        return exc
    if returned is not None:
        raise TypeError(f"handler returned {returned!r}: return None to ack, raise Retry or Reject otherwise")
    return None


async def apply_outcome(js: JetStreamContext, reg: Registry, stage: str, d: Delivery, outcome: Outcome) -> str:
    """Acknowledge one delivery according to its outcome; return the outcome's name."""
    if isinstance(outcome, Retry):
        await d.raw.nak(delay=outcome.delay)
        log.info("bus.retry", stage=stage, delay=outcome.delay, reason=outcome.reason, delivered=d.delivered)
        return "retry"
    if isinstance(outcome, Reject):
        await dead_letter(js, reg, stage, d.raw, outcome.reason, outcome.error_type, _task_msg_id_of(d.msg))
        return "reject"
    await d.raw.ack()
    return "ack"


def keep_alive(held: Collection[Delivery], ack_wait_s: float) -> asyncio.Task:
    """Start the keep-alive of both loops: until the returned task is cancelled, every delivery
    in `held` at each beat (a live view may change) gets `in_progress`, every third of ack_wait
    (but no more often than every 0.5 s)."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(max(0.5, ack_wait_s / 3))
            for d in list(held):
                await d.raw.in_progress()

    return asyncio.create_task(beat())


BatchHandler = Callable[[list[Delivery]], Awaitable[None]]


async def _fetch_decoded(
    js: JetStreamContext,
    reg: Registry,
    stage: str,
    sub,
    expect: type[Message],
    want: int,
    timeout: float,
    counters: dict[str, float],
) -> tuple[int, list[Delivery]]:
    """(messages fetched, the usable ones decoded); the rest are dead-lettered and counted."""
    raws = await fetch(sub, want, timeout)
    deliveries = await decode_batch(js, reg, stage, raws, expect) if raws else []
    counters["dead_lettered"] = counters.get("dead_lettered", 0) + len(raws) - len(deliveries)
    return len(raws), deliveries


async def run_pull_loop(
    js: JetStreamContext,
    reg: Registry,
    stage: str,
    sub,
    expect: type[Message],
    handler: BatchHandler,
    *,
    batch: int = 64,
    fetch_timeout: float = 1.0,
    ack_wait_s: float = 30.0,
    max_messages: int | None = None,
    until_idle: float | None = None,
    stop: asyncio.Event | None = None,
    counters: dict[str, float] | None = None,
) -> dict[str, float]:
    """Run `handler` over batches until `stop`, `max_messages` (fetched) or `until_idle` seconds idle;
    its outcome (return, or a raised Retry/Reject) applies to the whole batch."""
    counters = counters if counters is not None else {}
    seen, last_work = 0, time.monotonic()
    while not (stop and stop.is_set()):
        if max_messages is not None and seen >= max_messages:
            break
        want = batch if max_messages is None else max(1, min(batch, max_messages - seen))
        fetched, deliveries = await _fetch_decoded(js, reg, stage, sub, expect, want, fetch_timeout, counters)
        if not fetched:
            if until_idle is not None and time.monotonic() - last_work >= until_idle:
                break
            continue
        last_work = time.monotonic()
        seen += fetched
        if not deliveries:
            continue
        keeper = keep_alive(deliveries, ack_wait_s)
        try:
            outcome = await outcome_of(handler(deliveries))
        finally:
            keeper.cancel()
        for d in deliveries:
            name = await apply_outcome(js, reg, stage, d, outcome)
            counters[name] = counters.get(name, 0) + 1
    return counters


MessageHandler = Callable[[Delivery], Awaitable[None]]


async def run_pull_stream(
    js: JetStreamContext,
    reg: Registry,
    stage: str,
    sub,
    expect: type[Message],
    handler: MessageHandler,
    *,
    inflight: int = 64,
    fetch_batch: int | None = None,
    fetch_timeout: float = 1.0,
    ack_wait_s: float = 30.0,
    max_messages: int | None = None,
    until_idle: float | None = None,
    stop: asyncio.Event | None = None,
    counters: dict[str, float] | None = None,
) -> dict[str, float]:
    """Run `handler` on each message concurrently, at most `inflight` at once, acking each as it ends.

    Stops on `stop`, after `max_messages` fetched messages, or when nothing was fetched
    and nothing ran for `until_idle` seconds; it then lets the running handlers finish
    (their outcomes are applied) before returning. Every running message gets
    `in_progress` at a third of ack_wait. A handler bug (any exception other than
    Retry/Reject) cancels the others, unacked, and propagates.
    """
    counters = counters if counters is not None else {}
    active: dict[asyncio.Task, Delivery] = {}
    finished: list[asyncio.Task] = []
    seen, last_work = 0, time.monotonic()
    inflight = max(1, inflight)

    async def one(d: Delivery) -> None:
        name = await apply_outcome(js, reg, stage, d, await outcome_of(handler(d)))
        counters[name] = counters.get(name, 0) + 1

    def reap() -> None:
        while finished:
            task = finished.pop()
            active.pop(task, None)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error

    keeper = keep_alive(active.values(), ack_wait_s)  # the messages running at each beat
    try:
        while not (stop and stop.is_set()):
            reap()
            if max_messages is not None and seen >= max_messages:
                break
            room = inflight - len(active)
            if room <= 0:
                await asyncio.wait(list(active), return_when=asyncio.FIRST_COMPLETED)
                continue
            want = min(room, fetch_batch or room)
            if max_messages is not None:
                want = max(1, min(want, max_messages - seen))
            fetched, deliveries = await _fetch_decoded(js, reg, stage, sub, expect, want, fetch_timeout, counters)
            if not fetched:
                if active:
                    last_work = time.monotonic()
                elif until_idle is not None and time.monotonic() - last_work >= until_idle:
                    break
                continue
            last_work = time.monotonic()
            seen += fetched
            for d in deliveries:
                task = asyncio.create_task(one(d))
                active[task] = d
                task.add_done_callback(finished.append)
        if active:
            await asyncio.wait(list(active))
        reap()
    finally:
        keeper.cancel()
        for task in active:
            task.cancel()
    return counters
