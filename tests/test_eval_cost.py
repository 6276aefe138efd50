"""The completion rate as an evaluation, recorded next to the cost so far (issue 18).

A domain's eval score counts a problem as solved by its success component (`correct`, else
`resolved`: the repo verifier's completion, whatever the domain's reward weights); every
eval row carries the run's cumulative tokens, CPU seconds (heartbeat totals) and sandbox
seconds (summed over the recorded rewards: episode tool executions + the verifier's own
sandbox time). Real SQLite stores; the docker case runs the real repo verifier.
"""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest

from scheduler.pipeline_eval import is_correct
from scheduler.store import open_store, reward_sandbox_seconds
from scheduler.store_rows import EvalResultRow, RewardRow
from schemas import EvalResult, Reward, ToolCall, Trajectory, Turn


def _reward(
    run_id: str,
    i: int,
    *,
    components: dict,
    value: float,
    tool_ms: tuple[float, ...] = (),
    sandbox_s: float = 0.0,
    purpose: str = "eval",
) -> Reward:
    calls = [
        ToolCall(turn=0, tool="run", code="pytest", exec_id=f"x{i}.{k}", duration_ms=ms) for k, ms in enumerate(tool_ms)
    ]
    calls.append(ToolCall(turn=0, tool="run", code="{", exit_code=-1, error="malformed_json", duration_ms=999.0))
    traj = Trajectory(
        run_id=run_id,
        task_id=f"t{i}",
        task_msg_id=f"ev1.repo.{i}-r{run_id}",
        domain="repo",
        purpose=purpose,
        group_id=f"g{i}",
        group_size=1,
        sample_index=0,
        turns=[Turn(role="assistant", text="submit()", trainable=True, policy_version=2)],
        verifier="repo",
        policy_version=2,
        tool_calls=calls,
    )
    return Reward(
        run_id=run_id, msg_id=f"rw-{i}", trajectory=traj, reward=value, components=components, sandbox_seconds=sandbox_s
    )


def test_the_success_component_decides_a_solved_problem():
    repo = {"resolved": 1.0, "target_pass_rate": 1.0, "regression_pass_rate": 1.0, "applied": 1.0}
    # weighted towards pass rates, the scalar of a resolved task is < 1; the completion still counts
    assert is_correct(_reward("r", 0, components=repo, value=0.9))
    assert not is_correct(_reward("r", 1, components={**repo, "resolved": 0.0}, value=0.95))
    assert not is_correct(_reward("r", 2, components={"correct": 0.0, "resolved": 1.0}, value=1.0))  # correct first
    assert is_correct(_reward("r", 3, components={}, value=1.0))  # neither: the scalar


def test_eval_rows_carry_tokens_cpu_and_sandbox_seconds(tmp_path):
    store = open_store(None, tmp_path)
    try:
        store.record_evals(
            [EvalResult(run_id="c", version=0, step=0, domain="repo", score=0.0, n=2, eval_set_sha256="h")]
        )  # nothing spent yet: every cost is NULL
        r0 = _reward("c", 0, components={"resolved": 0.0}, value=0.0, tool_ms=(250.0, 750.0), sandbox_s=1.5)
        r1 = _reward("c", 1, components={"resolved": 1.0}, value=1.0, tool_ms=(500.0,), sandbox_s=2.0)
        assert reward_sandbox_seconds(r0) == pytest.approx(2.5)  # 1 s of tool runs (the refused call ran none)
        assert store.record_rewards([r0, r1]) == 2
        assert store.record_rewards([r0]) == 0  # redelivered: counted once
        store.set_cost("c", "rollout", cpu_seconds=30.0, tokens=1200)
        store.set_cost("c", "verifier", cpu_seconds=4.5)
        store.record_evals(
            [EvalResult(run_id="c", version=1, step=5, domain="repo", score=0.5, n=2, eval_set_sha256="h")]
        )
        e0, e1 = store.rows(EvalResultRow, "c", order_by="version")
        assert (e0.cost_tokens, e0.cost_cpu_seconds, e0.cost_sandbox_seconds) == (None, None, None)
        assert (e1.cost_tokens, e1.cost_cpu_seconds) == (1200, 34.5)
        assert e1.cost_sandbox_seconds == pytest.approx(5.0)
        assert sorted(r.sandbox_seconds for r in store.rows(RewardRow, "c")) == [pytest.approx(2.5), pytest.approx(2.5)]
    finally:
        store.close()


