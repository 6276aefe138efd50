"""The e2e bench's learning-curve bookkeeping: which of our weight versions stood at each
mark, and the plot. (The bench itself is a 30-minute run, in `bench/`, not a test.)"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from bench.e2e_curves import plot_curves
from bench.e2e_runs import curve_blobs
from learner.retention import version_name


def _event(t: float, version: int, name: str = "learner.step") -> str:
    stamp = datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": name, "timestamp": stamp, "step": version, "version": version})


def test_each_mark_gets_the_newest_version_published_by_then(tmp_path):
    t0 = 1_800_000_000.0
    log = tmp_path / "learner.log"
    weights = tmp_path / "weights"
    weights.mkdir()
    lines = [
        _event(t0 + 5, 1),
        "not json",
        _event(t0 + 9, 2),
        _event(t0 + 9.5, 99, "learner.window_short"),
        _event(t0 + 21, 3),
        _event(t0 + 40, 4),
    ]
    log.write_text("\n".join(lines) + "\n")
    for v in (1, 2, 3):  # version 4 was deleted (retention) -> no blob, but the version is still reported
        (weights / version_name(v)).write_bytes(f"blob{v}".encode())

    got = curve_blobs(log, weights, t0, (3.0, 10.0, 20.0, 30.0, 45.0))

    assert got[3.0] == (0, None)  # nothing published yet: the start
    assert got[10.0] == (2, b"blob2")  # the window_short event is not a publish
    assert got[20.0] == (2, b"blob2")
    assert got[30.0] == (3, b"blob3")
    assert got[45.0] == (4, None)


def test_plot_draws_both_sides(tmp_path):
    result = {
        "start_accuracy": 0.05,
        "model": {"hidden_size": 128},
        "runs": [
            {"ours_curve": [[60, 10, 0.07], [240, "final", 0.09]], "peer_curve": [[60, 8, 0.06], [240, "final", 0.08]]},
            {"ours_curve": [[60, 11, 0.08], [240, "final", 0.10]], "peer_curve": [[60, 9, 0.05], [240, "final", 0.07]]},
        ],
    }
    out = tmp_path / "curve.png"
    plot_curves(result, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_curve_mean_gain_averages_each_runs_points_then_the_runs():
    from bench.e2e_curves import curve_gains

    result = {
        "start_accuracy": 0.10,
        "runs": [
            {
                "ours_curve": [[60, 5, 0.12], [120, 9, None], [240, "final", 0.14]],
                "peer_curve": [[60, 4, 0.10], [240, "final", 0.12]],
            },
            {"ours_curve": [[60, 5, 0.10], [240, "final", 0.12]], "peer_curve": [[60, 4, 0.11], [240, "final", 0.11]]},
        ],
    }
    got = curve_gains(result)
    assert got["ours_per_seed"] == [0.03, 0.01] and got["peer_per_seed"] == [0.01, 0.01]
    assert got["ours"] == 0.02 and got["peer"] == 0.01 and got["ratio"] == 2.0
    assert curve_gains({"start_accuracy": 0.1, "runs": [{}]}) is None


def test_time_to_target_is_the_first_point_at_or_above_start_plus_gain():
    from bench.e2e_curves import time_to_target

    curve = [[30, 100, 0.11], [60, 200, None], [90, 300, 0.125], [240, "final", 0.10]]
    assert time_to_target(curve, 0.10, 0.02) == 90.0  # 0.125 >= 0.12; the end fell back, still reached
    assert time_to_target(curve, 0.10, 0.01) == 30.0  # exactly start + gain counts
    assert time_to_target(curve, 0.10, 0.05) is None  # never: no time, not a number of seconds


def test_times_to_target_per_side_with_misses_counted_as_never():
    from bench.e2e_curves import times_to_target

    result = {
        "start_accuracy": 0.10,
        "runs": [
            {"ours_curve": [[60, 5, 0.12], [240, "final", 0.14]], "peer_curve": [[60, 4, 0.10], [240, "final", 0.09]]},
            {"ours_curve": [[60, 5, 0.10], [240, "final", 0.12]], "peer_curve": [[60, 4, 0.13], [240, "final", 0.11]]},
            {"ours_curve": [[60, 5, 0.09], [240, "final", 0.10]], "peer_curve": [[60, 4, 0.08], [240, "final", 0.08]]},
        ],
    }
    got = times_to_target(result, 0.02)
    assert got["target_accuracy"] == 0.12
    assert got["ours"] == {"seconds_per_seed": [60.0, 240.0, None], "reached": 2, "runs": 3, "median_s": 240.0}
    # TRL reached it in one run of three: the median run never did
    assert got["peer"] == {"seconds_per_seed": [None, 60.0, None], "reached": 1, "runs": 3, "median_s": None}
    assert times_to_target({"start_accuracy": 0.1, "runs": [{}]}, 0.02) is None


def test_retarget_reads_a_recorded_result(tmp_path):
    from bench.e2e_curves import retarget

    path = tmp_path / "r.json"
    path.write_text(
        json.dumps({"start_accuracy": 0.05, "runs": [{"ours_curve": [[30, 3, 0.08]], "peer_curve": [[30, 2, 0.06]]}]})
    )
    got = retarget(path, [0.01, 0.02])
    assert got["0.01"]["ours"]["median_s"] == 30.0 and got["0.01"]["peer"]["median_s"] == 30.0
    assert got["0.02"]["peer"]["median_s"] is None
