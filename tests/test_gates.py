"""The release gate, the forgetting guard and plateau detection: pure logic on
hand-computed values, then the scheduler glue (`Gates`) against the session's real
nats-server (KV) and a real SQLite run store."""

from __future__ import annotations

import pytest

from bus.conn import ensure_topology
from bus.kv import LEARNER_PROGRESS, STATUS, get_json, put_json
from bus.subjects import Registry
from scheduler.gates import (
    LEARNER_OVERRIDES,
    PLATEAU,
    RELEASE_LATEST,
    STOP_REQUESTED,
    Gates,
    Overrides,
    capability,
    estimated_samples,
    first_plateau,
    forgetting_guard,
    least_squares_slope,
    regression_floors,
    release_gate,
)
from scheduler.store import open_store
from scheduler.store_rows import GateCheckRow
from schemas.config import RunConfig


# -- release gate -------------------------------------------------------------------------
def test_floors_are_the_configured_floor_else_baseline_minus_margin():
    floors = regression_floors({"arith": 0.5, "tool": 0.3}, {"tool": 0.25, "code": 0.1}, 0.02)
    assert floors == pytest.approx({"arith": 0.48, "tool": 0.25, "code": 0.1})


def test_release_gate_passes_at_the_floor_and_fails_below_or_unevaluated():
    base = {"arith": 0.5, "tool": 0.3}
    assert release_gate(3, {"arith": 0.48, "tool": 0.3}, base, {}, 0.02).passed  # exactly at 0.5 - 0.02
    d = release_gate(3, {"arith": 0.47, "tool": 0.9}, base, {}, 0.02)
    assert not d.passed and set(d.failures) == {"arith"} and "0.4700 < floor 0.4800" in d.failures["arith"]
    d = release_gate(3, {"arith": 0.9}, base, {}, 0.02)
    assert d.failures == {"tool": "not evaluated"}
    d = release_gate(3, {"arith": 0.55, "tool": 0.3}, base, {"arith": 0.6}, 0.02)  # a configured floor wins
    assert not d.passed and set(d.failures) == {"arith"}


# -- forgetting guard ---------------------------------------------------------------------
def test_forgetting_guard_trips_only_beyond_the_margin_and_escalates_to_the_caps():
    kw = dict(replay_step=0.1, replay_max=1.0, beta_step=0.01, beta_max=0.2)
    assert forgetting_guard(0.85, 0.9, 0.05, Overrides(0.0, 0.0), **kw) is None  # drop 0.05 = margin: fine
    o = forgetting_guard(0.84, 0.9, 0.05, Overrides(0.0, 0.0), **kw)
    assert (o.replay_share, o.beta) == pytest.approx((0.1, 0.01))
    assert "0.0600 below its baseline 0.9000" in o.reason
    o = forgetting_guard(0.5, 0.9, 0.05, Overrides(0.95, 0.195), **kw)
    assert (o.replay_share, o.beta) == pytest.approx((1.0, 0.2))  # capped
    o = forgetting_guard(0.5, 0.9, 0.05, Overrides(1.0, 0.3), **kw)
    assert (o.replay_share, o.beta) == pytest.approx((1.0, 0.3))  # never lowered


# -- plateau ------------------------------------------------------------------------------
def test_least_squares_slope_by_hand():
    # mean x 1500, mean y 0.4; Sxx = 5e6, Sxy = 300 + 0 + 50 + 150 = 500 -> 1e-4
    assert least_squares_slope([0, 1000, 2000, 3000], [0.2, 0.4, 0.5, 0.5]) == pytest.approx(1e-4)
    assert least_squares_slope([5, 5], [0.1, 0.9]) is None
    assert least_squares_slope([1], [0.1]) is None


def test_first_plateau_is_the_first_window_whose_gain_per_1000_samples_is_below_threshold():
    pts = [(0, 0, 0.2), (1, 1000, 0.4), (2, 2000, 0.5), (3, 3000, 0.5), (4, 4000, 0.5)]
    # windows of 3: gains 0.15, 0.05, 0.0 per 1000 samples
    p = first_plateau(pts, 3, 0.04)
    assert (p.detected, p.at_version, p.window) == (True, 4, 3) and p.gain_per_unit == pytest.approx(0.0)
    p = first_plateau(pts, 3, 0.06)
    assert (p.detected, p.at_version) == (True, 3) and p.gain_per_unit == pytest.approx(0.05)
    p = first_plateau(pts[:3], 3, 0.04)
    assert (p.detected, p.at_version) == (False, None) and p.gain_per_unit == pytest.approx(0.15)
    assert first_plateau(pts[:2], 3, 0.04).gain_per_unit is None