def test_an_older_store_gets_the_sandbox_columns(tmp_path):
    con = sqlite3.connect(tmp_path / "run.db")
    con.execute(
        "CREATE TABLE rewards (msg_id VARCHAR NOT NULL PRIMARY KEY, run_id VARCHAR NOT NULL, "
        "domain VARCHAR NOT NULL, difficulty INTEGER NOT NULL, purpose VARCHAR NOT NULL, reward FLOAT NOT NULL, "
        "status VARCHAR NOT NULL, policy_version INTEGER NOT NULL, task_msg_id VARCHAR NOT NULL, "
        "created_at FLOAT NOT NULL)"
    )
    con.execute("INSERT INTO rewards VALUES ('m', 'o', 'repo', 0, 'train', 1.0, 'ok', 0, 't', 1.0)")
    con.execute(
        "CREATE TABLE eval_results (msg_id VARCHAR NOT NULL PRIMARY KEY, run_id VARCHAR NOT NULL, "
        "version INTEGER NOT NULL, step INTEGER NOT NULL, domain VARCHAR NOT NULL, score FLOAT NOT NULL, "
        "n INTEGER NOT NULL, eval_set_sha256 VARCHAR NOT NULL, purpose VARCHAR NOT NULL DEFAULT 'train', "
        "created_at FLOAT NOT NULL, cost_cpu_seconds FLOAT, cost_gpu_seconds FLOAT, cost_tokens INTEGER)"
    )
    con.execute("INSERT INTO eval_results VALUES ('e', 'o', 0, 0, 'repo', 0.5, 2, 'h', 'train', 1.0, 3.0, 0.0, 9)")
    con.commit()
    con.close()
    store = open_store(None, tmp_path)
    try:
        assert [(r.msg_id, r.sandbox_seconds) for r in store.rows(RewardRow)] == [("m", 0.0)]
        assert [(e.cost_tokens, e.cost_sandbox_seconds) for e in store.rows(EvalResultRow)] == [(9, None)]
        assert store.sandbox_seconds("o") == 0.0 and store.sandbox_seconds("none") is None
    finally:
        store.close()
    open_store(None, tmp_path).close()  # opening again changes nothing


def _docker() -> bool:
    from sandbox_workers.factory import docker_available

    return docker_available()


@pytest.mark.docker
@pytest.mark.skipif(not _docker(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)")
def test_the_repo_verifier_reports_its_sandbox_time_into_the_store(tmp_path):
    from producers.repo_fixtures import fixture_tasks
    from sandbox_workers.docker_pool import shutdown_pools
    from sandbox_workers.repo_image import ensure_repo_image
    from verifier_workers.worker import score

    ensure_repo_image()
    task = fixture_tasks()["fixture-clamp"]
    traj = Trajectory(
        run_id="d",
        task_id=task.task_id,
        task_msg_id="ev1.repo.0-rd",
        domain="repo",
        purpose="eval",
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="repo",
        verifier_params={"timeout_s": 60},
        hidden_ref="h",
        policy_version=0,
        artifacts={"diff": task.gold_patch.encode()},
    )
    try:
        reward = score(traj, {"task": dataclasses.asdict(task)})
    finally:
        shutdown_pools()
    assert reward.components["resolved"] == 1.0 and is_correct(reward)
    assert 0.0 < reward.sandbox_seconds <= reward.verify_seconds
    store = open_store(None, tmp_path)
    try:
        store.record_rewards([reward])
        store.record_evals(
            [EvalResult(run_id="d", version=0, step=0, domain="repo", score=1.0, n=1, eval_set_sha256="h")]
        )
        (row,) = store.rows(EvalResultRow, "d")
        assert row.cost_sandbox_seconds == pytest.approx(reward.sandbox_seconds)
    finally:
        store.close()
