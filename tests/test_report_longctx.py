"""`rlbus report`'s long-context views on a run store filled by the store's own write functions:
eval groups from `group_scores` (per length, per position bucket, and joint), rewards recorded
from real `Reward` messages with their episode tokens; the series hand-checked, the plots written."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbus.report.build import build_report
from rlbus.report.longctx import length_accuracy, recall_grid, tokens_reward
from scheduler.pipeline_eval import group_scores
from scheduler.store import open_store
from scheduler.store_rows import EvalResultRow, RewardRow
from schemas import EvalResult, Reward, Task, Trajectory, Turn, pack_i32
from schemas.chat import user_prompt

T0 = 1_700_000_000.0
PNG = b"\x89PNG\r\n\x1a\n"


def _task(i: int, length: int, bucket: str) -> Task:
    return Task(
        run_id="lc",
        task_id=f"e{i}",
        domain="recall",
        group_size=1,
        max_tokens=8,
        temperature=0.0,
        prompt=user_prompt("find the key"),
        verifier="recall",
        verifier_params={"length": length, "position_bucket": bucket},
    )


def _reward(i: int, context: int, value: float) -> Reward:
    traj = Trajectory(
        run_id="lc",
        task_id=f"t{i}",
        task_msg_id=f"task-{i}",
        domain="findoc",
        group_id=f"g{i}",
        group_size=1,
        sample_index=0,
        turns=[
            Turn(role="prompt", text="doc", token_ids=pack_i32(range(context - 2))),
            Turn(role="assistant", text="42", token_ids=pack_i32([1, 2]), trainable=True, policy_version=1),
        ],
        verifier="findoc",
        policy_version=1,
    )
    return Reward(run_id="lc", trajectory=traj, reward=value, created_at=T0 + i)


@pytest.fixture
def run_path(tmp_path) -> Path:
    path = tmp_path / "runs" / "lc"
    store = open_store(None, path)
    store.ensure_run("lc", {})
    # 512 tokens: both buckets right; 1024: only the early one; 2048: none (a missing reward counts wrong)
    tasks = [_task(i, n, b) for i, (n, b) in enumerate((n, b) for n in (512, 1024, 2048) for b in ("0-10", "90-100"))]
    got = {t.msg_id: Reward(run_id="lc", trajectory=_reward(0, 4, 0).trajectory, reward=1.0) for t in tasks[:3]}
    groups = group_scores(tasks, got)["recall"]
    old = {"length": {"512": 0.0}, "length|position_bucket": {"512|0-10": 0.0}}  # v0: before RL
    store.record_evals(
        [
            EvalResult(run_id="lc", version=v, step=v, domain="recall", score=0.5, n=6, eval_set_sha256="h", groups=g)
            for v, g in ((0, old), (1, groups))
        ]
        + [EvalResult(run_id="lc", version=1, step=1, domain="arith", score=0.5, n=6, eval_set_sha256="h")]
    )
    store.record_rewards(
        [_reward(i, c, v) for i, (c, v) in enumerate([(100, 1.0), (110, 1.0), (1000, 0.0), (900, 1.0)])]
    )
    store.close()
    return path


def test_groups_and_tokens_are_stored_and_read_back(run_path):
    store = open_store(None, run_path)
    try:
        evals, rewards = store.rows(EvalResultRow, "lc", "created_at"), store.rows(RewardRow, "lc")
    finally:
        store.close()
    assert sorted(r.tokens for r in rewards) == [100, 110, 900, 1000]  # prompt + model turn ids
    assert length_accuracy(evals) == {"recall": (1, [(512.0, 1.0), (1024.0, 0.5), (2048.0, 0.0)])}  # v1 wins
    version, lengths, buckets, grid = recall_grid(evals)["recall"]
    assert (version, lengths, buckets) == (1, ["512", "1024", "2048"], ["0-10", "90-100"])
    assert grid == [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
    assert recall_grid(evals, first=True)["recall"] == (0, ["512"], ["0-10"], [[0.0]])  # the before-RL eval
    series = tokens_reward(rewards, bins=2)["findoc"]
    assert [(round(x), y, n) for x, y, n in series] == [(105, 1.0, 2), (949, 0.5, 2)]


def test_report_has_the_long_context_section(run_path):
    text = build_report(run_path).read_text()
    assert "## Long context" in text
    assert "- recall accuracy by length (v1): 512: 1.00, 1024: 0.50, 2048: 0.00" in text
    assert "weakest cell length 1024, position 90-100%: 0.00" in text
    assert "- findoc: 4 episodes" in text
    for name in ("accuracy_vs_length", "recall_heatmap", "tokens_vs_reward"):
        assert (run_path / "plots" / f"{name}.png").read_bytes()[:8] == PNG and f"plots/{name}.png" in text


def test_heatmap_draws_before_and_after_side_by_side(tmp_path):
    from rlbus.report.plots import recall_heatmap

    after = {"recall": (3, ["512", "1024"], ["0-10", "90-100"], [[1.0, 0.5], [None, 0.0]])}
    before = {"recall": (0, ["512", "1024"], ["0-10", "90-100"], [[0.0, 0.0], [0.0, None]])}
    one = recall_heatmap(tmp_path / "one.png", after, {"recall": after["recall"]}).read_bytes()
    two = recall_heatmap(tmp_path / "two.png", after, before).read_bytes()
    assert one[:8] == two[:8] == PNG
    width = int.from_bytes(one[16:20], "big"), int.from_bytes(two[16:20], "big")  # the PNG header's width
    assert width[1] > 1.8 * width[0]  # a second panel: before (v0) beside after (v3)


def test_empty_store_says_nothing_recorded(tmp_path):
    path = tmp_path / "runs" / "empty"
    open_store(None, path).close()
    text = build_report(path).read_text()
    assert "no length groups, recall cells or episode tokens recorded" in text
    assert (path / "plots" / "recall_heatmap.png").read_bytes()[:8] == PNG
