"""`bench/gpu_check.py` runs where only torch + transformers (+ safetensors, numpy, msgpack) are
installed: the CPU smoke shape, in a subprocess that cannot import the project's service
dependencies (nats, pydantic, structlog, sqlmodel, and rich/peft/vllm), prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("nats", "pydantic", "structlog", "sqlmodel", "rich", "peft", "vllm")
# sys.modules[name] = None: `import name` raises ImportError and importlib.util.find_spec(name)
# answers None, exactly as when the package is not installed
SITECUSTOMIZE = f"import sys\nfor _name in {BLOCKED!r}:\n    sys.modules[_name] = None\n"
KEYS = {"device", "learner_tok_s", "mfu", "generate_tok_s", "publish_gb_s", "step", "loop", "params"}


def blocked_env(tmp_path: Path) -> dict:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
def test_gpu_check_cpu_tiny_without_service_deps(tmp_path):
    env = blocked_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import pydantic"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert probe.returncode != 0 and "None in sys.modules" in probe.stderr  # the block works
    r = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny", "--publish-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    out = json.loads(lines[0])
    assert KEYS <= set(out), sorted(KEYS - set(out))
    assert out["device"] == "cpu" and out["mfu"] is None and out["loop"] is None
    assert out["step"].startswith("learner.losses.policy_loss")  # the project's GRPO loss, not the fallback
    for key in ("learner_tok_s", "generate_tok_s", "publish_gb_s"):
        assert isinstance(out[key], (int, float)) and out[key] > 0, (key, out[key])
    assert out["publish_bytes"] > 4 * out["params"] - 1  # fp32, each tensor once
    assert [r["history"] for r in out["longctx"]] == [64, 128, 256]  # issue 33's prefix-reuse bench, GPU side
    assert all(r["ids_equal"] for r in out["longctx"]), out["longctx"]  # reuse changes no greedy token
    assert out["longctx_exponent_off"] is not None and out["longctx_exponent_on"] is not None
    assert list(tmp_path.iterdir()) == [tmp_path / "sitecustomize.py"]  # the weight file went with its temp dir
