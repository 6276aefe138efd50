"""A rollout worker with weight updates in flight (`rollout.inflight`) killed mid-turn loses nothing.

Real worker processes on the session's nats-server, the hf engine and a tiny model. Worker A
takes a task whose turn is long (greedy, 400 tokens in 2-token chunks), loads version 1 between
two chunks of it (`rollout.inflight_reload`, logged while the task is still unacked and nothing is published), and is
SIGKILLed there. Worker B gets the task once ack_wait runs out and rolls it out in full: exactly
group_size trajectories reach TRAJ (A's partial turn is gone), the task was delivered twice and
acked once, and every answer turn's version runs cover its tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from bus.publish import publish
from bus.streams import iter_stream
from learner.weights import publish_version
from schemas import Trajectory, decode
from tests.conftest import eventually, logs, settled_consumer
from tests.messages import make_task
from tests.test_stages import topology, wait_consumer, wait_exit
from tests.tiny_weights import load_model

pytestmark = [pytest.mark.usefixtures("drop_run"), pytest.mark.e2e]

GROUP = 2
MAX_TOKENS = 400


def config(tmp_path, model_dir):
    path = tmp_path / "inflight.toml"
    path.write_text(
        f"""
[model]
path = "{model_dir}"

[rollout]
engine = "hf"
ack_wait_s = 3.0
batch_tasks = 1
max_context_tokens = 512

[rollout.inflight]
enabled = true
chunk_tokens = 2
"""
    )
    return path


@pytest.mark.timeout(240)
async def test_rollout_worker_killed_mid_chunk_loses_nothing(js, run_id, tmp_path, spawn_worker, tiny_model):
    model_dir = tiny_model(hidden_size=64, num_layers=2, num_heads=4)
    reg = await topology(js, run_id)
    cfg = config(tmp_path, model_dir)
    model = load_model(model_dir)
    await publish_version(js, reg, model, 0, 0, {})
    worker_a = spawn_worker("rollout", run_id, cfg, log_name="rollout-A")
    await wait_consumer(js, reg.stream("TASKS"), "rollout", tmp_path)

    task = make_task(run_id, group_size=GROUP, max_tokens=MAX_TOKENS, temperature=0.0)
    await publish(js, reg.tasks("arith"), task)

    async def a_holds_task():
        return (await js.consumer_info(reg.stream("TASKS"), "rollout")).num_ack_pending >= 1

    await eventually(a_holds_task, 60, "worker A to fetch the task", tmp_path)
    await publish_version(js, reg, model, 1, 1, {})
    log_a = next(tmp_path.glob("rollout-A-*.log"))

    async def a_loaded_v1_mid_turn():
        events = [json.loads(x) for x in log_a.read_text().splitlines() if x.startswith("{")]
        return any(e["event"] == "rollout.inflight_reload" and e["version"] == 1 for e in events)

    await eventually(a_loaded_v1_mid_turn, 60, "worker A to load version 1 between chunks", tmp_path)
    assert (await js.stream_info(reg.stream("TRAJ"))).state.messages == 0, "A finished its turn before the kill"
    assert worker_a.poll() is None
    worker_a.kill()
    await asyncio.to_thread(worker_a.wait, 10)

    worker_b = spawn_worker("rollout", run_id, cfg, "--max-messages", "1", "--until-idle", "30", log_name="rollout-B")
    await wait_exit(worker_b, 180, tmp_path)

    trajs = [decode(d, Trajectory) async for _, d in iter_stream(js, reg.stream("TRAJ"), reg.traj("arith"))]
    assert len(trajs) == GROUP, logs(tmp_path)
    assert sorted(t.sample_index for t in trajs) == list(range(GROUP))
    for t in trajs:
        answer = t.turns[-1]
        assert answer.version_runs and sum(k for _, k in answer.version_runs) == len(answer.token_ids) // 4
        assert t.oldest_version == 1  # B started on v1: nothing of A's v0 chunks survived
    info = await settled_consumer(js, reg.stream("TASKS"), "rollout")
    assert info.delivered.consumer_seq == 2, "the task must have been delivered exactly twice"
    assert info.num_ack_pending == 0 and info.num_pending == 0
