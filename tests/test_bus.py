"""Integration tests of `bus/` against the session's real nats-server (in-process, fast).

Covers: a typed round trip through every stream via the Registry's subjects, the
explicit stream settings, idempotent topology, Nats-Msg-Id de-duplication, every
outcome of `run_pull_loop` (return = ack, raised Retry / Reject, per message and for a
whole batch), a returned value as a handler bug, dead-lettering of undecodable and
foreign messages, and redelivery after ack_wait.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import nats.errors
import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy

from bus.conn import ensure_topology, pull_subscription
from bus.kv import get_json, put_json
from bus.publish import publish, publish_many
from bus.pull import Delivery, Reject, Retry, run_pull_loop, run_pull_stream
from bus.streams import iter_stream
from bus.subjects import DAY, ConsumerSpec, Registry
from schemas import DeadLetter, EvalResult, Reward, Task, TaskFate, TaskFates, WeightVersion, decode, encode
from tests.conftest import settled_consumer
from tests.messages import make_task, make_trajectory

GARBAGE = b"\xc1\xc1 this is not msgpack \xff"


# -- helpers -------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards


async def topology(js, run_id: str) -> Registry:
    """A Registry with its streams, KV and object store created."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    return reg


def loop_spec(reg: Registry, durable: str, ack_wait_s: float) -> ConsumerSpec:
    """A short-ack_wait durable on the run's tasks (explicit, no backoff)."""
    return ConsumerSpec(reg.stream("TASKS"), durable, reg.all("tasks"), ack_wait_s, 5, (), 100)


async def dead_letters(js, reg: Registry, stage: str) -> list[DeadLetter]:
    return [decode(data, DeadLetter) async for _, data in iter_stream(js, reg.stream("DLQ"), reg.dlq(stage))]


# -- round trips, stream settings, topology --------------------------------------------


async def test_round_trip_through_every_stream(js, run_id):
    reg = await topology(js, run_id)
    task = make_task(run_id)
    traj = make_trajectory(run_id, task)
    reward = Reward(
        run_id=run_id,
        msg_id=f"rw-{traj.msg_id}",
        trajectory=traj,
        reward=1.0,
        components={"correct": 1.0, "format": 1.0},
        details="answer=5",
        verify_seconds=0.01,
    )
    weights = WeightVersion(
        run_id=run_id,
        version=2,
        step=7,
        uri=f"nats-object://{reg.object_bucket}/v000002",
        sha256="ab" * 32,
        bytes=123,
        metrics={"loss": 0.5},
    )
    result = EvalResult(run_id=run_id, version=2, step=7, domain="arith", score=0.25, n=8, eval_set_sha256="cd" * 32)
    letter = DeadLetter(
        run_id=run_id,
        stage="rollout",
        reason="why not",
        original_subject=reg.tasks("arith"),
        original_data=b"\x00\x01raw",
        original_headers={"Nats-Msg-Id": "x"},
        original_msg_id="x",
    )
    fates = TaskFates(run_id=run_id, stage="sampler", fates=[TaskFate(task_msg_id=task.msg_id, fate="published")])

    # work streams and the REWARDS log: through the registry's own durable consumers
    for subject, msg, spec in [
        (reg.tasks("arith"), task, reg.rollout_consumer(ack_wait_s=5)),
        (reg.traj("arith"), traj, reg.verifier_consumer(ack_wait_s=5)),
        (reg.rewards("arith"), reward, reg.learner_consumer(ack_wait_s=5)),
    ]:
        ack = await publish(js, subject, msg)
        assert ack.stream == spec.stream
        sub = await pull_subscription(js, spec)
        [raw] = await sub.fetch(1, timeout=5)
        assert raw.subject == subject
        assert raw.headers["Nats-Msg-Id"] == msg.msg_id
        got = decode(raw.data, type(msg))
        assert got == msg
        assert got.model_dump() == msg.model_dump()
        await raw.ack_sync()
        await sub.unsubscribe()

    # the other streams: read back without consumers
    for family, subject, msg in [
        ("WEIGHTS", reg.weights, weights),
        ("EVAL", reg.eval("arith"), result),
        ("DLQ", reg.dlq("rollout"), letter),
        ("LEDGER", reg.ledger("sampler"), fates),
    ]:
        ack = await publish(js, subject, msg)
        assert ack.stream == reg.stream(family)
        stored = [data async for _, data in iter_stream(js, reg.stream(family), subject)]
        assert len(stored) == 1
        got = decode(stored[0], type(msg))
        assert got == msg

    # acked work is gone from the WorkQueue streams; the REWARDS log keeps its message
    for family, left in [("TASKS", 0), ("TRAJ", 0), ("REWARDS", 1)]:
        assert (await js.stream_info(reg.stream(family))).state.messages == left, family


