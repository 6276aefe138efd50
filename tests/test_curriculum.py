"""Curriculum: softmax-of-gap weights with floors, EMA, promotion/demotion, snapshots."""

from __future__ import annotations

import json
import math
import random

import pytest

from scheduler.curriculum import Curriculum, DomainSpec, apply_floors, softmax


def test_softmax_of_gap_hand_computed():
    cur = Curriculum(
        {"a": DomainSpec(target_reward=0.8), "b": DomainSpec(target_reward=0.8)}, temperature=0.2, ema_alpha=1.0
    )
    cur.observe("a", 1, [0.2])  # gap 0.6 -> logit 3
    cur.observe("b", 1, [0.6])  # gap 0.2 -> logit 1
    w = cur.weights()
    assert w["a"] == pytest.approx(1 / (1 + math.exp(-2)))  # 0.880797
    assert w["b"] == pytest.approx(1 / (1 + math.exp(2)))  # 0.119203
    assert w["a"] == pytest.approx(0.880797, abs=1e-6)


def test_floor_hand_computed_two_domains():
    cur = Curriculum({"a": DomainSpec(0.8), "b": DomainSpec(0.8, floor_share=0.2)}, temperature=0.2, ema_alpha=1.0)
    cur.observe("a", 1, [0.2])
    cur.observe("b", 1, [0.6])
    assert cur.weights() == pytest.approx({"a": 0.8, "b": 0.2})


def test_floor_water_filling_three_domains():
    # raw shares 0.7 / 0.2 / 0.1, floors 0 / 0 / 0.25: c pinned at 0.25, a and b share 0.75 as 7:2
    out = apply_floors({"a": 0.7, "b": 0.2, "c": 0.1}, {"a": 0.0, "b": 0.0, "c": 0.25})
    assert out == pytest.approx({"a": 0.75 * 7 / 9, "b": 0.75 * 2 / 9, "c": 0.25})
    # raising b's floor to 0.2 (0.75*2/9 = 0.1667 < 0.2) pins it too: a gets the rest
    out = apply_floors({"a": 0.7, "b": 0.2, "c": 0.1}, {"a": 0.0, "b": 0.2, "c": 0.25})
    assert out == pytest.approx({"a": 0.55, "b": 0.2, "c": 0.25})
    assert softmax([0.0, 0.0], 1.0) == pytest.approx([0.5, 0.5])


def test_floors_respected_under_random_rewards():
    rng = random.Random(0)
    specs = {
        f"d{i}": DomainSpec(target_reward=rng.uniform(0.3, 1.0), floor_share=f)
        for i, f in enumerate([0.05, 0.1, 0.0, 0.3])
    }
    cur = Curriculum(specs, temperature=0.05, ema_alpha=0.3)
    for _ in range(300):
        d = rng.choice(list(specs))
        cur.observe(d, 1, [rng.random() ** 3 for _ in range(4)])
        w = cur.weights()
        assert sum(w.values()) == pytest.approx(1.0)
        for name, spec in specs.items():
            assert w[name] >= spec.floor_share - 1e-12


def test_floors_over_one_rejected():
    with pytest.raises(ValueError, match="floor shares"):
        Curriculum({"a": DomainSpec(floor_share=0.6), "b": DomainSpec(floor_share=0.6)})


def test_weights_shift_toward_hard_domain():
    rng = random.Random(1)
    cur = Curriculum(
        {"easy": DomainSpec(0.8, floor_share=0.05), "hard": DomainSpec(0.8, floor_share=0.05)},
        temperature=0.5,
        ema_alpha=0.1,
    )
    trajectory = [cur.weights()["hard"]]
    assert trajectory[0] == pytest.approx(0.5)
    for _ in range(40):
        cur.observe("easy", 1, [min(1.0, max(0.0, rng.gauss(0.9, 0.05))) for _ in range(4)])
        cur.observe("hard", 1, [min(1.0, max(0.0, rng.gauss(0.1, 0.05))) for _ in range(4)])
        trajectory.append(cur.weights()["hard"])
    assert cur.ema("easy") == pytest.approx(0.9, abs=0.05)
    assert cur.ema("hard") == pytest.approx(0.1, abs=0.05)
    # gaps -0.1 and 0.7 at T=0.5: hard gets 1/(1+e^-1.6) = 0.832
    assert trajectory[-1] == pytest.approx(1 / (1 + math.exp(-1.6)), abs=0.03)
    assert trajectory[-1] - trajectory[0] > 0.25
    assert cur.weights()["easy"] < 0.2