def test_capability_and_cost_estimates():
    assert capability({"a": 0.2, "b": 0.6, "general_arith": 0.0}, ["a", "b"]) == pytest.approx(0.4)
    assert capability({}, ["a"]) is None
    assert estimated_samples(4, {"samples_trained": 640}, None) == 640
    assert estimated_samples(0, None, None) == 0
    assert estimated_samples(4, {}, {"step": 10, "samples_trained": 320}) == pytest.approx(128)
    assert estimated_samples(4, None, None) is None


# -- glue: KV + SQL -----------------------------------------------------------------------
async def test_gates_release_guard_and_plateau_through_kv_and_sql(js, run_id, drop_run, tmp_path):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    cfg = RunConfig()
    sc = cfg.scheduler
    sc.eval.general, sc.eval.release_margin, sc.forgetting.margin = "arith", 0.02, 0.05
    sc.plateau.window, sc.plateau.threshold, sc.plateau.stop = 2, 0.0, True
    store = open_store(None, tmp_path)
    gates = Gates(js, reg, store, cfg)
    await gates.load()
    await put_json(js, reg, LEARNER_PROGRESS, {"step": 10, "samples_trained": 1000})  # 100 samples per step

    row = await gates.after_eval(0, 0, {"arith": 0.5, "general_arith": 0.9})
    assert row["released"] and row["cost_samples"] == 0 and row["capability"] == 0.5
    row = await gates.after_eval(1, 5, {"arith": 0.6, "general_arith": 0.9})
    assert row["released"] and not row["forgetting"] and row["cost_samples"] == pytest.approx(500)
    assert (await get_json(js, reg, RELEASE_LATEST))["version"] == 1
    assert await get_json(js, reg, LEARNER_OVERRIDES) is None
    assert (await get_json(js, reg, PLATEAU))["detected"] is False  # gain +0.2 per 1000 samples

    row = await gates.after_eval(2, 10, {"arith": 0.45, "general_arith": 0.8})  # below 0.48, forgetting 0.1 > 0.05
    assert not row["passed"] and not row["released"] and set(row["failures"]) == {"arith", "general_arith"}
    assert row["forgetting"]
    ov = await get_json(js, reg, LEARNER_OVERRIDES)
    assert (ov["replay_share"], ov["beta"], ov["version"]) == pytest.approx((0.1, 0.01, 2)) and ov["reason"]
    assert (await get_json(js, reg, RELEASE_LATEST))["version"] == 1  # unchanged
    plateau = await get_json(js, reg, PLATEAU)  # window [v1, v2]: (0.45 - 0.6) / 500 * 1000 = -0.3
    assert plateau["detected"] and plateau["at_version"] == 2 and plateau["gain_per_unit"] == pytest.approx(-0.3)
    assert await get_json(js, reg, STATUS) == STOP_REQUESTED

    await gates.after_eval(3, 15, {"arith": 0.7, "general_arith": 0.7})
    ov = await get_json(js, reg, LEARNER_OVERRIDES)
    assert (ov["replay_share"], ov["beta"]) == pytest.approx((0.2, 0.02))  # escalated from the current overrides
    assert (await get_json(js, reg, PLATEAU))["at_version"] == 2  # latched at the first detection

    rows = store.rows(GateCheckRow, run_id, "version")
    assert [(r.version, r.passed, r.released, r.forgetting, r.plateau) for r in rows] == [
        (0, True, True, False, False),
        (1, True, True, False, False),
        (2, False, False, True, True),
        (3, False, False, True, False),
    ]  # v3: general 0.7 < 0.85 fails the gate too
    assert store.latest_released(run_id) == 1

    again = Gates(js, reg, store, cfg)  # a restarted scheduler: baselines from KV, curve from SQL
    await again.load()
    assert again.baseline == {"arith": 0.5, "general_arith": 0.9}
    assert [p[0] for p in again.points] == [0, 1, 2, 3]
    store.close()
