"""bench/long_tail.py: the metric derivation (learner idle, rollout idle near version boundaries,
staleness, group completion latency, percentiles), the sleep domain's heavy-tailed mix, and an
e2e smoke of one tiny side."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import long_tail as lt


def test_percentile_nearest_rank():
    assert lt.percentile([], 50) is None
    assert lt.percentile([3, 1, 2], 50) == 2
    values = list(range(1, 101))
    assert lt.percentile(values, 50) == 50 and lt.percentile(values, 99) == 99 and lt.percentile(values, 100) == 100


def test_learner_idle_counts_only_waits_beyond_the_step_window():
    # steps every 0.5 s over [0, 10]: never idle at window 0.5
    assert lt.learner_idle([0.5 * i for i in range(1, 20)], 0.0, 10.0, 0.5) == pytest.approx(0.0)
    # one step at 5 s: gaps 5 and 5, each waits 4.5 beyond a 0.5 s window
    assert lt.learner_idle([5.0], 0.0, 10.0, 0.5) == pytest.approx(0.9)
    # steps outside the window are ignored; no step at all: all but one window idle
    assert lt.learner_idle([-1.0, 11.0], 0.0, 10.0, 0.5) == pytest.approx(0.95)
    with pytest.raises(ValueError):
        lt.learner_idle([], 1.0, 1.0, 0.5)


def test_rollout_idle_near_versions():
    busy = [(0.0, 4.0), (6.0, 10.0)]
    # a boundary at 5 s, +-1 s: [4, 6] is all idle
    assert lt.rollout_idle_near(busy, [5.0], 1.0) == pytest.approx(1.0)
    # a boundary at 3.5 s: [2.5, 4.5] idle for 0.5 s of 2
    assert lt.rollout_idle_near(busy, [3.5], 1.0) == pytest.approx(0.25)
    # overlapping windows merge ([3, 6]: idle 2 of 3), overlapping busy intervals count once
    assert lt.rollout_idle_near([*busy, (1.0, 3.5)], [4.0, 5.0], 1.0) == pytest.approx(2 / 3)
    assert lt.rollout_idle_near(busy, [], 1.0) is None
    assert lt.union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


def test_batch_intervals_rebuild_the_rollout_batches():
    # batch 1: two trajectories built at ~1.0 s, 0.4 s each -> [0.2, 1.0]; batch 2: one at 3.0 s, 0.5 s
    r = [
        {"traj_at": 1.0, "gen_s": 0.4, "group_id": "a"},
        {"traj_at": 1.01, "gen_s": 0.4, "group_id": "b"},
        {"traj_at": 3.0, "gen_s": 0.5, "group_id": "c"},
    ]
    assert lt.batch_intervals(r) == [(pytest.approx(0.21), 1.01), (2.5, 3.0)]
    assert lt.batch_starts(r) == {"a": pytest.approx(0.21), "b": pytest.approx(0.21), "c": 2.5}


def test_derive_staleness_and_group_latency():
    steps = [(1.0, 1), (2.0, 2), (3.0, 3)]

    def rw(created_at, traj_at, gen_s, oldest, gid):
        return {"created_at": created_at, "traj_at": traj_at, "gen_s": gen_s, "oldest_version": oldest, "group_id": gid}

    rewards = [
        rw(2.5, 2.3, 0.9, 0, "a"),  # stale 2; batch a [0.5, 2.3]
        rw(2.6, 2.3, 0.9, 1, "a"),  # stale 1
        rw(3.5, 3.4, 0.4, 3, "b"),  # stale 0; batch b [3.0, 3.4]
        rw(9.0, 8.9, 0.5, 3, "c"),  # after the window
        rw(0.9, 0.8, 0.3, 1, "d"),  # version 1 before its step line (1.0 s): staleness 0, not -1
    ]
    d = lt.derive(steps, rewards, 0.0, 4.0, samples=8)
    assert d["trained_samples_per_s"] == 2.0
    assert d["staleness_p50"] == 0 and d["staleness_p99"] == 2  # [2, 1, 0, 0]: d's clamped 0, never -1
    assert d["rewards"] == 4 and d["groups"] == 3 and d["steps"] == 3
    # d: 0.9-0.5, b: 3.5-3.0, a: 2.6-0.5
    assert d["group_latency_p50_s"] == 0.5 and d["group_latency_p99_s"] == 2.1
    # boundaries 1, 2, 3 (+-1 s: [0, 4]); busy [0.5, 2.3], [0.5, 0.8] and [3.0, 3.4]: idle 1.8 of 4
    assert d["rollout_idle_near_versions"] == pytest.approx(0.45)


def test_sleep_domain_heavy_tail_mix():
    from producers.domains import make_source
    from schemas.config import load_config

    params = {"seconds": 0.2, "long_fraction": 0.1, "long_factor": 10, "tool_fraction": 0.05, "tool_turns": 3}
    cfg = load_config(
        None, ["sampler.domains.t.kind=sleep", *(f"sampler.domains.t.params.{k}={v}" for k, v in params.items())]
    )
    src = make_source("r", "t", cfg)
    rng = random.Random(0)
    seconds = [src.episode_seconds(rng) for _ in range(4000)]
    share = {s: seconds.count(s) / len(seconds) for s in set(seconds)}
    assert set(share) == {0.2, 2.0, 3.6}  # short, 10x, 3 turns x (0.2 + 1.0 s tool)
    assert share[2.0] == pytest.approx(0.10, abs=0.02) and share[3.6] == pytest.approx(0.05, abs=0.015)
    bad = load_config(None, ["sampler.domains.t.kind=sleep", "sampler.domains.t.params.long_fraction=1.5"])
    with pytest.raises(ValueError, match="long_fraction"):
        make_source("r", "t", bad).episode_seconds(rng)
    plain = load_config(None, ["sampler.domains.t.kind=sleep"])
    assert make_source("r", "t", plain).make_task(rng, 1, 0).task.prompt[0].content == "sleep:0.1"


@pytest.mark.e2e
def test_long_tail_smoke(tmp_path):
    out = tmp_path / "lt.json"
    result = lt.main(["--seconds", "6", "--sides", "defaults,sync", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["sides"].keys() == {"defaults", "sync"} == result["sides"].keys()
    for side in saved["sides"].values():
        assert side["trained_samples_per_s"] > 0 and side["steps"] >= 1
        assert 0.0 <= side["learner_idle"] <= 1.0