def test_group_ema_equals_sample_updates():
    a = Curriculum({"x": DomainSpec()}, ema_alpha=0.2)
    b = Curriculum({"x": DomainSpec()}, ema_alpha=0.2)
    a.observe("x", 1, [0.0])
    b.observe("x", 1, [0.0])
    a.observe("x", 1, [1.0, 1.0, 1.0])
    for _ in range(3):
        b.observe("x", 1, [1.0])
    assert a.ema("x") == pytest.approx(b.ema("x")) == pytest.approx(1 - 0.8**3)


def test_promotion_and_demotion_bounded_with_min_samples():
    cur = Curriculum({"x": DomainSpec(levels=(1, 3))}, promote_at=0.75, demote_at=0.25, window=8, min_samples=8)
    # all-correct groups count as signal: 4 samples are not enough yet, 8 promote
    assert cur.observe("x", 1, [1.0] * 4) is None
    change = cur.observe("x", 1, [1.0] * 4)
    assert change is not None and change.kind == "promote" and (change.old_level, change.new_level) == (1, 2)
    assert cur.level("x") == 2 and cur.success_rate("x") == 0.0  # fresh history at the new level
    # late results of level 1 are recorded but decide nothing
    assert cur.observe("x", 1, [0.0] * 8) is None and cur.level("x") == 2
    assert cur.observe("x", 2, [1.0] * 8).new_level == 3
    assert cur.observe("x", 3, [1.0] * 16) is None and cur.level("x") == 3  # bounded at max
    # all-wrong groups demote, one level per min_samples
    assert cur.observe("x", 3, [0.0] * 5) is None  # window of 8: 3/8 still above demote_at
    change = cur.observe("x", 3, [0.0] * 2)  # 1/8 <= 0.25
    assert change.kind == "demote" and cur.level("x") == 2
    assert cur.observe("x", 2, [0.0] * 8).new_level == 1
    assert cur.observe("x", 1, [0.0] * 8) is None and cur.level("x") == 1  # bounded at min


def test_middling_success_rate_holds_level():
    cur = Curriculum({"x": DomainSpec(levels=(1, 5), start_level=3)}, promote_at=0.8, demote_at=0.2, window=10)
    for _ in range(10):
        assert cur.observe("x", 3, [1.0, 0.0]) is None
    assert cur.level("x") == 3 and cur.success_rate("x") == 0.5


def test_snapshot_round_trip():
    cur = Curriculum(
        {"a": DomainSpec(0.7, 0.1, (1, 4), 2), "b": DomainSpec(0.9, 0.0, (0, 2))},
        temperature=0.3,
        ema_alpha=0.25,
        window=4,
        min_samples=4,
    )
    cur.observe("a", 2, [1.0, 1.0, 1.0, 1.0])
    cur.observe("a", 3, [0.0, 1.0])
    cur.observe("b", 0, [0.25])
    snap = cur.snapshot()
    text = json.dumps(snap)  # plain JSON
    back = Curriculum.restore(json.loads(text))
    assert back.snapshot() == snap
    assert back.weights() == pytest.approx(cur.weights())
    assert back.level("a") == 3 and back.success_rate("a") == 0.5
    # and it keeps evolving identically
    assert back.observe("a", 3, [1.0, 1.0]) == cur.observe("a", 3, [1.0, 1.0])
    assert back.snapshot() == cur.snapshot()
    with pytest.raises(ValueError, match="version"):
        Curriculum.restore({**snap, "version": 99})
