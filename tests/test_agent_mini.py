"""mini-swe-agent (the PyPI package, unmodified: its `mini` CLI and its own litellm text-based
model class pointed at the endpoint) solving a repository task through `kind = "agent"`.

The scripted engine answers in mini-swe-agent's action format (one ```mswea_bash_command block:
the gold patch through `patch -p1`, then `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`); the
harness runs in the bubblewrap sandbox or in its own container of `sandbox.repo_image`
(`agent.sandbox`, both parametrised; the repository image has no `patch` binary, so there the
gold script writes the files the gold patch changes) with the repository in /work; the rollout side exports the
repository's diff and the `repo` verifier scores it in docker: reward 1.0. The empty script
(submit only) scores 0. Marked `docker` (the repo verifier's containers).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

pytest.importorskip("minisweagent", reason="the agents extra: pip install -e '.[agents]'")

from producers.domains import make_source
from rollout_workers.agent_harness import run_agent_tasks, socket_dir
from rollout_workers.endpoint.server import Endpoint
from rollout_workers.engines import make_engine
from rollout_workers.engines.scripted_engine import EMPTY_STEPS, gold_steps, write_script
from schemas.agent_task import AGENT_ARTIFACT
from schemas.config import RunConfig
from tests.test_repo_episode import docker_only
from verifier_workers.worker import score

MINI = [
    "python3", "-m", "minisweagent.run.mini", "-y", "--exit-immediately",
    "-c", "mini_textbased.yaml", "-c", "model.model_class=litellm_textbased",
    "-m", "openai/rlbus-policy", "-l", "0", "-o", "/tmp/mini.traj.json", "-t", "{task}",
]  # fmt: skip
"""The command of examples/agent.toml (mini-swe-agent's own CLI, the task as its -t argument)."""

TASK = "fixture-clamp"


@pytest.fixture(scope="module")
def repo_image():
    from sandbox_workers.docker_pool import shutdown_pools
    from sandbox_workers.repo_image import REPO_TAG, ensure_repo_image

    ensure_repo_image()
    yield REPO_TAG
    shutdown_pools()


def config(model, scripts, box: str = "bwrap") -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model)},
            "rollout": {"engine": "scripted", "scripted": {"dir": str(scripts)}},
            "sampler": {
                "group_size": 1,
                "domains": {
                    "swe": {
                        "kind": "agent",
                        "wraps": "repo",
                        "command": MINI,
                        "max_tokens": 2048,
                        "params": {"tasks": [TASK], "eval_tasks": [], "verifier": {"timeout_s": 120}},
                    }
                },
            },
            "agent": {"timeout_s": 180, "sandbox": box},
        }
    )


async def episode(cfg: RunConfig, model):
    engine = make_engine(cfg.rollout, str(model))
    drawn = make_source("mini", "swe", cfg).make_task(random.Random(0), 1, 0)
    ep = Endpoint(engine, lambda: 0, cfg.rollout.endpoint.model_copy(update={"enabled": True}), context_limit=16384)
    uds = socket_dir()
    await ep.serve(uds)
    try:
        (traj,) = await run_agent_tasks(ep, cfg, [drawn.task], uds)
    finally:
        await ep.stop()
        shutil.rmtree(os.path.dirname(uds), ignore_errors=True)
    return drawn, traj


def gold_file_steps(task) -> list[dict]:
    """The gold patch as `write_file` steps (the files it changes, in their gold state; made
    here with the host's `patch`), then `submit`: the repository image has no `patch` binary."""
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        for path, text in task.files.items():
            (Path(d) / path).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / path).write_text(text)
        subprocess.run(["patch", "-p1", "--batch", "-s"], input=task.gold_patch, text=True, cwd=d, check=True)
        changed = sorted(p for p in task.files if (Path(d) / p).read_text() != task.files[p])
        steps = [{"tool": "write_file", "args": {"path": p, "content": (Path(d) / p).read_text()}} for p in changed]
    assert changed, "the gold patch changes no file"
    return [*steps, {"tool": "submit", "args": {}}]


@pytest.mark.asyncio
@docker_only
@pytest.mark.parametrize("box", ["bwrap", "docker"])
@pytest.mark.parametrize("script", ["gold", "empty"])
async def test_mini_swe_agent_scripted_gold_patch_scores_one(script, box, tmp_path, tiny_model, repo_image):
    from producers.repo_cache import load_task

    task = load_task(TASK)
    gold = gold_steps(task.gold_patch) if box == "bwrap" else gold_file_steps(task)
    write_script(tmp_path, TASK, gold if script == "gold" else EMPTY_STEPS)
    model = tiny_model(tokenizer="bpe", hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=16384)
    drawn, traj = await episode(config(model, tmp_path, box), model)
    rec = json.loads(traj.artifacts[AGENT_ARTIFACT])
    assert rec["status"] == "ok" and rec["isolation"] == box, rec
    assert rec["calls"] == (len(gold) if script == "gold" else 1) and traj.drift == 0
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in traj.turns[-1].text
    diff = traj.artifacts["diff"].decode()
    assert (diff.strip() == task.gold_patch.strip()) if script == "gold" else diff == ""
    reward = score(traj, drawn.hidden)
    assert reward.status == "ok"
    assert reward.reward == (1.0 if script == "gold" else 0.0), reward.details
