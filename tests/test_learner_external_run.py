"""Two learner ranks as two pods would run them, on a real bus (e2e): a nats-server, and two
`rlbus worker learner` processes of the same config with `learner.launch = "external"`, told their
rank by RANK and meeting at MASTER_ADDR/MASTER_PORT on loopback (gloo, CPU).

- Rank 0 alone talks to the bus: rank 1 is given an unreachable NATS URL and still serves every step.
- Rank 0 trains from REWARDS, publishes weight versions gathered from both ranks, and both ranks
  write their shards of one DCP checkpoint into the shared run folder.
- Restarted (both processes anew, as a StatefulSet recreates pods), the ranks meet again, restore
  that checkpoint and train on from the step it recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bus.subjects import Registry
from tests.test_learner_units import RUN, reward

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e
TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64)


async def _publish_rewards(url: str, groups: list[str]) -> None:
    from bus.conn import connect, ensure_topology
    from bus.publish import publish

    nc = await connect(url, name="pytest")
    try:
        js = nc.jetstream(timeout=10)
        reg = Registry(RUN)
        await ensure_topology(js, reg)
        for k, g in enumerate(groups):
            for i in range(2):
                r = reward(g, i, prompt=(5, 6, 7 + k), comp=(8 + i, 9, 10 + k), value=float(i))
                await publish(js, reg.rewards("arith"), r)
    finally:
        await nc.close()


async def _latest_version(url: str) -> int:
    from bus.conn import connect
    from bus.kv import WEIGHTS_LATEST, get_json

    nc = await connect(url, name="pytest")
    try:
        return int((await get_json(nc.jetstream(timeout=10), Registry(RUN), WEIGHTS_LATEST) or {})["version"])
    finally:
        await nc.close()


def _start(tmp_path: Path, model_dir: Path, rank: int, nats_url: str, port: int, steps: int) -> subprocess.Popen:
    sets = ["learner.world_size=2", "learner.launch=external", "learner.backend=gloo", f"model.path={model_dir}"]
    sets += ["learner.groups_per_step=2", "learner.checkpoint_every=1", "learner.step_window_s=0.5"]
    sets += ["learner.dist_timeout_s=60", "learner.rendezvous_timeout_s=120"]
    cmd = [sys.executable, "-m", "rlbus.cli", "worker", "learner", "--config", "examples/smoke.toml"]
    cmd += ["--run-id", RUN, "--run-dir", str(tmp_path / "runs"), "--nats-url", nats_url]
    cmd += ["--max-messages", str(steps), *[x for s in sets for x in ("--set", s)]]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _events(log: str) -> list[dict]:
    """The JSON log records of a worker's output."""
    out = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "event" in rec:
            out.append(rec)
    return out


def _steps(log: str) -> list[int]:
    return [e["step"] for e in _events(log) if e["event"] == "learner.step"]


def _has(log: str, event: str) -> bool:
    return any(e["event"] == event for e in _events(log))


def _pair(tmp_path, model_dir, url, steps) -> tuple[str, str]:
    """Start rank 1 (no reachable bus) and rank 0 separately; both must exit 0; their logs."""
    from bus.server import free_port

    port = free_port()
    rank1 = _start(tmp_path, model_dir, 1, "nats://127.0.0.1:1", port, steps)
    rank0 = _start(tmp_path, model_dir, 0, url, port, steps)
    try:
        log0 = rank0.communicate(timeout=240)[0]
        log1 = rank1.communicate(timeout=60)[0]
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
    assert rank0.returncode == 0, log0[-3000:]
    assert rank1.returncode == 0, log1[-3000:]
    return log0, log1


@pytest.mark.timeout(600)
def test_two_pods_worth_of_ranks_train_from_the_bus_and_resume(tiny_model, tmp_path):
    from bus.server import EmbeddedNats

    model_dir = tiny_model(**TINY)
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        asyncio.run(_publish_rewards(server.url, ["a", "b", "c", "d"]))  # 2 steps of 2 groups
        log0, log1 = _pair(tmp_path, model_dir, server.url, steps=2)
        assert _steps(log0) == [1, 2] and _has(log0, "learner.rendezvous"), log0[-3000:]
        assert _has(log1, "learner.rendezvous") and _has(log1, "learner.rank_stopped"), log1[-3000:]
        assert asyncio.run(_latest_version(server.url)) == 2  # version 0, then one per step
        root = tmp_path / "runs" / RUN / "checkpoints" / "learner.dcp"
        latest = root / (root / "LATEST").read_text()
        assert {"rng-0.pt", "rng-1.pt", ".metadata", "state.json"} <= {p.name for p in latest.iterdir()}
        assert "step00000002" in latest.name

        asyncio.run(_publish_rewards(server.url, ["e", "f"]))  # one more step, after a restart of both ranks
        log0, log1 = _pair(tmp_path, model_dir, server.url, steps=3)
        assert _has(log0, "learner.resumed") and _steps(log0) == [3], log0[-3000:]
        resumed = next(e for e in _events(log0) if e["event"] == "learner.resumed")
        assert resumed["step"] == 2 and resumed["trained_in_checkpoint"] == 8
        assert asyncio.run(_latest_version(server.url)) == 4  # the restored weights announced, then step 3
    finally:
        server.stop()
