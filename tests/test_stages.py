"""Stage tests with real worker processes (`rlbus worker ROLE`) on the session's nats-server.

Null engine / null policy, so no model is needed. Covers: each stage dead-letters
garbage and wrong-schema messages on its input subject and still does its valid work;
a task held by a killed rollout worker is redelivered to another worker after
ack_wait; the sampler's backpressure gate bounds the TASKS stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import msgpack
import pytest
from nats.js.errors import NotFoundError

from bus.conn import ensure_topology
from bus.kv import LEARNER_PROGRESS, get_json, put_json
from bus.publish import publish, publish_many
from bus.streams import iter_stream
from bus.subjects import Registry
from learner.weights import publish_version
from rollout_workers.engines.null_engine import NullEngine
from rollout_workers.worker import single_turn_trajectories
from schemas import DeadLetter, Reward, Task, TaskFates, Trajectory, WeightVersion, decode, encode
from tests.conftest import eventually, logs, settled_consumer
from tests.messages import make_task, store_checks

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards

GARBAGE = b"\xc1\xc1 this is not msgpack \xff"
GROUP_SIZE = 4

CONFIG = f"""
[sampler]
group_size = {GROUP_SIZE}
difficulty = 1
max_inflight_tasks = 5

[rollout]
engine = "null"
ack_wait_s = 3.0

[verifier]
ack_wait_s = 5.0

