"""bench/long_context.py --engine vllm, tiny (`make test-vllm`: marked `vllm`, runs in .venv-vllm).

One short history, 2 turns, both sides (prefix caching off and on) in one run: the bench must
finish, write its report, find the greedy ids of both sides equal (it exits non-zero
otherwise), and show vLLM's prefix cache hitting on the reuse side only.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM: make vllm-env; make test-vllm")
def test_vllm_long_context_bench_smoke(tmp_path):
    out = tmp_path / "long_context_vllm.json"
    cmd = [sys.executable, "bench/long_context.py", "--engine", "vllm", "--histories", "300", "--turns", "2"]
    cmd += ["--gen", "4", "--obs", "16", "--repeats", "1", "--kv-cache-mb", "64", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engine"] == "vllm" and report["version"].startswith("vllm ")
    assert report["ids_equal"] is True and report["growth_exponent_later_turn"] is None
    point = report["histories"]["300"]
    for side in ("full", "reuse"):
        assert point[side]["later_turn_s"] > 0 and point[side]["tokens_per_s"] > 0
    assert point["prompt_tokens_last_turn"] > 300
    assert point["full"]["prefix_cache_hit_rate"] == 0.0
    # turn 1: the second episode reuses the first one's two 128-token blocks of the shared filing;
    # turn 2: both reuse their turn-1 blocks: about 0.5 of all prompt tokens (0 with caching off)
    assert point["reuse"]["prefix_cache_hit_rate"] > 0.4
