"""bench/first_step.py's timeline: which worker log events mark which point, first occurrence only."""

from __future__ import annotations

import importlib
import json
from datetime import datetime, timezone


def _line(event: str, t: float, **kw) -> str:
    ts = datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "timestamp": ts, **kw})


def test_the_timeline_reads_each_point_from_the_worker_logs(tmp_path):
    bench = importlib.import_module("bench.first_step")
    logs = tmp_path / "logs"
    logs.mkdir()
    t0 = 1_000_000.0
    (logs / "learner.log").write_text(
        "\n".join(
            [
                _line("learner.started", t0 + 1),
                "not json",
                _line("learner.lease_acquired", t0 + 2),
                _line("learner.step", t0 + 4, step=1),
                _line("learner.step", t0 + 5, step=2),
            ]
        )
    )
    (logs / "rollout.log").write_text(
        "\n".join([_line("rollout.weights_loaded", t0 + 3, version=0), _line("rollout.weights_loaded", t0 + 6)])
    )
    (logs / "scheduler.log").write_text(
        "\n".join([_line("scheduler.eval", t0 + 7, version=5), _line("scheduler.eval", t0 + 8, version=0)])
    )
    marks = bench.worker_marks(tmp_path, t0)
    assert marks == {
        "learner_started": 1.0,
        "learner_ready": 2.0,
        "first_step": 4.0,
        "rollout_ready": 3.0,
        "baseline_eval": 8.0,
    }
    rows = [
        {"config": "examples/smoke.toml", "sft": "off", "timeline": marks, "first_step_s": 4.0, "after_sft_s": 3.0},
        {
            "config": "examples/smoke.toml",
            "sft": "off",
            "timeline": {"first_step": 6.0},
            "first_step_s": 6.0,
            "after_sft_s": None,
        },
    ]
    case = bench.summarize(rows)["smoke sft=off"]
    assert case["first_step_median_s"] == 5.0 and case["after_sft_median_s"] == 3.0 and case["runs"] == 2
