"""`rlbus tail` prints decoded messages live and consumes nobody's work."""

from __future__ import annotations

import asyncio
import io
import json

from bus.conn import ensure_topology, pull_subscription
from bus.publish import publish
from bus.pull import fetch
from bus.subjects import Registry
from bus.tail import tail
from schemas import ChatMessage, Task


async def test_tail_prints_decoded_messages_without_consuming(js, nats_url, run_id):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    out = io.StringIO()
    watcher = asyncio.create_task(
        tail(nats_url, f"tasks.{run_id}.>", as_json=True, max_messages=2, out=out, timeout=20)
    )
    await asyncio.sleep(0.5)  # subscription in place
    task = Task(
        run_id=run_id,
        task_id="t1",
        domain="arith",
        group_size=2,
        prompt=[ChatMessage(role="user", content="2+3=")],
        verifier="arith",
    )
    await publish(js, reg.tasks("arith"), task)
    await js.publish(reg.tasks("arith"), b"\xc1garbage")
    assert await watcher == 2
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines[0]["kind"] == "task" and lines[0]["msg_id"] == task.msg_id and lines[0]["task_id"] == "t1"
    assert "undecodable" in lines[1]
    # the work is still there for the rollout consumer: tail consumed nothing
    sub = await pull_subscription(js, reg.rollout_consumer())
    got = await fetch(sub, 10, 2.0)
    assert len(got) == 2
    for m in got:
        await m.ack()
