"""`bench/learner_scale.py --quick` on the `tiny` size: every side starts, steps and reports,
and the JSON has the schema the issue asks for (one row per size and rank count)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is in the bench extra: pip install -e '.[bench]'")

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = {
    "params",
    "world_size",
    "ours_tok_s",
    "trl_tok_s",
    "ratio",
    "ours_peak_rss_mb",
    "trl_peak_rss_mb",
    "mem_ratio",
    "padding_fraction",
    "steps_timed_per_side",
    "completion_lengths",
    "threads",
    "load_avg_start",
}


@pytest.mark.e2e
def test_quick_tiny_writes_rows(tmp_path):
    out = tmp_path / "scale.json"
    r = subprocess.run(
        [sys.executable, "bench/learner_scale.py", "--quick", "--sizes", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(row["size"], row["world_size"]) for row in rows] == [("tiny", 1), ("tiny", 2)]
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
        assert row["params"] > 100_000 and row["ours_tok_s"] > 0 and row["trl_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["trl_tok_s"], rel=0.01)
        assert row["mem_ratio"] == pytest.approx(row["ours_peak_rss_mb"] / row["trl_peak_rss_mb"], rel=0.01)
        assert 0 <= row["padding_fraction"] < row["trl_padding_fraction"]
        assert row["completion_lengths"]["min"] >= 64 and row["completion_lengths"]["max"] <= 512
    assert rows[1]["ours_peak_rss_mb"] > rows[0]["ours_peak_rss_mb"]  # two rank processes, summed
    assert result["ratio_geomean"] == pytest.approx(rows[0]["ratio"], rel=0.01)
    assert {"torch", "trl", "load_avg", "targets", "targets_met"} <= result.keys()
    assert "tokens/s ratio ours/TRL" in r.stdout
