"""The standing attack suite of the controlled side (issue 27): one test per attack class, here
or in the module named by docs/reliability.md's "controlled side" table.

Here: the check is bound to the task (a rollout that forges the verifier, its params, the
reward weights or the hidden ref gets the task's real check), resource params are clamped to
the operator's maxima, and the table itself names only tests that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bus.checks import TaskCheck, bind, check_key, put_checks
from bus.conn import ensure_topology
from bus.hidden import put_hidden
from bus.publish import publish_many
from bus.session import WorkerContext
from bus.streams import iter_stream
from bus.subjects import Registry
from schemas import DeadLetter, Reward, decode
from schemas.config import RunConfig, VerifierSection
from tests.messages import make_task, make_trajectory
from verifier_workers.worker import clamp_resources

ROOT = Path(__file__).resolve().parents[1]


def test_bind_replaces_every_forged_field_with_the_tasks_own():
    task = make_task("r1")
    honest = make_trajectory("r1", task, 0, "5")
    check = TaskCheck.of(task)
    assert bind(honest, check) == (honest, [])
    forged = honest.model_copy(
        update={
            "verifier": "constant",
            "verifier_params": {"expression": "3+4"},
            "reward_weights": {"format": 1.0},
            "hidden_ref": "math.x.000000000000",
        }
    )
    bound, fields = bind(forged, check)
    assert fields == ["verifier", "verifier_params", "reward_weights", "hidden_ref"]
    assert (bound.verifier, bound.verifier_params, dict(bound.reward_weights), bound.hidden_ref) == (
        "arith",
        {"expression": "2+3"},
        {},
        None,
    )
    assert check_key("arith", "a.b/c d") == check_key("arith", "a.b/c d") and " " not in check_key("arith", "a b")


def test_resource_params_are_clamped_to_the_operators_maxima():
    task = make_task("r1").model_copy(
        update={
            "verifier_params": {
                "expression": "2+3",
                "memory_mb": 10**9,
                "cpus": 512.0,
                "timeout_s": float("inf"),
                "pids": 5,
                "other": 10**9,
            }
        }
    )
    traj = clamp_resources(make_trajectory("r1", task), VerifierSection(max_memory_mb=2048, max_cpus=2.0))
    vp = traj.verifier_params
    assert (vp["memory_mb"], vp["cpus"], vp["timeout_s"], vp["pids"], vp["other"]) == (2048, 2.0, 600.0, 5, 10**9)


@pytest.mark.e2e
async def test_a_rollout_that_forges_each_check_field_gets_the_tasks_real_check(js, run_id, tmp_path, monkeypatch):
    """On 45ce3d4 each forged trajectory scored 1.0 (`constant`, a rewritten expression, weights on
    `format`, a foreign hidden ref); now every one is scored by its task's check, and a trajectory
    of a task no publisher stored a check for is dead-lettered as infra, never scored."""
    from verifier_workers.worker import run

    monkeypatch.delenv("RLBUS_TOOL_SECRET", raising=False)
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    task = make_task(run_id, group_size=8)
    await put_checks(js, reg, [task], {})  # as the sampler does before it publishes
    await put_hidden(js, reg, "math.planted.000000000000", {"gold": "7"})
    base = [make_trajectory(run_id, task, i, "7") for i in range(6)]  # "7" is wrong for 2+3
    honest_right = make_trajectory(run_id, task, 6, "5")
    forged = {
        "verifier": base[0].model_copy(update={"verifier": "constant"}),
        "verifier_params": base[1].model_copy(update={"verifier_params": {"expression": "3+4"}}),
        "reward_weights": base[2].model_copy(update={"reward_weights": {"format": 1.0}}),
        "hidden_ref": base[3].model_copy(update={"verifier": "math", "hidden_ref": "math.planted.000000000000"}),
    }
    orphan = make_trajectory(run_id, make_task(run_id, task_id="never-published"), 0, "5")
    await publish_many(js, [(reg.traj("arith"), t) for t in [*forged.values(), honest_right, orphan]])
    cfg = RunConfig(
        verifier=VerifierSection(ack_wait_s=1.0, batch=8, retry_base_s=0.05, retry_max_s=0.1, concurrency=1)
    )
    counters = await run(
        cfg, WorkerContext(run_id=run_id, nats_url=js._nc.connected_url.geturl(), run_path=tmp_path, until_idle=5.0)
    )
    rewards = {
        decode(d, Reward).trajectory.msg_id: decode(d, Reward)
        async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("arith"))
    }
    assert rewards[honest_right.msg_id].reward == 1.0
    for field, traj in forged.items():
        r = rewards[traj.msg_id]
        assert r.reward == 0.0 and r.components["correct"] == 0.0, field
        assert (r.trajectory.verifier, r.trajectory.verifier_params, r.trajectory.hidden_ref) == (
            "arith",
            {"expression": "2+3"},
            None,
        ), field  # the Reward records the check it was scored by
    assert counters["check_forged"] == 4
    assert orphan.msg_id not in rewards
    letters = [decode(d, DeadLetter) async for _, d in iter_stream(js, reg.stream("DLQ"), reg.all("dlq"))]
    assert [(x.error_type, "no check for task" in x.reason) for x in letters] == [("infra_error", True)]


def _table_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## The controlled side", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", section)


def test_the_controlled_side_table_names_only_tests_that_exist():
    rows = _table_rows()
    assert len(rows) >= 10, "docs/reliability.md's controlled-side table lists one test per attack class"
    for path, name in rows:
        source = (ROOT / path).read_text()
        if not re.search(rf"^(async )?def {name}\(", source, re.MULTILINE):
            pytest.fail(f"docs/reliability.md names {path}::{name}, which does not exist")