[learner]
policy = "null"
group_deadline_s = 2.0
step_window_s = 0.5
"""


# -- helpers -------------------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "stages.toml"
    path.write_text(CONFIG)
    return path


async def topology(js, run_id: str) -> Registry:
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    return reg


async def wait_exit(proc, timeout: float, tmp_path: Path) -> None:
    """Wait for a worker to exit on its own (test limits) with status 0."""

    async def exited():
        return proc.poll() is not None

    await eventually(exited, timeout, f"worker pid {proc.pid} to exit", tmp_path)
    assert proc.returncode == 0, f"worker exited with {proc.returncode}\n{logs(tmp_path)}"


async def wait_consumer(js, stream: str, durable: str, tmp_path: Path):
    async def exists():
        with contextlib.suppress(NotFoundError):
            return await js.consumer_info(stream, durable)

    return await eventually(exists, 30, f"durable {durable!r} on {stream}", tmp_path)


async def stored(js, reg: Registry, family: str, subject: str, cls):
    return [decode(data, cls) async for _, data in iter_stream(js, reg.stream(family), subject)]


def wrong_version(msg) -> bytes:
    """A valid MessagePack map of `msg` claiming schema_version 99."""
    body = msgpack.unpackb(encode(msg))
    body["schema_version"] = 99
    return msgpack.packb(body, use_bin_type=True)


def trajectories(task: Task, version: int = 0) -> list[Trajectory]:
    [samples] = NullEngine().generate(["2+3="], task.group_size, 4, 1.0)
    return single_turn_trajectories(task, samples, version, 0.0)


async def publish_bad(js, subject: str, valid) -> bytes:
    """Garbage bytes and a wrong-schema copy of `valid` onto `subject`; return the latter."""
    bad = wrong_version(valid)
    await js.publish(subject, GARBAGE)
    await js.publish(subject, bad)
    return bad


async def assert_bad_dead_lettered(js, reg: Registry, stage: str, subject: str, bad_version: bytes):
    letters = {bytes(dl.original_data): dl for dl in await stored(js, reg, "DLQ", reg.dlq(stage), DeadLetter)}
    assert set(letters) == {GARBAGE, bad_version}, f"{stage}: {[dl.reason for dl in letters.values()]}"
    garbage, version = letters[GARBAGE], letters[bad_version]
    assert garbage.error_type == "decode_error" and "<payload>" in garbage.reason
    assert version.error_type == "decode_error" and "schema_version" in version.reason and "99" in version.reason
    for dl in letters.values():
        assert dl.stage == stage and dl.original_subject == subject and dl.run_id == reg.run_id


# -- each stage dead-letters bad input and keeps working ----------------------------------


async def test_rollout_dead_letters_bad_tasks_and_rolls_out_good_ones(js, run_id, tmp_path, spawn_worker):
    reg = await topology(js, run_id)
    await publish_version(js, reg, None, 0, 0, {})  # rollout takes no task before a version
    proc = spawn_worker("rollout", run_id, write_config(tmp_path), "--max-messages", "3", "--until-idle", "30")
    await wait_consumer(js, reg.stream("TASKS"), "rollout", tmp_path)

    subject, task = reg.tasks("arith"), make_task(run_id, group_size=GROUP_SIZE)
    bad = await publish_bad(js, subject, task)
    await publish(js, subject, task)
    await wait_exit(proc, 60, tmp_path)

    await assert_bad_dead_lettered(js, reg, "rollout", subject, bad)
    trajs = await stored(js, reg, "TRAJ", reg.traj("arith"), Trajectory)
    assert len(trajs) == GROUP_SIZE
    assert sorted(t.sample_index for t in trajs) == list(range(GROUP_SIZE))
    assert {t.task_msg_id for t in trajs} == {task.msg_id}
    assert {t.policy_version for t in trajs} == {0}
    assert {t.verifier_params["expression"] for t in trajs} == {"2+3"}
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 0


async def test_verifier_dead_letters_bad_trajectories_and_scores_good_ones(js, run_id, tmp_path, spawn_worker):
    reg = await topology(js, run_id)
    proc = spawn_worker("verifier", run_id, write_config(tmp_path), "--max-messages", "4", "--until-idle", "30")
    await wait_consumer(js, reg.stream("TRAJ"), "verifier", tmp_path)

    subject = reg.traj("arith")
    task = make_task(run_id, group_size=GROUP_SIZE)
    await store_checks(js, reg, [task])
    right, wrong = trajectories(task)[:2]
    right = right.model_copy(update={"final_text": "5"})
    wrong = wrong.model_copy(update={"final_text": "7"})
    bad = await publish_bad(js, subject, right)
    await publish_many(js, [(subject, right), (subject, wrong)])
    await wait_exit(proc, 60, tmp_path)

    await assert_bad_dead_lettered(js, reg, "verifier", subject, bad)
    rewards = {r.trajectory.msg_id: r for r in await stored(js, reg, "REWARDS", reg.rewards("arith"), Reward)}
    assert set(rewards) == {right.msg_id, wrong.msg_id}
    assert rewards[right.msg_id].reward == 1.0 and rewards[right.msg_id].status == "ok"
    assert rewards[wrong.msg_id].reward == 0.0
    assert rewards[right.msg_id].trajectory == right
    assert (await js.stream_info(reg.stream("TRAJ"))).state.messages == 0


async def test_learner_dead_letters_bad_rewards_and_steps_on_good_ones(js, run_id, tmp_path, spawn_worker):
    reg = await topology(js, run_id)
    proc = spawn_worker("learner", run_id, write_config(tmp_path), "--max-messages", "1")
    await wait_consumer(js, reg.stream("REWARDS"), "learner", tmp_path)

    subject, task = reg.rewards("arith"), make_task(run_id, group_size=GROUP_SIZE)
    scores = [1.0, 0.0, 0.0, 1.0]
    rewards = [
        Reward(run_id=run_id, msg_id=f"rw-{t.msg_id}", trajectory=t, reward=r, components={"correct": r})
        for t, r in zip(trajectories(task), scores, strict=True)
    ]
    bad = await publish_bad(js, subject, rewards[0])
    await publish_many(js, [(subject, r) for r in rewards])
    await wait_exit(proc, 60, tmp_path)

    await assert_bad_dead_lettered(js, reg, "learner", subject, bad)
    progress = await get_json(js, reg, LEARNER_PROGRESS)
    assert progress is not None
    assert progress["step"] == 1 and progress["samples_trained"] == GROUP_SIZE and progress["tasks_done"] == 1
    assert progress["reward_mean"] == 0.5
    fates = [f for tf in await stored(js, reg, "LEDGER", reg.ledger("learner"), TaskFates) for f in tf.fates]
    trained = [f for f in fates if f.fate == "trained"]
    assert len(trained) == 1 and trained[0].task_msg_id == task.msg_id
    assert sorted(trained[0].reward_msg_ids) == sorted(r.msg_id for r in rewards)
    versions = [w.version for w in await stored(js, reg, "WEIGHTS", reg.weights, WeightVersion)]
    assert versions == [0, 1]
    info = await settled_consumer(js, reg.stream("REWARDS"), "learner")
    assert info.num_ack_pending == 0 and info.num_pending == 0


@pytest.mark.parametrize("refill", [False, True], ids=["pop-then-filter", "refill"])
async def test_learner_reports_tasks_it_consumed_without_a_step(js, run_id, tmp_path, spawn_worker, refill):
    """A window whose groups are all filtered (zero reward variance) trains nothing, yet its
    tasks are done: learner.progress must say so, or a sampler gate as small as one step's
    tasks never opens again (found with max_staleness = 1). With `refill_skipped` such a
    group never counts towards a step, and must still be consumed when the window closes."""
    reg = await topology(js, run_id)
    config = tmp_path / "filtered.toml"
    config.write_text(CONFIG + "skip_zero_variance = true\n" + ("refill_skipped = true\n" if refill else ""))
    spawn_worker("learner", run_id, config)
    await wait_consumer(js, reg.stream("REWARDS"), "learner", tmp_path)
    subject, task = reg.rewards("arith"), make_task(run_id, group_size=GROUP_SIZE)
    await publish_many(
        js,
        [
            (
                subject,
                Reward(run_id=run_id, msg_id=f"rw-{t.msg_id}", trajectory=t, reward=0.0, components={"correct": 0.0}),
            )
            for t in trajectories(task)
        ],
    )

    async def consumed():
        progress = await get_json(js, reg, LEARNER_PROGRESS)
        return progress if progress and progress["tasks_done"] == 1 else None

    progress = await eventually(consumed, 30, "learner.progress to count the filtered task", tmp_path)
    assert progress["step"] == 0 and progress["samples_trained"] == 0


# -- a killed rollout worker's task goes to another worker ----------------------------------


@pytest.mark.e2e  # fault case (a killed worker / client): make test-e2e
async def test_task_of_killed_rollout_worker_is_redelivered(js, run_id, tmp_path, spawn_worker):
    """Worker A takes the task and hangs: the weight version announced just before points
    at a FIFO nobody writes, and A loads new weights first thing in its batch handler.
    A is SIGKILLed holding the task unacked; worker B (started on a good version 2, which
    A never loaded) gets the task once ack_wait (3 s) runs out and rolls it out."""
    reg = await topology(js, run_id)
    config = write_config(tmp_path)
    await publish_version(js, reg, None, 0, 0, {})
    worker_a = spawn_worker("rollout", run_id, config, log_name="rollout-A")
    await wait_consumer(js, reg.stream("TASKS"), "rollout", tmp_path)  # A loaded v0 and pulls

    fifo = tmp_path / "weights.fifo"
    os.mkfifo(fifo)
    ack = await publish(
        js,
        reg.weights,
        WeightVersion(run_id=run_id, version=1, step=1, uri=f"file://{fifo}", sha256="0" * 64, bytes=1, dtype="none"),
    )

    async def a_saw_v1():
        consumers = await js.consumers_info(reg.stream("WEIGHTS"))
        return any(c.delivered.stream_seq >= ack.seq for c in consumers)

    await eventually(a_saw_v1, 20, "worker A to receive weight version 1", tmp_path)
    await asyncio.sleep(0.5)

    task = make_task(run_id, group_size=GROUP_SIZE)
    await publish(js, reg.tasks("arith"), task)

    async def a_holds_task():
        return (await js.consumer_info(reg.stream("TASKS"), "rollout")).num_ack_pending >= 1

    await eventually(a_holds_task, 20, "worker A to fetch the task", tmp_path)
    await asyncio.sleep(0.3)
    assert worker_a.poll() is None
    assert (await js.stream_info(reg.stream("TRAJ"))).state.messages == 0, "A was not stuck; it rolled out"
    worker_a.kill()
    await asyncio.to_thread(worker_a.wait, 10)

    await publish_version(js, reg, None, 2, 2, {})
    worker_b = spawn_worker(
        "rollout", run_id, config, "--max-messages", "1", "--until-idle", "30", log_name="rollout-B"
    )
    await wait_exit(worker_b, 60, tmp_path)

    trajs = await stored(js, reg, "TRAJ", reg.traj("arith"), Trajectory)
    assert len(trajs) == GROUP_SIZE
    assert {t.task_msg_id for t in trajs} == {task.msg_id}
    assert {t.policy_version for t in trajs} == {2}, "trajectories must come from B (A never loaded v2)"
    info = await settled_consumer(js, reg.stream("TASKS"), "rollout")
    assert info.delivered.stream_seq == 1, "only one task was ever published"
    assert info.delivered.consumer_seq == 2, "the task must have been delivered exactly twice"
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 0


# -- the sampler's backpressure gate ------------------------------------------------------


async def test_sampler_gate_bounds_tasks_in_flight(js, run_id, tmp_path, spawn_worker):
    reg = await topology(js, run_id)
    proc = spawn_worker("sampler", run_id, write_config(tmp_path))  # max_inflight_tasks = 5, no learner

    async def held():
        return (await js.stream_info(reg.stream("TASKS"))).state.messages

    async def some_published():
        return await held() > 0

    await eventually(some_published, 30, "the sampler to publish", tmp_path)

    async def watch(seconds: float) -> list[int]:
        counts, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            counts.append(await held())
            await asyncio.sleep(0.1)
        return counts

    counts = await watch(3.0)
    assert max(counts) == 5 and counts[-1] == 5, counts
    assert proc.poll() is None, logs(tmp_path)

    # the learner reports 3 tasks done: exactly 3 more may go out, then the gate closes again
    await put_json(js, reg, LEARNER_PROGRESS, {"step": 1, "tasks_done": 3})
    counts = await watch(2.5)
    assert max(counts) == 8 and counts[-1] == 8, counts
    published = [f for tf in await stored(js, reg, "LEDGER", reg.ledger("sampler"), TaskFates) for f in tf.fates]
    assert len(published) == 8 and {f.fate for f in published} == {"published"}
