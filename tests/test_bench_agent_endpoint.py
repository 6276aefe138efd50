"""`bench/agent_endpoint.py --quick`: the in-process agent loop and the OpenAI-compatible endpoint
(driven by the `openai` client) generate the same tokens on the same episodes, and the result JSON
has the headline fields and the per-call overheads (about 10 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

for module in ("openai", "fastapi", "uvicorn"):
    pytest.importorskip(module)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
def test_quick_bench_same_tokens_both_sides_and_overheads(tmp_path):
    out = tmp_path / "agent_endpoint.json"
    r = subprocess.run(
        [sys.executable, "bench/agent_endpoint.py", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["settings"]
    assert (s["episodes"], s["turns"], s["max_tokens"], s["reps"], s["temperature"]) == (2, 2, 8, 1, 0.0)
    assert s["order"] == ["in_process", "endpoint", "endpoint_nodelay"] and s["word_tokens"] > 50
    # the same episodes: every side generated every token, the same replies, no drift
    assert res["tokens"] == {"in_process": 32, "endpoint": 32, "endpoint_nodelay": 32, "expected_per_rep": 32}
    assert res["replies_identical"] == "4/4" and res["nodelay"]["replies_identical"] == "4/4"
    assert res["drift_calls"] == 0
    sides = res["sides"]
    assert sides["in_process"]["prompt_tokens_per_call"] == sides["endpoint"]["prompt_tokens_per_call"]
    assert sides["in_process"]["engine_calls_per_rep"]["p50"] == 2  # one batched engine call per turn
    assert res["ours"] > 0 and res["peer"] > 0
    assert res["ratio"] == pytest.approx(res["ours"] / res["peer"], rel=0.01)
    assert res["target"] == {"ratio": 0.8} and res["met"] == (res["ratio"] >= 0.8)
    for key in ("client", "server", "before_engine", "after_engine", "minus_share"):
        o = res["overhead_ms"][key]
        assert o["n"] == 4 and o["p50"] <= o["p99"], key
    assert res["overhead_ms"]["client"]["p50"] > 0 and res["overhead_ms"]["latency"]["p50"] > 0
    assert res["command"] == f"python bench/agent_endpoint.py --quick --out {out}"
    assert "tokens/s (median)" in r.stdout