async def test_stream_configs_are_explicit(js, run_id):
    reg = await topology(js, run_id)
    lim = reg.limits
    cfg = {
        f: (await js.stream_info(reg.stream(f))).config
        for f in ("TASKS", "TRAJ", "REWARDS", "WEIGHTS", "EVAL", "DLQ", "LEDGER")
    }

    for family, subject, cap in [
        ("TASKS", f"tasks.{run_id}.>", lim.tasks_max_msgs),
        ("TRAJ", f"traj.{run_id}.>", lim.traj_max_msgs),
    ]:
        c = cfg[family]
        assert c.subjects == [subject]
        assert c.retention == RetentionPolicy.WORK_QUEUE, family
        assert c.discard == DiscardPolicy.NEW, family
        assert c.max_msgs == cap and cap > 0, family
        assert c.max_bytes == lim.work_max_bytes and lim.work_max_bytes > 0, family

    assert cfg["REWARDS"].subjects == [f"rewards.{run_id}.>"]
    assert cfg["WEIGHTS"].subjects == [f"weights.{run_id}"]
    assert cfg["DLQ"].subjects == [f"dlq.{run_id}.>"]
    for family in ("REWARDS", "WEIGHTS", "EVAL", "DLQ", "LEDGER"):
        assert cfg[family].retention == RetentionPolicy.LIMITS, family
    # the reward log is bounded by age, never by bytes (a byte cap would discard unread rewards)
    assert cfg["REWARDS"].max_bytes in (None, -1)
    assert cfg["REWARDS"].max_age == pytest.approx(30 * DAY)
    assert cfg["WEIGHTS"].max_msgs == lim.weights_keep > 0
    assert cfg["DLQ"].max_age == pytest.approx(90 * DAY)
    for family, c in cfg.items():
        assert c.duplicate_window == pytest.approx(120.0), family


async def test_ensure_topology_twice_is_idempotent(js, run_id):
    reg = await topology(js, run_id)
    before = {c.name: (await js.stream_info(c.name)).config.as_dict() for c in reg.streams()}
    task = make_task(run_id)
    await publish(js, reg.tasks("arith"), task)
    await publish(js, reg.ledger("sampler"), TaskFates(run_id=run_id, stage="sampler", fates=[]))
    await put_json(js, reg, "status", {"phase": "rl"})

    await ensure_topology(js, reg)

    after = {c.name: (await js.stream_info(c.name)).config.as_dict() for c in reg.streams()}
    assert after == before
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 1
    assert (await js.stream_info(reg.stream("LEDGER"))).state.messages == 1
    assert await get_json(js, reg, "status") == {"phase": "rl"}
    await js.object_store(reg.object_bucket)  # still there


