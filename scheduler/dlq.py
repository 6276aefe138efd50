"""Dead letters: capture JetStream MAX_DELIVERIES advisories, list, show and replay.

Capture. JetStream publishes `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`
when a consumer gives up on a message. `capture_max_deliveries` subscribes (core NATS) to
those advisories for the run's TASKS, TRAJ and REWARDS streams, fetches the original
message by sequence, publishes a `DeadLetter` (error_type `max_deliveries`, reason
`exceeded max_deliver=N`, the delivery count, original subject, bytes and headers, and
the task's msg_id when the payload decodes) to `dlq.<run>.<stage>` (TASKS -> rollout,
TRAJ -> verifier, REWARDS -> learner), and then deletes the message from the work
stream (TASKS, TRAJ). REWARDS is a log that other durables (scheduler, recorder) also
read, so its entry is kept; the dead letter is the record that the learner gave up on it.

Guarantees:
- The DeadLetter's msg_id is derived from stream + sequence (`dlq-max-<stream>-<seq>`):
  a repeated advisory (or a restarted capture) is de-duplicated by JetStream.
- The original is deleted only after the DeadLetter is stored (publish ack), so a
  crash in between never loses the message (at worst it is dead-lettered twice, and
  the second copy is de-duplicated within the stream's duplicate window).
- An advisory whose message is already gone (acked late, deleted) is logged and skipped.
- Core subscription: advisories emitted while no capture runs are not seen. The
  message then stays in its work stream (nothing is lost) until an operator acts.

Replay. `replay` republishes a letter's `original_data` to its `original_subject` with
its original headers, except that `Nats-Msg-Id` becomes `<original>.replay-<dlq seq>`
and `Rlbus-Replay-Of: <dlq seq>` / `Rlbus-Original-Msg-Id: <original>` are added: the
suffix keeps JetStream's duplicate window from swallowing the republish (the original
id was already stored), while replaying the same letter twice within the window is still
stored once. The payload (and its envelope `msg_id`) is byte-for-byte the original. Each
replay is recorded in the run's KV bucket under `dlq.replayed.<seq>`.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, NotFoundError

from bus.kv import DLQ_REPLAYED
from bus.publish import publish
from bus.streams import iter_stream
from bus.subjects import Registry
from schemas import DeadLetter, DecodeError, decode

log = structlog.get_logger()

ADVISORY_PREFIX = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"
STAGE_OF_FAMILY = {"TASKS": "rollout", "TRAJ": "verifier", "REWARDS": "learner"}
DELETE_FAMILIES = ("TASKS", "TRAJ")
REPLAY_OF_HEADER = "Rlbus-Replay-Of"
ORIGINAL_ID_HEADER = "Rlbus-Original-Msg-Id"


def advisory_subject(stream: str, consumer: str = "*") -> str:
    """Subject of a stream's MAX_DELIVERIES advisories (any consumer by default)."""
    return f"{ADVISORY_PREFIX}.{stream}.{consumer}"


def task_msg_id_of(data: bytes) -> str | None:
    """The msg_id of the task a payload traces back to, when it decodes."""
    try:
        msg = decode(data)
    except DecodeError:
        return None
    if msg.KIND == "task":
        return msg.msg_id
    if hasattr(msg, "task_msg_id"):
        return msg.task_msg_id
    traj = getattr(msg, "trajectory", None)
    return getattr(traj, "task_msg_id", None)


async def dead_letter_by_seq(
    js: JetStreamContext,
    reg: Registry,
    stream: str,
    seq: int,
    deliveries: int,
    max_deliver: int | None = None,
    consumer: str = "",
) -> DeadLetter | None:
    """Copy stream message `seq` into the DLQ as a max-deliveries letter, then delete it
    from a work stream. Returns the letter, or None when the message is already gone."""
    family = stream[: -len(reg.run_id) - 1] if stream.endswith(f"_{reg.run_id}") else stream
    stage = STAGE_OF_FAMILY.get(family, "scheduler")
    try:
        raw = await js.get_msg(stream, seq)
    except NotFoundError:
        log.warning("dlq.advisory_message_gone", stream=stream, seq=seq, consumer=consumer)
        return None
    headers = {str(k): str(v) for k, v in (raw.headers or {}).items()}
    limit = max_deliver if max_deliver is not None else deliveries
    letter = DeadLetter(
        run_id=reg.run_id,
        msg_id=f"dlq-max-{stream}-{seq}",
        stage=stage,
        reason=f"exceeded max_deliver={limit}" + (f" on consumer {consumer}" if consumer else ""),
        error_type="max_deliveries",
        original_subject=raw.subject or "",
        original_data=raw.data or b"",
        original_headers=headers,
        original_msg_id=headers.get("Nats-Msg-Id"),
        delivery_count=deliveries,
        task_msg_id=task_msg_id_of(raw.data or b""),
    )
    await publish(js, reg.dlq(stage), letter)
    if family in DELETE_FAMILIES:
        try:
            await js.delete_msg(stream, seq)
        except NotFoundError:
            pass
    log.warning("dlq.max_deliveries", stream=stream, seq=seq, consumer=consumer, deliveries=deliveries, stage=stage)
    return letter


