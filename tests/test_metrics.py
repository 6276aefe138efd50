"""Prometheus /metrics of live workers: scraped over HTTP while they process real messages.

The in-process test runs a real `worker_session` on the session's nats-server with a
real pull loop and scrapes it; the process test starts `rlbus worker learner` (null
policy) with RLBUS_METRICS_PORT and scrapes it (it needs the one-line hook in
`bus/session.py`, and says so when it is missing).
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from pathlib import Path

import pytest

from bus.publish import publish_many
from bus.pull import run_pull_loop
from bus.server import free_port
from bus.session import WorkerContext, worker_session
from bus.telemetry import ENV_PORT, start_metrics_server
from schemas import ChatMessage, Task
from schemas.config import RunConfig

pytestmark = pytest.mark.usefixtures("drop_run")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def series(text: str, metric: str, **labels) -> float | None:
    """Value of the first sample `metric{...labels...}` in an exposition text."""
    for line in text.splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_live_worker_session_exposes_key_series(tmp_path, nats_url, run_id):
    ctx = WorkerContext(run_id=run_id, nats_url=nats_url, run_path=tmp_path)
    async with worker_session("verifier", RunConfig(), ctx) as s:
        port = start_metrics_server("verifier", s.counters, free_port(), worker="v-test")
        assert s.counters["metrics_port"] == port
        tasks = [
            (
                s.reg.tasks("arith"),
                Task(
                    run_id=run_id,
                    task_id=f"t{i}",
                    domain="arith",
                    group_size=1,
                    verifier="exact",
                    prompt=[ChatMessage(role="user", content="1+1=")],
                ),
            )
            for i in range(5)
        ]
        await publish_many(s.js, tasks)
        from bus.conn import pull_subscription

        sub = await pull_subscription(s.js, s.reg.rollout_consumer())

        async def handle(batch):
            s.counters["rewards"] = s.counters.get("rewards", 0) + len(batch)
            s.counters["reward_sum"] = s.counters.get("reward_sum", 0) + 0.5 * len(batch)

        await run_pull_loop(s.js, s.reg, "verifier", sub, Task, handle, max_messages=5, counters=s.counters)
        text = await asyncio.to_thread(scrape, port)
    assert series(text, "rlbus_up", role="verifier", worker="v-test") == 1.0
    assert series(text, "rlbus_messages_processed_total", role="verifier", what="rewards") == 5.0
    assert series(text, "rlbus_outcomes_total", outcome="ack") == 5.0
    assert series(text, "rlbus_reward_mean", role="verifier") == 0.5
    assert series(text, "rlbus_counter", name="metrics_port") == float(port)
    assert "# TYPE rlbus_messages_processed_total counter" in text


def test_port_zero_is_off_and_busy_base_port_moves_up(monkeypatch):
    monkeypatch.delenv(ENV_PORT, raising=False)
    assert start_metrics_server("sampler", {}, 0) is None
    base = free_port()
    first = start_metrics_server("sampler", {"published": 1}, base)
    second = start_metrics_server("sampler", {"published": 2}, base)
    assert first == base and second is not None and second > base
    assert series(scrape(second), "rlbus_messages_processed_total", what="published") == 2.0


def test_worker_process_serves_metrics(tmp_path, nats_url, run_id, spawn_worker):
    cfg = tmp_path / "m.toml"
    cfg.write_text('[learner]\npolicy = "null"\n')
    port = free_port()
    os.environ[ENV_PORT] = str(port)
    try:
        proc = spawn_worker("learner", run_id, cfg)
    finally:
        del os.environ[ENV_PORT]
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            text = scrape(port)
            if series(text, "rlbus_weight_version", role="learner") is not None:
                break
        except OSError:
            pass
        time.sleep(0.3)
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in Path(tmp_path).glob("*.log"))
    assert series(text, "rlbus_up", role="learner") == 1.0, logs
    assert series(text, "rlbus_learner_step", role="learner") == 0.0
    assert series(text, "rlbus_weight_version", role="learner") == 0.0
