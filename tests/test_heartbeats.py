"""`bus.telemetry.Heartbeats`, the one heartbeat reader (launcher monitor, status, top, benches, costs)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from bus import telemetry
from bus.telemetry import Heartbeats
from schemas import Metric, encode


def beat(worker: str, role: str, run: str = "r1", pid: int = 0, **values: float) -> Metric:
    return Metric(run_id=run, role=role, worker_id=worker, values=values, host="h", pid=pid)


def test_sums_gains_and_restarted_workers():
    b = Heartbeats("r1")
    b.add(beat("roll-1", "rollout", trajectories=10, tokens=100, cpu_seconds=1.0))
    b.add(beat("roll-1", "rollout", trajectories=30, tokens=300, cpu_seconds=2.0))
    b.add(beat("roll-2", "rollout", trajectories=5, cpu_seconds=0.5))  # a restarted worker: a new id
    b.add(beat("learn-1", "learner", pid=7, samples_trained=64))
    b.add(beat("other", "rollout", run="r2", trajectories=999))  # another run: skipped
    assert b.role_sum("rollout", telemetry.TRAJECTORIES) == 35.0
    assert b.gain("rollout", telemetry.TRAJECTORIES) == 20.0  # since first seen, per worker
    assert b.stage_totals() == {"rollout": 35.0, "learner": 64.0}  # pipeline stages with a worker only
    assert b.role_sums(telemetry.CPU_SECONDS) == {"rollout": 2.5}
    assert b.role_sums(telemetry.TOKENS) == {"rollout": 300.0}
    assert b.per_role()["rollout"] == {"trajectories": 35.0, "tokens": 300.0, "cpu_seconds": 2.5}
    assert [m.worker_id for m in b.metrics()] == ["learn-1", "roll-1", "roll-2"]
    assert set(b.last_seen) == {7}
    assert b.role_sum("verifier", telemetry.REWARDS) == 0.0


def test_rates_from_each_workers_stage_counter():
    b = Heartbeats(window=30.0)
    now = time.time()
    b.add(beat("s-1", "sampler", published=0), now=now - 10)
    b.add(beat("s-1", "sampler", published=100), now=now)
    b.add(beat("v-1", "verifier", rewards=7), now=now)  # one point: no rate yet
    assert b.rate("s-1") == 10.0 and b.rate("v-1") == 0.0 and b.rate("nobody") == 0.0
    assert b.role_rate("sampler") == 10.0


def test_on_msg_skips_what_does_not_decode_and_wait_for_times_out():
    b = Heartbeats("r1")

    async def go():
        await b.on_msg(SimpleNamespace(data=b"\x00not msgpack"))
        assert not b.latest
        assert not await b.wait_for(lambda m: m.role == "sampler", timeout=0.1)
        await b.on_msg(SimpleNamespace(data=encode(beat("s-1", "sampler", published=1))))
        return await b.wait_for(lambda m: m.role == "sampler" and m.host == "h", timeout=1.0)

    assert asyncio.run(go())
