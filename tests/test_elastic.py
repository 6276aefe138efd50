"""Scale-down of the simulated elastic rollout pool (issue 34, item 3; `bench/elastic.py`) loses nothing.

Two rollout workers each hold a 4 s task when the autoscaler's target falls to one replica:
- SIGTERM (what a kubelet sends at scale-down): the stopped worker finishes its task, acks it and exits;
- SIGKILL (a worker still running after terminationGracePeriodSeconds): its unacked task is redelivered
  after ack_wait to the worker that stays.
Either way the run's accounting (`rlbus.run.accounting.account`, summary.json's lost / trained twice)
finds every published task trained, none lost, none trained twice. e2e: real worker processes.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from bench.elastic import Autoscaler, TaskSource, Workers, accounting, config_text, jsz_consumers, settle
from bus.subjects import Registry
from schemas.config import load_config
from schemas.config.deploy import PoolScaling

pytestmark = pytest.mark.e2e

TASKS = 4


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm-drains", "sigkill-redelivers"])
async def test_scale_down_mid_task_loses_nothing(tmp_path, sig):
    from bus.conn import connect, ensure_topology
    from bus.server import EmbeddedNats, free_port

    cfg_path = tmp_path / "elastic.toml"
    cfg_path.write_text(config_text(task_s=4.0, batch=1, ack_wait_s=6.0))
    cfg = load_config(cfg_path)
    run_id = f"elastictest{sig.value}"
    reg = Registry(run_id)
    server = EmbeddedNats(tmp_path / "nats", monitor_port=free_port()).start()
    workers = Workers(tmp_path, cfg_path, server.url, run_id)
    nc = await connect(server.url, name="pytest-elastic")
    js = nc.jetstream(timeout=30)
    try:
        await ensure_topology(js, reg)
        for role in ("learner", "verifier", "rollout", "rollout"):
            workers.start(role)
        spec = reg.rollout_consumer()
        deadline = time.monotonic() + 120
        while (spec.stream, spec.durable) not in jsz_consumers(server.monitor_url):
            assert time.monotonic() < deadline, f"no rollout consumer; see {tmp_path}/*.log"
            await asyncio.sleep(0.5)
        await TaskSource(js, reg, cfg).publish(TASKS)
        deadline = time.monotonic() + 60
        while jsz_consumers(server.monitor_url)[(spec.stream, spec.durable)]["num_ack_pending"] < 2:
            assert time.monotonic() < deadline, "the two workers never both held a task"
            await asyncio.sleep(0.1)
        scaler = Autoscaler(
            workers, server.monitor_url, reg, list(cfg.rollout.pools), PoolScaling(max_replicas=1), 0.0, sig
        )
        row = scaler.step()  # backlog 4 > lagThreshold, but max 1: the target is 1 of 2 running
        assert row["target"] == 1 and row["action"] == "-1" and row["replicas"] == 1, row
        (stopped, since) = workers.terminating[0]
        stopped.wait(30)
        drained = time.monotonic() - since
        if sig == signal.SIGTERM:
            assert stopped.returncode == 0 and drained > 1.0  # it finished the 4 s task it held, then exited
        else:
            assert stopped.returncode == -signal.SIGKILL
        assert await settle(js, reg, server.monitor_url, TASKS, timeout=90), f"not drained; see {tmp_path}/*.log"
        workers.stop_all()
        acc = await accounting(server.url, reg)
        assert acc["published"] == TASKS and acc["trained"] == TASKS, acc
        assert acc["lost"] == 0 and acc["trained_twice"] == 0, acc
    finally:
        workers.stop_all()
        await nc.close()
        server.stop()
