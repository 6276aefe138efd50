"""`make bench` in .venv: a benchmark that needs what this Python lacks (vLLM, a CUDA GPU, a
Docker engine) prints one `SKIP bench/<name>.py: needs ...` line and exits 0 (`bench.skip_unless`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: nothing to skip")
def test_vllm_bench_skips_without_vllm():
    r = subprocess.run([sys.executable, "bench/vllm_tiers.py"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    assert lines[0].startswith(
        "SKIP bench/vllm_tiers.py: needs vLLM (make vllm-env; run with .venv-vllm/bin/python bench/vllm_tiers.py)"
    ), lines[0]
    assert "Traceback" not in r.stderr


def test_skip_unless_returns_when_all_is_there(capsys):
    from bench import missing, skip_unless

    skip_unless(__file__, modules=("json",))  # nothing missing: returns, prints nothing
    assert capsys.readouterr().out == ""
    assert missing(__file__, modules=("rlbus_no_such_module",)) == [
        f"the Python module 'rlbus_no_such_module' (not importable in {sys.executable})"
    ]
    with pytest.raises(SystemExit) as exc:
        skip_unless(str(ROOT / "bench" / "x.py"), modules=("rlbus_no_such_module",), hint="try y")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIP bench/x.py: needs the Python module 'rlbus_no_such_module'") and out.endswith(
        "; try y\n"
    )
