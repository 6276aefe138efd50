"""The curriculum on the real bus: the scheduler's curriculum service against published
rewards, and the real sampler process following a curriculum in KV.

Covers: weights shift toward the domain below its target and the easy domain is
promoted (KV `curriculum`, run store, acks); a restart restores the state and keeps
counting versions; the sampler publishes tasks in the KV weights' proportions, at the
KV levels, with the math domain's gold for the `math` verifier.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from bus.conn import ensure_topology
from bus.kv import CURRICULUM, get_json, put_json
from bus.publish import publish_many
from bus.streams import iter_stream
from bus.subjects import Registry
from producers.sampler import plan
from scheduler.curriculum_service import DURABLE, run_curriculum
from scheduler.store import open_store
from scheduler.store_rows import CurriculumUpdateRow
from schemas import Reward, Task, TaskFates, Trajectory, Turn, decode
from schemas.config import load_config
from tests.conftest import eventually, logs

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards

GROUP = 4

TWO_DOMAINS = """
[sampler]
group_size = 4
max_inflight_tasks = 500
publish_batch = 50

[sampler.domains.arith]
target_reward = 0.8
min_level = 1
max_level = 3
start_level = 1

[sampler.domains.math]
target_reward = 0.8
min_level = 1
max_level = 2

[rollout]
engine = "null"

[learner]
policy = "null"
max_staleness = 100  # no learner runs here: keep the staleness bound above the 200 tasks

