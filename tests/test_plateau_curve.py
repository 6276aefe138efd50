"""Plateau detection on recorded demo curves (tests/data/demo_plateau_curves.json): with the
demo's settings (examples/demo.toml `[scheduler.plateau]`) it does not fire while the curve
still rises under the n = 200 sets' noise (and on one that peaked, only after the peak), while
the bare slope of the old settings fired on the session-3 run at version 150 although accuracy
rose after it; and it still finds a flat curve (seeded binomial simulations, not mocks: the
same arithmetic a run's evals feed it)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from scheduler.gates import first_plateau, slope_se
from schemas.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CURVES = json.loads((ROOT / "tests" / "data" / "demo_plateau_curves.json").read_text())["runs"]
DEMO = load_config(ROOT / "examples" / "demo.toml").scheduler


def points(run: dict) -> list[tuple[int, float, float]]:
    """(version, cost in samples, capability) as `Gates.after_eval` built them."""
    return [(int(v), float(c), float(cap)) for v, c, cap in run["points"]]


def demo_plateau(pts: list, domains: int):
    pc = DEMO.plateau
    return first_plateau(pts, pc.window, pc.threshold, problems=DEMO.eval.n * domains, z=pc.z)


RISING = sorted(n for n, r in CURVES.items() if "rise_ends_at" not in r)


@pytest.mark.parametrize("name", RISING)
def test_recorded_rising_demo_curve_is_not_a_plateau(name):
    run = CURVES[name]
    pts = points(run)
    assert pts[-1][2] > pts[0][2]  # it rose over the run
    # scanning every window is the run's whole history: Gates latches the first detection
    found = demo_plateau(pts, run["domains"])
    assert not found.detected, found
    if len(pts) >= DEMO.plateau.window:
        assert found.gain_se is not None and found.gain_se > 0


PEAKED = sorted(n for n, r in CURVES.items() if "rise_ends_at" in r)


@pytest.mark.parametrize("name", PEAKED)
def test_a_recorded_curve_that_peaks_fires_only_after_its_rise(name):
    run = CURVES[name]  # e.g. issue20_demo6: arith rose to v200, then fell back
    pts = points(run)
    for end in range(1, len(pts) + 1):  # as the run saw it, one evaluation at a time
        found = demo_plateau(pts[:end], run["domains"])
        if pts[end - 1][0] <= run["rise_ends_at"]:
            assert not found.detected, (end, found)
    assert found.detected and found.at_version > run["rise_ends_at"]


def test_the_bare_slope_fired_on_the_session3_curve_while_it_rose():
    run = CURVES["session3_demo_b"]
    found = first_plateau(points(run), 4, 0.01)  # the settings the run had
    assert found.detected and found.at_version == run["bare_slope_plateau_at"]


def _simulated(
    seed: int, gain_per_1k: float, evals: int = 12, n: int = 400, start: float = 0.3, step: float = 6400.0
) -> list[tuple[int, float, float]]:
    rng = random.Random(seed)
    return [
        (50 * i, i * step, sum(rng.random() < start + gain_per_1k * i * step / 1000 for _ in range(n)) / n)
        for i in range(evals)
    ]


def test_demo_settings_find_flat_curves_and_spare_rising_ones():
    flat = [demo_plateau(_simulated(s, 0.0), 2).detected for s in range(100)]
    rising = [demo_plateau(_simulated(s, 0.002), 2).detected for s in range(100)]
    assert sum(flat) >= 85, sum(flat)
    assert sum(rising) <= 8, sum(rising)
    bare = [first_plateau(_simulated(s, 0.002), 4, 0.01).detected for s in range(100)]
    assert all(bare)  # the old default fired on every rising curve of this scale


def test_slope_se_by_hand():
    # equal variances: SE = sigma / sqrt(Sxx); xs 0..3 -> Sxx = 5
    assert slope_se([0, 1, 2, 3], [0.04] * 4) == pytest.approx(0.2 / math.sqrt(5))
    assert slope_se([1, 1], [0.1, 0.1]) is None


def test_the_guard_only_ever_delays_detection():
    pts = [(0, 0, 0.5), (1, 1000, 0.5), (2, 2000, 0.49), (3, 3000, 0.5), (4, 4000, 0.2)]
    bare = first_plateau(pts, 3, 0.01)
    guarded = first_plateau(pts, 3, 0.01, problems=200, z=1.0)
    assert bare.detected and bare.at_version == 2 and bare.gain_se is None
    assert guarded.detected and guarded.at_version == 4 and guarded.gain_se > 0