async def test_same_msg_id_is_stored_once(js, run_id):
    reg = await topology(js, run_id)
    task, other = make_task(run_id), make_task(run_id, task_id="arith-1-1")
    first = await publish(js, reg.tasks("arith"), task)
    again = await publish(js, reg.tasks("arith"), task)
    assert not first.duplicate
    assert again.duplicate and again.seq == first.seq
    acks = await publish_many(js, [(reg.tasks("arith"), task), (reg.tasks("arith"), other)])
    assert [bool(a.duplicate) for a in acks] == [True, False]
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 2


# -- run_pull_loop outcomes -------------------------------------------------------------


async def test_pull_loop_outcomes(js, run_id):
    reg = await topology(js, run_id)
    tasks = {name: make_task(run_id, task_id=name) for name in ("ack", "retry", "reject")}
    for t in tasks.values():
        await publish(js, reg.tasks("arith"), t)
    seen: list[tuple[str, int, float]] = []

    async def handler(batch: list[Delivery]) -> None:  # batch=1: each message its own outcome
        [d] = batch
        name = d.msg.task_id
        seen.append((name, d.delivered, time.monotonic()))
        if name == "retry" and d.delivered == 1:
            raise Retry(0.8, "busy")
        if name == "reject":
            raise Reject("expression unusable: 2++", "rejected")

    # ack_wait 2 s and 3.5 s of idleness: anything not acked/termed would come back
    sub = await pull_subscription(js, loop_spec(reg, "loop", ack_wait_s=2.0))
    counters = await run_pull_loop(
        js, reg, "rollout", sub, Task, handler, batch=1, fetch_timeout=0.3, ack_wait_s=2.0, until_idle=3.5
    )

    by_name = {n: [(c, t) for m, c, t in seen if m == n] for n in tasks}
    assert [c for c, _ in by_name["ack"]] == [1]
    assert [c for c, _ in by_name["reject"]] == [1], "a rejected message must not be redelivered"
    assert [c for c, _ in by_name["retry"]] == [1, 2]
    gap = by_name["retry"][1][1] - by_name["retry"][0][1]
    assert 0.6 <= gap < 1.8, f"Retry(0.8) redelivered after {gap:.2f}s (ack_wait is 2 s)"
    assert counters.get("ack") == 2 and counters.get("retry") == 1 and counters.get("reject") == 1, counters

    [letter] = await dead_letters(js, reg, "rollout")
    assert letter.reason == "expression unusable: 2++"
    assert letter.error_type == "rejected"
    assert letter.stage == "rollout"
    assert letter.original_data == encode(tasks["reject"])
    assert letter.original_subject == reg.tasks("arith")
    assert letter.original_msg_id == tasks["reject"].msg_id
    assert letter.task_msg_id == tasks["reject"].msg_id
    assert letter.delivery_count == 1

    info = await settled_consumer(js, reg.stream("TASKS"), "loop")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_pull_loop_outcome_applies_to_the_whole_batch(js, run_id):
    """A batch handler has one outcome: a raised Retry naks, and a raised Reject dead-letters,
    every message of the batch."""
    reg = await topology(js, run_id)
    tasks = [make_task(run_id, task_id=f"t{i}") for i in range(3)]
    for t in tasks:
        await publish(js, reg.tasks("arith"), t)
    calls: list[list[int]] = []

    async def handler(batch: list[Delivery]) -> None:
        calls.append([d.delivered for d in batch])
        if len(calls) == 1:
            raise Retry(0.3, "busy")
        raise Reject("batch unusable")

    sub = await pull_subscription(js, loop_spec(reg, "whole", ack_wait_s=2.0))
    counters = await run_pull_loop(
        js, reg, "rollout", sub, Task, handler, batch=3, fetch_timeout=0.3, ack_wait_s=2.0, until_idle=2.5
    )
    assert calls[0] == [1, 1, 1], calls
    assert all(c == 2 for call in calls[1:] for c in call) and sum(map(len, calls[1:])) == 3, calls
    assert counters.get("retry") == 3 and counters.get("reject") == 3 and "ack" not in counters, counters
    letters = await dead_letters(js, reg, "rollout")
    assert sorted(dl.task_msg_id for dl in letters) == sorted(t.msg_id for t in tasks)
    assert {dl.reason for dl in letters} == {"batch unusable"}
    info = await settled_consumer(js, reg.stream("TASKS"), "whole")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_returned_outcome_is_a_handler_bug(js, run_id):
    """Outcomes are raised: a handler that returns anything but None raises TypeError in
    either loop, and its message is left unacked (redelivered after ack_wait)."""
    reg = await topology(js, run_id)
    await publish(js, reg.tasks("arith"), make_task(run_id, task_id="a"))
    await publish(js, reg.tasks("arith"), make_task(run_id, task_id="b"))

    async def returns_list(batch: list[Delivery]):
        return [None] * len(batch)

    async def returns_retry(d: Delivery):
        return Retry(0.1, "returned, not raised")

    sub = await pull_subscription(js, loop_spec(reg, "returned", ack_wait_s=30))
    with pytest.raises(TypeError, match="raise Retry or Reject"):
        await run_pull_loop(
            js, reg, "rollout", sub, Task, returns_list, batch=1, fetch_timeout=0.3, ack_wait_s=30, until_idle=5
        )
    with pytest.raises(TypeError, match="raise Retry or Reject"):
        await run_pull_stream(
            js, reg, "rollout", sub, Task, returns_retry, inflight=1, fetch_timeout=0.3, ack_wait_s=30, until_idle=5
        )
    info = await js.consumer_info(reg.stream("TASKS"), "returned")
    assert info.num_ack_pending == 2 and info.num_redelivered == 0, "neither message may be acked or nak'd"
    assert await dead_letters(js, reg, "rollout") == []