async def capture_max_deliveries(
    js: JetStreamContext, reg: Registry, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> int:
    """Move every max-deliveries message of the run's TASKS/TRAJ/REWARDS to the DLQ until
    `stop` is set; return how many were dead-lettered. `ready` is set once subscribed."""
    nc = js._nc
    queue: asyncio.Queue = asyncio.Queue()

    async def on_advisory(msg):
        await queue.put(msg.data)

    subs = [await nc.subscribe(advisory_subject(reg.stream(f)), cb=on_advisory) for f in STAGE_OF_FAMILY]
    await nc.flush()
    if ready is not None:
        ready.set()
    captured = 0
    stopper = asyncio.create_task(stop.wait())
    try:
        while not stop.is_set():
            getter = asyncio.create_task(queue.get())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            try:
                adv = json.loads(getter.result())
                stream, seq = adv["stream"], int(adv["stream_seq"])
                deliveries = int(adv.get("deliveries", 0))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("dlq.bad_advisory", error=str(exc))
                continue
            max_deliver = await _max_deliver(js, stream, adv.get("consumer", ""))
            if await dead_letter_by_seq(js, reg, stream, seq, deliveries, max_deliver, adv.get("consumer", "")):
                captured += 1
    finally:
        stopper.cancel()
        for sub in subs:
            await sub.unsubscribe()
    return captured


async def _max_deliver(js: JetStreamContext, stream: str, consumer: str) -> int | None:
    try:
        info = await js.consumer_info(stream, consumer)
    except (APIError, nats.errors.TimeoutError):  # e.g. the consumer was deleted since: the advisory's count stands in
        return None
    return info.config.max_deliver


# -- inspecting ----------------------------------------------------------------------
async def list_letters(js: JetStreamContext, reg: Registry) -> list[tuple[int, DeadLetter]]:
    """Every stored dead letter of the run as (DLQ stream sequence, letter), oldest first."""
    out: list[tuple[int, DeadLetter]] = []
    try:
        async for seq, data in iter_stream(js, reg.stream("DLQ"), reg.all("dlq")):
            try:
                out.append((seq, decode(data, DeadLetter)))
            except DecodeError as exc:
                log.warning("dlq.undecodable_letter", seq=seq, error=str(exc))
    except NotFoundError:
        return []
    return out


async def show(js: JetStreamContext, reg: Registry, seq: int) -> DeadLetter:
    """The dead letter at DLQ sequence `seq` (KeyError if there is none)."""
    try:
        raw = await js.get_msg(reg.stream("DLQ"), seq)
    except NotFoundError:
        raise KeyError(f"no dead letter at sequence {seq} in {reg.stream('DLQ')}") from None
    return decode(raw.data or b"", DeadLetter)


async def replayed(js: JetStreamContext, reg: Registry, seq: int) -> dict | None:
    """The replay record of DLQ sequence `seq`, or None if it was never replayed."""
    kv = await js.key_value(reg.kv_bucket)
    try:
        entry = await kv.get(DLQ_REPLAYED.format(seq=seq))
    except (KeyNotFoundError, NotFoundError):
        return None
    return json.loads(entry.value) if entry and entry.value else None


async def replay(js: JetStreamContext, reg: Registry, seqs: list[int]) -> int:
    """Republish the originals of the given letters to their original subjects; record each
    replay in KV; return how many the streams stored (duplicates within the window aren't)."""
    kv = await js.key_value(reg.kv_bucket)
    stored = 0
    for seq in seqs:
        letter = await show(js, reg, seq)
        original = letter.original_msg_id or letter.original_headers.get("Nats-Msg-Id") or f"dlq{seq}"
        headers = {
            **letter.original_headers,
            "Nats-Msg-Id": f"{original}.replay-{seq}",
            REPLAY_OF_HEADER: str(seq),
            ORIGINAL_ID_HEADER: original,
        }
        ack = await js.publish(letter.original_subject, letter.original_data, headers=headers, timeout=10.0)
        stored += 0 if ack.duplicate else 1
        record = {
            "seq": seq,
            "subject": letter.original_subject,
            "msg_id": headers["Nats-Msg-Id"],
            "stream": ack.stream,
            "stream_seq": ack.seq,
            "duplicate": bool(ack.duplicate),
            "replayed_at": time.time(),
        }
        await kv.put(DLQ_REPLAYED.format(seq=seq), json.dumps(record).encode())
        log.info("dlq.replayed", **record)
    return stored
