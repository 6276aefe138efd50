"""`rlbus up examples/agent.toml`: mini-swe-agent (unmodified) through `kind = "agent"`, end to end.

- scripted engine, gold scripts: every episode's diff resolves its task (reward 1.0), lost 0;
- the tiny model (hf engine) drives mini: episodes are recorded through the endpoint, verified by
  the repo verifier, trained (learner steps, trained samples), nothing lost or dead-lettered.

Marked `e2e` (a whole run each) and `docker` (the repo verifier's containers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("minisweagent", reason="the agents extra: pip install -e '.[agents]'")

from tests.test_repo_episode import docker_only

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("fixture-wordcount", "fixture-stack", "fixture-clamp")


@pytest.fixture(scope="module")
def repo_image():
    from sandbox_workers.docker_pool import shutdown_pools
    from sandbox_workers.repo_image import REPO_TAG, ensure_repo_image

    ensure_repo_image()
    yield REPO_TAG
    shutdown_pools()


def up(tmp_path: Path, run_id: str, *sets: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "up", str(ROOT / "examples" / "agent.toml"), "--run-dir",
         str(tmp_path / "runs"), "--run-id", run_id, "--set", "run.max_minutes=4", "--set", "run.drain_seconds=90",
         *(a for s in sets for a in ("--set", s))],
        cwd=ROOT, capture_output=True, text=True, timeout=560,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())


@pytest.mark.e2e
@docker_only
def test_rlbus_up_mini_swe_agent_scripted_resolves_every_task(tmp_path, repo_image):
    from producers.repo_cache import load_task
    from rollout_workers.engines.scripted_engine import gold_steps, write_script

    for tid in TASKS:
        write_script(tmp_path / "gold", tid, gold_steps(load_task(tid).gold_patch))
    s = up(tmp_path, "agentscripted", f"rollout.scripted.dir={tmp_path / 'gold'}")
    assert s["lost"] == 0 and s["dead_letters"] == 0 and s["tasks_published"] > 0, s
    swe = s["domains"]["swe"]
    assert swe["rewards"] > 0 and swe["reward_mean"] == 1.0 and set(swe["statuses"]) == {"ok"}, swe


@pytest.mark.e2e
@docker_only
def test_rlbus_up_mini_swe_agent_tiny_model_is_recorded_verified_trained(tmp_path, repo_image):
    s = up(tmp_path, "agenttiny", "rollout.engine=hf", "sampler.domains.swe.max_tokens=64")
    assert s["lost"] == 0 and s["dead_letters"] == 0 and s["trained_twice"] == 0, s
    swe = s["domains"]["swe"]
    assert swe["rewards"] > 0 and set(swe["statuses"]) <= {"ok", "harness_error"}, swe
    assert s["steps"] > 0 and s["trained_samples"] > 0, s
