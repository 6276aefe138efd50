"""`rlbus up examples/harbor.toml` end to end (marked `slow` and `docker`): the scripted oracles
complete every held-out task (eval 1.0), empty scripts none (0.0); lost = 0, the disabled tasks
are named at start, and no episode container of the run is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "harbor.toml"


def _engine() -> bool:
    from sandbox_workers.factory import docker_available

    return docker_available()


pytestmark = [
    pytest.mark.slow,
    pytest.mark.docker,
    pytest.mark.skipif(not _engine(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)"),
]


def _rlbus(*args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("kind,want", [("gold", 1.0), ("empty", 0.0)])
def test_the_harbor_example_scores_its_oracles_and_its_empty_scripts(kind, want, tmp_path):
    from sandbox_workers.harbor_box import RUN_LABEL, client
    from sandbox_workers.images import ensure_image
    from sandbox_workers.repo_image import ensure_repo_image

    ensure_image()  # the run's generic docker sandbox
    ensure_repo_image()  # the verifier's toolchain
    env = {**os.environ, "RLBUS_HARBOR_CHECKS": str(tmp_path / "checks")}
    scripts = tmp_path / kind
    made = _rlbus(
        "tasks", "scripts", "--domain", "tb", "--config", str(CONFIG), "--out", str(scripts),
        *(["--empty"] if kind == "empty" else []), env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    up = _rlbus(
        "up", str(CONFIG), "--run-dir", str(tmp_path / "runs"),
        "--set", f"rollout.scripted.dir={scripts}", "--set", "run.max_minutes=2", env=env, timeout=900,
    )  # fmt: skip
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "harbor tb: 13 tasks, 11 runnable, 2 disabled" in up.stdout
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    s = json.loads(summary.read_text())
    assert s["lost"] == 0 and s["dead_letters"] == 0 and s["rewards"] > 0
    assert s["eval"]["tb"]["final"] == want and s["eval"]["tb"]["n"] == 4
    assert set(s["domains"]["tb"]["statuses"]) == {"ok"}
    left = client().api.containers(all=True, filters={"label": f"{RUN_LABEL}={s['run_id']}"})
    assert left == []
