"""Per-message accounting against a real NATS server: every published task gets exactly one
fate from positive evidence, a task with none is `lost`, and a reward trained twice is counted."""

from __future__ import annotations

import pytest

from bus.conn import ensure_consumer, ensure_topology
from bus.publish import publish
from bus.subjects import Registry
from rlbus.run.accounting import account
from schemas import (
    ChatMessage,
    DeadLetter,
    Reward,
    Task,
    TaskFate,
    TaskFates,
    Trajectory,
    Turn,
    decode,
    new_msg_id,
    pack_f32,
    pack_i32,
)

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards

DOMAIN = "arith"


def _task(run_id: str) -> Task:
    return Task(
        run_id=run_id,
        task_id=new_msg_id()[:8],
        domain=DOMAIN,
        group_size=2,
        verifier="arith",
        prompt=[ChatMessage(role="user", content="1+1=")],
    )


def _traj(run_id: str, task_msg_id: str) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        task_id="t",
        task_msg_id=task_msg_id,
        domain=DOMAIN,
        group_id=task_msg_id,
        group_size=2,
        sample_index=0,
        verifier="arith",
        policy_version=0,
        turns=[
            Turn(role="prompt", text="1+1=", token_ids=pack_i32([1, 2])),
            Turn(
                role="assistant",
                text="2",
                token_ids=pack_i32([3]),
                logprobs=pack_f32([-0.1]),
                trainable=True,
                policy_version=0,
            ),
        ],
    )


async def _ledger(js, reg: Registry, stage: str, *fates: TaskFate, step: int = -1) -> None:
    await publish(js, reg.ledger(stage), TaskFates(run_id=reg.run_id, stage=stage, step=step, fates=list(fates)))


async def _published(js, reg: Registry, ids: list[str]) -> None:
    await _ledger(js, reg, "sampler", *[TaskFate(task_msg_id=t, fate="published") for t in ids])


async def test_every_task_gets_one_fate_and_lost_is_evidence_based(js, run_id):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    queued = _task(run_id)  # still stored in TASKS
    trained, filtered, dead, lost = (new_msg_id() for _ in range(4))
    await _published(js, reg, [trained, filtered, dead, queued.msg_id, lost])

    r1, r2 = new_msg_id(), new_msg_id()
    await _ledger(
        js,
        reg,
        "learner",
        TaskFate(task_msg_id=trained, fate="trained", reward_msg_ids=[r1, r2]),
        TaskFate(task_msg_id=filtered, fate="filtered", reason="stale"),
        step=1,
    )
    letter = DeadLetter(
        run_id=run_id,
        stage="verifier",
        reason="verifier crashed",
        error_type="max_deliveries",
        original_subject=reg.traj(DOMAIN),
        original_data=b"x",
        task_msg_id=dead,
    )
    await publish(js, reg.dlq("verifier"), letter)
    await publish(js, reg.tasks(DOMAIN), queued)

    acc = await account(js, reg)
    assert acc.published == {trained, filtered, dead, queued.msg_id, lost}
    assert acc.fate == {trained: "trained", filtered: "filtered", dead: "dead_lettered", queued.msg_id: "in_flight"}
    assert acc.lost == [lost]
    assert acc.counts() == {"trained": 1, "filtered": 1, "dead_lettered": 1, "in_flight": 1, "lost": 1}
    assert dict(acc.filtered_reasons) == {"stale": 1}
    assert acc.dead_letters == 1 and acc.trained_twice == 0

    # accounting consumed nothing: the queued task is still there and no consumer was made
    tasks = await js.stream_info(reg.stream("TASKS"))
    assert tasks.state.messages == 1 and tasks.state.consumer_count == 0

    # a reward msg_id that appears in two `trained` records is counted once as trained twice
    await _ledger(js, reg, "learner", TaskFate(task_msg_id=trained, fate="trained", reward_msg_ids=[r1]), step=2)
    acc = await account(js, reg)
    assert acc.trained_twice == 1
    assert acc.fate[trained] == "trained" and acc.lost == [lost]


async def test_fate_precedence_and_other_in_flight_evidence(js, run_id):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    both, pending, in_traj, in_rewards, acked = (new_msg_id() for _ in range(5))
    await _published(js, reg, [both, pending, in_traj, in_rewards, acked])

    # filtered AND dead-lettered: filtered wins (learner evidence first)
    await _ledger(
        js,
        reg,
        "learner",
        TaskFate(task_msg_id=both, fate="filtered", reason="zero reward variance"),
        TaskFate(task_msg_id=pending, fate="pending"),
    )
    await publish(
        js,
        reg.dlq("rollout"),
        DeadLetter(
            run_id=run_id,
            stage="rollout",
            reason="r",
            original_subject=reg.tasks(DOMAIN),
            original_data=b"",
            task_msg_id=both,
        ),
    )
    await js.publish(reg.dlq("rollout"), b"\xc1 not a message")  # counted, not decodable
    await publish(js, reg.traj(DOMAIN), _traj(run_id, in_traj))
    # a reward the learner acked is no longer evidence; one it has not acked is
    await publish(js, reg.rewards(DOMAIN), Reward(run_id=run_id, trajectory=_traj(run_id, acked), reward=1.0))
    await publish(js, reg.rewards(DOMAIN), Reward(run_id=run_id, trajectory=_traj(run_id, in_rewards), reward=0.0))
    spec = reg.learner_consumer()
    await ensure_consumer(js, spec)
    sub = await js.pull_subscribe_bind(spec.durable, stream=spec.stream)
    (first,) = await sub.fetch(1, timeout=5)
    assert decode(first.data, Reward).trajectory.task_msg_id == acked
    await first.ack_sync()

    acc = await account(js, reg)
    assert acc.fate == {both: "filtered", pending: "in_flight", in_traj: "in_flight", in_rewards: "in_flight"}
    assert acc.lost == [acked]
    assert acc.dead_letters == 2
    assert dict(acc.filtered_reasons) == {"zero reward variance": 1}
    await sub.unsubscribe()