async def test_pull_stream_acks_each_message_as_it_finishes(js, run_id):
    """No batch barrier: fast messages are acked while a slow one fetched with them still runs,
    and the outcomes (ack / Retry / Reject) apply per message."""
    reg = await topology(js, run_id)
    names = ["slow", "retry", "reject"] + [f"fast{i}" for i in range(5)]
    for name in names:
        await publish(js, reg.tasks("arith"), make_task(run_id, task_id=name))
    acked_at: dict[str, float] = {}
    deliveries: dict[str, list[int]] = {}
    running, peak = 0, 0

    async def handler(d: Delivery):
        nonlocal running, peak
        name = d.msg.task_id
        deliveries.setdefault(name, []).append(d.delivered)
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(2.5 if name == "slow" else 0.05)
        finally:
            running -= 1
        if name == "retry" and d.delivered == 1:
            raise Retry(0.3, "busy")
        if name == "reject":
            raise Reject("unusable", "rejected")
        acked_at[name] = time.monotonic()

    sub = await pull_subscription(js, loop_spec(reg, "stream", ack_wait_s=1.2))
    t0 = time.monotonic()
    counters = await run_pull_stream(
        js,
        reg,
        "rollout",
        sub,
        Task,
        handler,
        inflight=4,
        fetch_batch=8,
        fetch_timeout=0.2,
        ack_wait_s=1.2,
        until_idle=1.0,
    )
    assert peak == 4, f"at most `inflight` handlers at once, and that many when work waits (peak {peak})"
    fast_done = max(acked_at[f"fast{i}"] for i in range(5)) - t0
    assert fast_done < 1.5, f"fast messages waited for the slow one ({fast_done:.2f}s)"
    assert acked_at["slow"] - t0 >= 2.4
    # the slow handler outlived ack_wait (1.2 s) but in_progress kept it from being redelivered
    assert deliveries["slow"] == [1] and deliveries["retry"] == [1, 2] and deliveries["reject"] == [1]
    assert counters.get("ack") == 7 and counters.get("retry") == 1 and counters.get("reject") == 1, counters
    [letter] = await dead_letters(js, reg, "rollout")
    assert letter.reason == "unusable"
    info = await settled_consumer(js, reg.stream("TASKS"), "stream")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_pull_stream_propagates_a_handler_bug_without_acking(js, run_id):
    reg = await topology(js, run_id)
    for name in ("ok", "bug"):
        await publish(js, reg.tasks("arith"), make_task(run_id, task_id=name))

    async def handler(d: Delivery):
        if d.msg.task_id == "bug":
            raise ZeroDivisionError("handler bug")
        await asyncio.sleep(5)
        return None

    sub = await pull_subscription(js, loop_spec(reg, "bug", ack_wait_s=30))
    with pytest.raises(ZeroDivisionError):
        await run_pull_stream(
            js, reg, "rollout", sub, Task, handler, inflight=4, fetch_timeout=0.2, ack_wait_s=30, until_idle=10
        )
    info = await js.consumer_info(reg.stream("TASKS"), "bug")
    assert info.num_ack_pending == 2, "neither the buggy nor the cancelled message may be acked"


