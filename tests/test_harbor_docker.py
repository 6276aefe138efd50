"""Harbor tasks in real containers (marked `docker`; skipped with the reason when no engine
answers): the oracle / empty check of every fixture, the repo -> Harbor round trip, scripted
episodes through the agent loop and the `harbor` verifier, the handover labels, infrastructure
errors, the agent's time limit, and `rlbus verify --script`. The hacks: tests/test_harbor_hacks.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from producers.domains import make_source
from schemas.config import load_config
from schemas.harbor_task import find_tasks, read_task

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "examples" / "harbor"
CONFIG = ROOT / "examples" / "harbor.toml"


def _engine() -> bool:
    from sandbox_workers.factory import docker_available

    return docker_available()


pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(not _engine(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)"),
]


@pytest.fixture(scope="module")
def toolchain():
    from sandbox_workers.repo_image import ensure_repo_image

    ensure_repo_image()  # the verifier's trusted toolchain (pytest)


@pytest.fixture
def checks(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBUS_HARBOR_CHECKS", str(tmp_path / "checks"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from rlbus.model.tiny_model import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("tok") / "m", tokenizer="bpe", hidden_size=32, num_layers=1, num_heads=2
        )
    )


def test_every_fixture_passes_its_oracle_and_empty_checks_but_the_broken_ones(toolchain, checks):
    from sandbox_workers.harbor_check import cached_check, check_task

    cfg = load_config(str(CONFIG))
    results = {t.name: check_task(read_task(t), cfg.harbor) for t in map(Path, find_tasks(str(FIXTURES / "*")))}
    failed = {name: r.reason for name, r in results.items() if not r.ok}
    assert set(failed) == {"broken-no-reward", "multi-step"}, failed
    assert results["broken-no-reward"].oracle_status == "no_reward_file" and "[[steps]]" in failed["multi-step"]
    for name, r in results.items():
        if r.ok:
            assert (r.oracle, r.empty, r.oracle_status) == (1.0, 0.0, "ok"), (name, r)
    assert cached_check(read_task(FIXTURES / "hello-file"), cfg.harbor).ok  # cached for `rlbus up`


def test_repo_tasks_round_trip_through_harbor_directories(toolchain, checks, tmp_path):
    from producers.repo_cache import list_tasks
    from rlbus.commands.harbor_export import export_repo_task
    from sandbox_workers.harbor_check import check_task

    cfg = load_config(str(CONFIG))
    picked = {t.task_id.split("-")[0]: t for t in list_tasks(None)}  # one task of each package
    for repo in picked.values():
        r = check_task(read_task(export_repo_task(repo, tmp_path)), cfg.harbor)
        assert r.ok and (r.oracle, r.empty) == (1.0, 0.0), (repo.task_id, r.reason)


async def _episode(tokenizer_dir, tmp_path, name: str, steps: list[dict] | None, **params):
    from rlbus.commands.tasks_harbor import gold_steps
    from rollout_workers.agent import run_episodes
    from rollout_workers.engines.scripted_engine import EMPTY_STEPS, ScriptedEngine, write_script
    from sandbox_workers.harbor_images import ensure_task_image

    cfg = load_config(
        str(CONFIG), [f'sampler.domains.tb.tasks="{FIXTURES / name}"', "sampler.domains.tb.params.eval_tasks=[]"]
    )
    drawn = make_source("rt", "tb", cfg).make_task(None, 1, 0)
    task = drawn.task.model_copy(update={"group_size": 1})
    if params:
        task = task.model_copy(update={"verifier_params": {**task.verifier_params, **params}})
    ensure_task_image(read_task(FIXTURES / name), dict(cfg.harbor.image_map))
    hid = task.verifier_params["harbor_task"]
    write_script(
        tmp_path, hid, gold_steps(read_task(FIXTURES / name).solution) if steps is None else steps or list(EMPTY_STEPS)
    )

    async def no_generic_sandbox(repo: bool = False):
        raise AssertionError("a harbor task never opens the generic sandbox")

    (ep,) = await run_episodes(
        ScriptedEngine(tokenizer_dir, str(tmp_path)),
        [task],
        version=lambda: 0,
        open_sandbox=no_generic_sandbox,
        tool_timeout=60,
        context_budget=16384,
    )
    return ep, drawn


def _alive(cid: str) -> bool:
    from sandbox_workers.harbor_box import client

    return bool(client().api.containers(all=True, filters={"id": cid}))


async def test_scripted_oracle_and_empty_episodes_verify_and_free_their_containers(
    toolchain, checks, tokenizer_dir, tmp_path
):
    from verifier_workers.verifiers.harbor import verify_harbor

    gold, drawn = await _episode(tokenizer_dir, tmp_path / "g", "csv-report", None)
    cid = gold.artifacts["harbor_container"].decode()
    assert gold.finish_reason == "stop" and [c.tool for c in gold.tool_calls][-2:] == ["bash", "submit"] and _alive(cid)
    v = verify_harbor(gold.trajectory(), drawn.hidden)
    assert (
        v.status == "ok"
        and v.reward == 1.0
        and v.components == {"reward": 1.0, "header": 1.0, "rows": 1.0, "sorted": 1.0}
    )
    assert not _alive(cid)  # the verifier removed the handed-over container
    empty, drawn = await _episode(tokenizer_dir, tmp_path / "e", "csv-report", [])
    assert "harbor_container" not in empty.artifacts  # no tool call: no container; a pristine one is scored
    v = verify_harbor(empty.trajectory(), drawn.hidden)
    assert v.status == "ok" and v.reward == 0.0 and v.components["header"] == 0.0


async def test_the_service_the_agent_left_running_answers_the_tests(toolchain, checks, tokenizer_dir, tmp_path):
    from verifier_workers.verifiers.harbor import verify_harbor

    gold, drawn = await _episode(tokenizer_dir, tmp_path, "service-kv", None)
    v = verify_harbor(gold.trajectory(), drawn.hidden)
    assert v.reward == 1.0, v.details


async def test_a_container_that_is_not_the_episodes_is_refused_and_a_stopped_or_gone_one_is_infra(
    toolchain, checks, tokenizer_dir, tmp_path
):
    from sandbox_workers.harbor_box import client, remove_container
    from verifier_workers.verdict import VerifierInputError
    from verifier_workers.verifiers.harbor import HarborInfraError, verify_harbor

    a, drawn = await _episode(tokenizer_dir, tmp_path / "a", "hello-file", None)
    traj = a.trajectory()
    other = traj.model_copy(update={"sample_index": 1})
    with pytest.raises(VerifierInputError, match="is not this episode's"):
        verify_harbor(other, drawn.hidden)
    assert a.artifacts["harbor_state"] == b"running"
    client().api.kill(a.artifacts["harbor_container"].decode())  # the engine stops it after the handover
    with pytest.raises(HarborInfraError, match="has stopped since"):
        verify_harbor(traj, drawn.hidden)
    remove_container(a.artifacts["harbor_container"].decode())
    with pytest.raises(HarborInfraError, match="is gone"):
        verify_harbor(traj, drawn.hidden)


async def test_the_agents_time_limit_ends_the_episode_and_it_is_still_verified(
    toolchain, checks, tokenizer_dir, tmp_path
):
    from verifier_workers.verifiers.harbor import verify_harbor

    steps = [{"tool": "bash", "args": {"command": "sleep 2"}}, {"tool": "bash", "args": {"command": "echo late"}}]
    ep, drawn = await _episode(tokenizer_dir, tmp_path, "hello-file", steps, agent_timeout_s=1)
    assert ep.finish_reason == "timeout" and len(ep.tool_calls) == 1
    assert verify_harbor(ep.trajectory(), drawn.hidden).reward == 0.0


async def test_a_failed_command_that_filled_the_disk_still_ends_the_episode(toolchain, checks, tokenizer_dir, tmp_path):
    """storage_mb (hello-file: 256) is checked after every bash call, failed ones too."""
    from verifier_workers.verifiers.harbor import verify_harbor

    # a file is capped at storage_mb (RLIMIT_FSIZE), so two files pass it; the command then fails
    fill = "; ".join(f"dd if=/dev/zero of=/app/fill{i} bs=1M count=150 status=none" for i in (1, 2)) + "; exit 1"
    steps = [{"tool": "bash", "args": {"command": fill}}, {"tool": "bash", "args": {"command": "echo later"}}]
    ep, drawn = await _episode(tokenizer_dir, tmp_path, "hello-file", steps)
    assert ep.finish_reason == "error" and len(ep.tool_calls) == 1, (ep.finish_reason, ep.tool_calls)
    assert verify_harbor(ep.trajectory(), drawn.hidden).reward == 0.0


def test_rlbus_verify_runs_a_script_as_the_agent(toolchain, checks, tmp_path):
    script = tmp_path / "s.sh"
    script.write_text("printf 'Hello, Harbor!\\n' > /app/hello.txt\n")
    cmd = [sys.executable, "-m", "rlbus.cli", "verify", "--domain", "tb", "--config", str(CONFIG)]
    out = subprocess.run(
        [*cmd, "--task-id", "hello-file", "--script", str(script)], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert (line["reward"], line["status"], line["backend"]) == (1.0, "ok", "docker")
    bad = subprocess.run([*cmd, "--task-id", "nope", "--script", str(script)], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "no task 'nope'" in bad.stderr


async def test_the_sft_demonstration_of_solve_sh_solves_its_task(toolchain, checks, tokenizer_dir, tmp_path):
    """sft_from_solution: the one-call `bash` demonstration, replayed as the agent, scores the top."""
    import random

    from schemas.tool_protocol import HARBOR_TOOLS, parse_call
    from verifier_workers.verifiers.harbor import verify_harbor

    sets = [f'sampler.domains.tb.tasks="{FIXTURES / "json-from-csv"}"', "sampler.domains.tb.params.eval_tasks=[]"]
    cfg = load_config(str(CONFIG), [*sets, "sampler.domains.tb.params.sft_from_solution=true"])
    _, *calls = make_source("rt", "tb", cfg).demonstration(random.Random(0), 1)
    parsed = [parse_call(text, "tags", list(HARBOR_TOOLS)) for text, _ in calls]
    steps = [{"tool": c.tool, "args": c.args} for c in parsed]
    assert [s["tool"] for s in steps] == ["bash", "submit"]
    ep, drawn = await _episode(tokenizer_dir, tmp_path, "json-from-csv", steps)
    v = verify_harbor(ep.trajectory(), drawn.hidden)
    assert v.status == "ok" and v.reward == 1.0, v
