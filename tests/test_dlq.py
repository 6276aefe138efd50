"""Dead letters against a real nats-server: MAX_DELIVERIES capture, list/show/replay, CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from bus.conn import ensure_topology
from bus.publish import publish
from bus.subjects import Registry
from scheduler import dlq
from schemas import ChatMessage, DeadLetter, Task, decode

pytestmark = pytest.mark.usefixtures("drop_run")
ROOT = Path(__file__).resolve().parents[1]


def _task(run_id: str) -> Task:
    return Task(
        run_id=run_id,
        task_id="t-1",
        domain="arith",
        group_size=2,
        prompt=[ChatMessage(role="user", content="1+1=")],
        verifier="arith",
    )


async def _fetch(sub, timeout: float = 1.0):
    try:
        return await sub.fetch(1, timeout=timeout)
    except (nats.errors.TimeoutError, TimeoutError):
        return []


async def _consumer(js, reg: Registry, name: str, max_deliver: int = 2, ack_wait: float = 0.4):
    cfg = ConsumerConfig(
        durable_name=name,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        filter_subject=reg.all("tasks"),
    )
    await js.add_consumer(reg.stream("TASKS"), config=cfg)
    return await js.pull_subscribe_bind(name, stream=reg.stream("TASKS"))


async def _dead_letter_one_task(js, reg: Registry) -> tuple[Task, int]:
    """Publish a task, let a max_deliver=2 consumer drop it, capture the advisory."""
    stop, ready = asyncio.Event(), asyncio.Event()
    capture = asyncio.create_task(dlq.capture_max_deliveries(js, reg, stop, ready))
    await asyncio.wait_for(ready.wait(), 5)
    task = _task(reg.run_id)
    ack = await publish(js, reg.tasks("arith"), task)
    sub = await _consumer(js, reg, "dlqtest")
    for attempt in (1, 2):  # fetched twice, never acked
        msgs = await _fetch(sub, 2.0)
        assert len(msgs) == 1 and msgs[0].metadata.num_delivered == attempt
        await asyncio.sleep(0.6)
    for _ in range(20):  # a waiting pull makes the server notice the exhausted message
        assert await _fetch(sub, 0.3) == []
        info = await js.stream_info(reg.stream("DLQ"))
        if info.state.messages:
            break
    stop.set()
    assert await asyncio.wait_for(capture, 5) == 1
    await sub.unsubscribe()
    await js.delete_consumer(reg.stream("TASKS"), "dlqtest")
    return task, ack.seq


async def test_max_deliveries_captured_into_dlq(js, run_id):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    task, task_seq = await _dead_letter_one_task(js, reg)

    letters = await dlq.list_letters(js, reg)
    assert len(letters) == 1
    seq, letter = letters[0]
    assert isinstance(letter, DeadLetter)
    assert letter.error_type == "max_deliveries" and letter.stage == "rollout"
    assert letter.reason.startswith("exceeded max_deliver=2")
    assert letter.delivery_count == 2
    assert letter.original_subject == reg.tasks("arith")
    assert decode(letter.original_data) == task
    assert letter.original_msg_id == task.msg_id == letter.task_msg_id
    assert letter.msg_id == f"dlq-max-{reg.stream('TASKS')}-{task_seq}"
    # removed from the work stream
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 0
    with pytest.raises(NotFoundError):
        await js.get_msg(reg.stream("TASKS"), task_seq)
    # the same advisory again changes nothing: the letter id is derived from stream+seq
    assert await dlq.dead_letter_by_seq(js, reg, reg.stream("TASKS"), task_seq, 2) is None
    assert len(await dlq.list_letters(js, reg)) == 1
    shown = await dlq.show(js, reg, seq)
    assert shown == letter
    with pytest.raises(KeyError):
        await dlq.show(js, reg, seq + 100)


async def test_replay_republishes_original(js, run_id):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    task, _ = await _dead_letter_one_task(js, reg)
    ((seq, letter),) = await dlq.list_letters(js, reg)
    assert await dlq.replayed(js, reg, seq) is None

    assert await dlq.replay(js, reg, [seq]) == 1
    assert await dlq.replay(js, reg, [seq]) == 0  # same letter again: de-duplicated
    record = await dlq.replayed(js, reg, seq)
    assert record["msg_id"] == f"{task.msg_id}.replay-{seq}" and record["subject"] == reg.tasks("arith")

    sub = await _consumer(js, reg, "fresh", max_deliver=5, ack_wait=30)
    msgs = await _fetch(sub, 3.0)
    assert len(msgs) == 1
    assert msgs[0].subject == reg.tasks("arith")
    assert msgs[0].data == letter.original_data and decode(msgs[0].data) == task
    assert msgs[0].headers[dlq.REPLAY_OF_HEADER] == str(seq)
    assert msgs[0].headers[dlq.ORIGINAL_ID_HEADER] == task.msg_id
    await msgs[0].ack()
    assert await _fetch(sub, 0.5) == []  # stored once


async def test_cli_lists_and_shows_letter(js, run_id, nats_url, tmp_path):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    task, _ = await _dead_letter_one_task(js, reg)
    ((seq, _),) = await dlq.list_letters(js, reg)

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "rlbus.cli", "dlq", *args, "--run-id", run_id],
            check=False,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            env=dict(os.environ),
        )

    out = await asyncio.to_thread(cli, "list", "--nats-url", nats_url)
    assert out.returncode == 0, out.stderr
    assert "1 dead letter(s)" in out.stdout and "exceeded max_deliver=2" in out.stdout
    assert reg.tasks("arith") in out.stdout and "max_deliveries" in out.stdout

    # --run-dir: the URL comes from <run-dir>/<run_id>/run.json; without one, a clear error
    out = await asyncio.to_thread(cli, "list", "--run-dir", str(tmp_path))
    assert out.returncode != 0 and "--nats-url" in out.stderr
    (tmp_path / run_id).mkdir()
    (tmp_path / run_id / "run.json").write_text(json.dumps({"run_id": run_id, "nats_url": nats_url}))
    out = await asyncio.to_thread(cli, "show", str(seq), "--run-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["delivery_count"] == 2 and body["original"]["task_id"] == task.task_id and body["replayed"] is None

    out = await asyncio.to_thread(cli, "replay", "--all", "--nats-url", nats_url, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"replayed": [seq], "stored": 1}
    assert (await js.stream_info(reg.stream("TASKS"))).state.messages == 1