async def test_undecodable_and_foreign_messages_are_dead_lettered(js, run_id):
    reg = await topology(js, run_id)
    subject = reg.tasks("arith")
    good = make_task(run_id, task_id="good")
    body = msgpack.unpackb(encode(make_task(run_id, task_id="future")))
    body["schema_version"] = 99
    wrong_version = msgpack.packb(body, use_bin_type=True)
    foreign = make_task("someotherrun", task_id="foreign")
    await js.publish(subject, GARBAGE)
    await js.publish(subject, wrong_version)
    await publish(js, subject, foreign)
    await publish(js, subject, good)

    handled: list[str] = []

    async def handler(batch: list[Delivery]):
        handled.extend(d.msg.task_id for d in batch)

    sub = await pull_subscription(js, loop_spec(reg, "decode", ack_wait_s=1.0))
    counters = await run_pull_loop(
        js, reg, "rollout", sub, Task, handler, batch=2, fetch_timeout=0.3, ack_wait_s=1.0, until_idle=2.0
    )

    assert handled == ["good"]
    assert counters.get("dead_lettered") == 3 and counters.get("ack") == 1, counters
    letters = {bytes(dl.original_data): dl for dl in await dead_letters(js, reg, "rollout")}
    assert len(letters) == 3
    garbage, version, alien = letters[GARBAGE], letters[wrong_version], letters[encode(foreign)]
    assert garbage.error_type == "decode_error" and "<payload>" in garbage.reason
    assert version.error_type == "decode_error" and "schema_version" in version.reason and "99" in version.reason
    assert alien.error_type == "foreign_run" and "someotherrun" in alien.reason
    assert alien.original_msg_id == foreign.msg_id
    for dl in letters.values():
        assert dl.original_subject == subject and dl.stage == "rollout" and dl.run_id == run_id
    info = await settled_consumer(js, reg.stream("TASKS"), "decode")
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 0


async def test_unacked_message_is_redelivered_after_ack_wait(js, run_id):
    reg = await topology(js, run_id)
    task = make_task(run_id)
    await publish(js, reg.tasks("arith"), task)
    sub = await pull_subscription(js, loop_spec(reg, "slow", ack_wait_s=2.0))

    [first] = await sub.fetch(1, timeout=5)
    fetched_at = time.monotonic()
    assert first.metadata.num_delivered == 1
    with pytest.raises(nats.errors.TimeoutError):  # nothing to deliver before ack_wait runs out
        await sub.fetch(1, timeout=0.5)
    [again] = await sub.fetch(1, timeout=5)
    assert time.monotonic() - fetched_at >= 1.7
    assert again.metadata.num_delivered == 2
    assert again.metadata.sequence.stream == first.metadata.sequence.stream
    assert decode(again.data, Task) == task
    await again.ack_sync()
    info = await settled_consumer(js, reg.stream("TASKS"), "slow")
    assert info.num_ack_pending == 0
