"""`rlbus verify` as a user runs it (a real subprocess of the installed entry point): code, math, arith, extract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from producers.domains import code as he

RLBUS = Path(sys.executable).with_name("rlbus")


def verify(tmp_path: Path, answer: str, *args: str) -> tuple[int, dict | None, str]:
    f = tmp_path / "answer.txt"
    f.write_text(answer)
    p = subprocess.run(
        [str(RLBUS), "verify", *args, "--answer-file", str(f)], capture_output=True, text=True, timeout=120
    )
    lines = p.stdout.splitlines()
    assert len(lines) <= 1, p.stdout
    return p.returncode, json.loads(lines[0]) if lines else None, p.stderr


def test_code_right_and_wrong(tmp_path):
    p = he.get("HumanEval/0")
    rc, out, err = verify(
        tmp_path,
        p.prompt + p.canonical_solution,
        "--domain",
        "code",
        "--task-id",
        "HumanEval/0",
        "--backend",
        "process",
    )
    assert rc == 0, err
    assert out["reward"] == 1.0 and out["status"] == "ok" and out["backend"] == "process"
    assert set(out) == {"reward", "components", "status", "details", "backend"}
    rc, out, _ = verify(
        tmp_path, p.prompt + "    return None\n", "--domain", "code", "--task-id", "HumanEval/0", "--backend", "process"
    )
    assert rc == 0 and out["reward"] == 0.0 and out["components"]["compiles"] == 1.0


def test_code_tamper_and_bad_task_id(tmp_path):
    rc, out, _ = verify(
        tmp_path, "import sys\nsys.exit(0)\n", "--domain", "code", "--task-id", "HumanEval/3", "--backend", "process"
    )
    assert rc == 0 and (out["reward"], out["status"]) == (0.0, "tamper")
    rc, out, err = verify(tmp_path, "x", "--domain", "code", "--task-id", "HumanEval/999", "--backend", "process")
    assert rc == 2 and out is None and "HumanEval/0" in err


def test_math(tmp_path):
    rc, out, _ = verify(tmp_path, "so the answer is \\boxed{\\frac{1}{2}}", "--domain", "math", "--gold", "0.5")
    assert rc == 0 and out["reward"] == 1.0 and out["backend"] == "none"
    rc, out, _ = verify(tmp_path, "\\boxed{3}", "--domain", "math", "--gold", "0.5")
    assert rc == 0 and out["reward"] == 0.0
    rc, _, err = verify(tmp_path, "\\boxed{3}", "--domain", "math")
    assert rc == 2 and "--gold" in err


def test_arith_and_extract(tmp_path):
    rc, out, _ = verify(tmp_path, "87", "--domain", "arith", "--task-id", "12*7+3")
    assert rc == 0 and out["reward"] == 1.0
    rc, out, _ = verify(tmp_path, "86", "--domain", "arith", "--task-id", "12*7+3")
    assert rc == 0 and out["reward"] == 0.0
    rc, out, _ = verify(
        tmp_path,
        'here: {"name": "Ada", "year": 1843}',
        "--domain",
        "extract",
        "--gold",
        '{"name": "Ada", "year": 1843}',
    )
    assert rc == 0 and out["reward"] == 1.0


@pytest.mark.parametrize("argv", [["verify", "--help"]])
def test_help_explains_every_verifier(argv):
    p = subprocess.run([str(RLBUS), *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for word in ("code", "math", "arith", "extract", "HumanEval/0", "--backend"):
        assert word in p.stdout