[scheduler.curriculum]
every_s = 0.3
window = 8
"""


def config(tmp_path: Path) -> Path:
    path = tmp_path / "two_domains.toml"
    path.write_text(TWO_DOMAINS)
    return path


def group_rewards(run_id: str, domain: str, level: int, group: str, values: list[float]) -> list[Reward]:
    out = []
    for i, v in enumerate(values):
        traj = Trajectory(
            run_id=run_id,
            task_id=f"{domain}-{group}",
            task_msg_id=f"tm-{group}",
            domain=domain,
            difficulty=level,
            group_id=group,
            group_size=len(values),
            sample_index=i,
            verifier=domain,
            policy_version=0,
            turns=[Turn(role="prompt", text="p")],
        )
        out.append(Reward(run_id=run_id, trajectory=traj, reward=v))
    return out


async def publish_groups(js, reg: Registry, tag: str, n: int) -> None:
    """n groups per domain: arith mostly right (15/16), math mostly wrong (1/16)."""
    msgs = []
    for k in range(n):
        easy = [1.0, 1.0, 1.0, 0.0 if k % 4 == 0 else 1.0]
        hard = [0.0, 0.0, 0.0, 1.0 if k % 4 == 0 else 0.0]
        msgs += [(reg.rewards("arith"), r) for r in group_rewards(reg.run_id, "arith", 1, f"{tag}a{k}", easy)]
        msgs += [(reg.rewards("math"), r) for r in group_rewards(reg.run_id, "math", 1, f"{tag}m{k}", hard)]
    await publish_many(js, msgs)


async def run_until_updates(js, reg: Registry, cfg, store, updates: int, what: str, tmp_path: Path):
    """Run the curriculum service until its KV state counts `updates` groups (at most 20 s),
    then stop it; returns (that state, the service's counters)."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_curriculum(js, reg, cfg, stop, store))

    async def observed():
        value = await get_json(js, reg, CURRICULUM)
        return value if value and value["updates"] == updates else None

    value = await eventually(observed, 20, what, tmp_path)
    stop.set()
    return value, await asyncio.wait_for(task, 10)


async def test_curriculum_service_shifts_weights_and_promotes(js, run_id, tmp_path):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    cfg = load_config(config(tmp_path))
    store = await asyncio.to_thread(open_store, None, tmp_path / "run")
    await asyncio.to_thread(store.ensure_run, run_id)
    await publish_groups(js, reg, "r1", 8)  # 32 samples per domain

    value, counters = await run_until_updates(
        js, reg, cfg, store, 16, "the curriculum to observe every group", tmp_path
    )

    w = value["weights"]
    assert set(w) == {"arith", "math"} and abs(sum(w.values()) - 1) < 1e-9
    assert w["math"] > 0.9 > w["arith"], w
    assert value["levels"] == {"arith": 2, "math": 1}, value
    assert counters["curriculum_groups"] == 16 and counters.get("curriculum_promotes") == 1

    async def all_acked():  # the server applies acks asynchronously: poll briefly
        info = await js.consumer_info(reg.stream("REWARDS"), DURABLE)
        return info.num_ack_pending == 0 and info.num_pending == 0

    await eventually(all_acked, 5, "every observed reward to be acked", tmp_path)
    rows = await asyncio.to_thread(store.rows, CurriculumUpdateRow, run_id, "created_at")
    assert rows and {r.msg_id for r in rows} == {f"curriculum-{run_id}-{n}" for n in range(1, value["version"] + 1)}
    assert rows[-1].weights == w and rows[-1].levels == value["levels"]
    assert any("promote arith 1->2" in r.reason for r in rows)

    # restart: the state comes back from KV; more of the same keeps the shares, counts on
    await publish_groups(js, reg, "r2", 2)
    new, _ = await run_until_updates(
        js, reg, cfg, store, 20, "the restarted curriculum to observe the new groups", tmp_path
    )
    assert new["version"] > value["version"] and new["levels"] == {"arith": 2, "math": 1}
    assert new["weights"]["math"] > 0.9


def test_plan_static_until_curriculum_then_clamped():
    cfg = load_config(
        None,
        ["sampler.domains.arith.weight=3.0", "sampler.domains.math.weight=1.0", "sampler.domains.math.max_level=2"],
    )
    domains = cfg.sampler.domains
    assert plan(domains, None) == ({"arith": 3.0, "math": 1.0}, {"arith": 1, "math": 1})
    weights, levels = plan(
        domains, {"weights": {"math": 1.0, "code": 5.0}, "levels": {"arith": 9, "math": 2}, "version": 3}
    )
    assert weights == {"arith": 0.0, "math": 1.0} and levels == {"arith": 1, "math": 2}
    # the legacy single-domain fields still describe the default domain
    legacy = load_config(None, ["sampler.difficulty=4"]).sampler.domains
    assert list(legacy) == ["arith"] and legacy["arith"].initial_level == 4 and legacy["arith"].max_level == 6


async def test_sampler_follows_kv_curriculum(js, run_id, tmp_path, spawn_worker):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    await put_json(
        js, reg, CURRICULUM, {"weights": {"arith": 0.2, "math": 0.8}, "levels": {"arith": 3, "math": 2}, "version": 1}
    )
    n = 200
    proc = spawn_worker("sampler", run_id, config(tmp_path), "--max-messages", str(n))

    async def exited():
        return proc.poll() is not None

    await eventually(exited, 30, "the sampler to publish its tasks and exit", tmp_path)
    assert proc.returncode == 0, logs(tmp_path)

    tasks = [decode(data, Task) async for _, data in iter_stream(js, reg.stream("TASKS"), reg.all("tasks"))]
    assert len(tasks) == n
    by_domain = Counter(t.domain for t in tasks)
    assert abs(by_domain["math"] / n - 0.8) < 0.08, by_domain
    assert {t.difficulty for t in tasks if t.domain == "arith"} == {3}
    math_tasks = [t for t in tasks if t.domain == "math"]
    assert {t.difficulty for t in math_tasks} == {2}
    assert all(
        t.verifier == "math" and "gold" not in t.verifier_params and "\\boxed{}" in t.prompt[0].content
        for t in math_tasks
    )
    # gold lives only in the hidden bucket, under each task's hidden_ref
    from bus.hidden import get_hidden
    from producers.domains.math import load, resolve_path

    answers = {q.id: q.answer for q in load(str(resolve_path("")))}
    for t in math_tasks[:5]:
        assert (await get_hidden(js, reg, t.hidden_ref))["gold"] == answers[t.verifier_params["problem_id"]]
    fates = [
        f
        for tf in [decode(d, TaskFates) async for _, d in iter_stream(js, reg.stream("LEDGER"), reg.ledger("sampler"))]
        for f in tf.fates
    ]
    assert sorted(f.task_msg_id for f in fates) == sorted(t.msg_id for t in tasks)
