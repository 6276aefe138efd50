"""Repository-task episodes (issue 18): the tools in both formats, observation caps, the context
budget, the diff export, the scripted engine and the `repo` domain kind.

Docker tests (marked `docker`, skipped with the reason when no engine answers) run real episodes in
the repo sandbox image (`rlbus sandbox build-image --repo`, built on first use) with the real run
tokenizer (a tiny BPE model's), and score them with the real `repo` verifier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bus.conn import ensure_topology
from bus.hidden import HiddenDataMissing, get_hidden, put_hidden
from bus.subjects import Registry
from producers.domains import make_source
from producers.repo_cache import load_task
from rollout_workers.agent import run_episodes
from rollout_workers.engines.scripted_engine import EMPTY_STEPS, ScriptedEngine, gold_steps, write_script
from rollout_workers.repo_tools import RUNNER_PATH
from sandbox_workers.base import ExecResult
from sandbox_workers.integrity import obs_caps, render_observation
from schemas.config import RunConfig
from schemas.repo_task import PROMPT_TASK_LINE, RepoTask, unified_diff
from schemas.tool_protocol import REPO_TOOLS, parse_call, repo_call_text

FIXTURE = "fixture-clamp"
SECRET = b"r" * 32


def repo_config(**params) -> RunConfig:
    return RunConfig.model_validate(
        {
            "sampler": {
                "group_size": 2,
                "domains": {
                    "repo": {
                        "max_turns": 8,
                        "max_tokens": 1024,
                        "params": {
                            "tasks": [FIXTURE, "fixture-wordcount", "fixture-stack"],
                            "eval_tasks": ["fixture-partial"],
                            **params,
                        },
                    }
                },
            }
        }
    )


# ---------------------------------------------------------------- pure: protocol, caps, domain, runner
@pytest.mark.parametrize("fmt", ["tags", "json"])
def test_every_repo_tool_round_trips_in_both_formats(fmt):
    calls = {
        "list_files": {"path": "."},
        "read_file": {"path": "calc/ops.py", "start": 2, "end": 9},
        "write_file": {"path": 'a "q".py', "content": "x = '<b>' & 1\n\n"},
        "apply_patch": {"unified_diff": "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"},
        "run": {"command": "python -m pytest -q tests 2>&1 | tail -3"},
        "submit": {},
    }
    for tool, args in calls.items():
        text = "thinking... " + repo_call_text(tool, args, fmt) + " trailing"
        call = parse_call(text, fmt, list(REPO_TOOLS))
        assert call is not None and not call.error and call.tool == tool and call.args == args, (tool, call)
        assert text[: call.end].endswith(">")
    bad = {
        "tags": '<read_file start="one">x.py</read_file>',
        "json": '<tool_call>{"name": "read_file", "arguments": {"path": "x", "start": "one"}}</tool_call>',
    }[fmt]
    call = parse_call(bad, fmt, list(REPO_TOOLS))
    assert call.error == "bad_arguments" and "start" in call.detail
    unknown = parse_call('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "json", list(REPO_TOOLS))
    assert unknown.error == "unknown_tool"
    assert parse_call("no call here", fmt, list(REPO_TOOLS)) is None


def test_observations_are_capped_head_and_tail_with_a_flag():
    out = "HEAD" + "x" * 20000 + "TAIL"
    text = render_observation(ExecResult(0, out, "e" * 5000 + "LAST"), *obs_caps((400, 200)))
    assert text.startswith("<obs exit=0 trunc>") and "HEAD" in text and "TAIL" in text and "LAST" in text
    assert len(text) < 800 and "chars cut]" in text
    assert render_observation(ExecResult(0, "short", ""), *obs_caps((400, 200))) == "<obs exit=0>\nshort\n</obs>"


def test_repo_domain_tasks_hide_the_tests_and_hold_out_eval_tasks():
    src = make_source("r1", "repo", repo_config())
    drawn = [src.make_task(None, 1, i) for i in range(6)]
    ids = {d.hidden["task"]["task_id"] for d in drawn}
    assert ids == {FIXTURE, "fixture-wordcount", "fixture-stack"}  # every training task flows, round robin
    d = drawn[0]
    task = RepoTask(**d.hidden["task"])
    assert d.task.verifier == "repo" and d.task.tools == list(REPO_TOOLS) and d.task.workspace == task.files
    assert f"{PROMPT_TASK_LINE}{task.task_id}" in d.task.prompt[0].content
    wire = d.task.model_dump_json()
    for hidden_path, text in task.hidden_files.items():
        assert hidden_path not in d.task.workspace and text not in wire
    assert task.gold_patch not in wire
    ev = src.eval_problems(10, 0)
    assert [RepoTask(**e.hidden["task"]).task_id for e in ev] == ["fixture-partial"]
    assert ev == src.eval_problems(10, 99) or [e.task.prompt for e in ev] == [
        e.task.prompt for e in src.eval_problems(10, 99)
    ]


def _runner(cwd: Path, *argv: str, stdin_file: str | None = None) -> subprocess.CompletedProcess:
    if stdin_file is not None:
        (cwd / ".rlbus-tool-input").write_text(stdin_file)
    return subprocess.run(
        [sys.executable, "-c", RUNNER_PATH.read_text(), *argv], cwd=cwd, capture_output=True, text=True, timeout=30
    )


def test_the_in_sandbox_runner_patches_atomically_and_reports_state(tmp_path):
    task = load_task(FIXTURE)
    for path, text in task.files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    r = _runner(tmp_path, "patch", stdin_file=task.gold_patch)
    assert r.returncode == 0 and r.stdout.startswith("applied:"), r.stderr
    again = _runner(tmp_path, "patch", stdin_file=task.gold_patch)  # context no longer matches: nothing written
    assert again.returncode == 2 and "does not match" in again.stderr
    state = json.loads(_runner(tmp_path, "state").stdout)
    assert set(state) == set(task.files) and not (tmp_path / ".rlbus-tool-input").exists()
    assert _runner(tmp_path, "read", "../etc/passwd", "1", "0").returncode == 2
    listing = _runner(tmp_path, "list", ".").stdout.split()
    assert sorted(listing) == sorted(task.files)


async def test_large_hidden_payloads_are_chunked_and_checked(js, run_id, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    payload = {"task": {"files": {f"f{i}.py": "x" * 3000 for i in range(40)}}}
    await put_hidden(js, reg, "repo.big", payload, inline_max=10_000, chunk_bytes=16_384)
    assert await get_hidden(js, reg, "repo.big") == payload
    kv = await js.key_value(reg.hidden_bucket)
    await kv.put("repo.big.c1", b"tampered")
    with pytest.raises(HiddenDataMissing, match="corrupt"):
        await get_hidden(js, reg, "repo.big")


# ---------------------------------------------------------------- docker: real episodes
def _engine() -> bool:
    from sandbox_workers.factory import docker_available

    return docker_available()


def docker_only(fn):
    """Marked `docker`; skipped with the reason when no engine answers."""
    skip = pytest.mark.skipif(not _engine(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)")
    return pytest.mark.docker(skip(fn))


@pytest.fixture(scope="module")
def repo_image():
    from sandbox_workers.docker_pool import shutdown_pools
    from sandbox_workers.repo_image import REPO_TAG, ensure_repo_image

    ensure_repo_image()
    yield REPO_TAG
    shutdown_pools()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    from rlbus.model.tiny_model import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("tok") / "m", tokenizer="bpe", hidden_size=32, num_layers=1, num_heads=2
        )
    )


def opener(js, reg, image: str, opened: list):
    from sandbox_workers.async_sandbox import LocalAsyncSandbox
    from sandbox_workers.base import Limits
    from sandbox_workers.integrity import LocalRecorder

    recorder = LocalRecorder(js, reg, SECRET)

    async def open_one(repo: bool = False):
        assert repo, "a repo task opens a repo sandbox"
        sb = await LocalAsyncSandbox.open(
            "docker", image=image, limits=Limits(memory_mb=512, pids=64), timeout=60, recorder=recorder, warm_pool=0
        )
        opened.append(sb)
        return sb

    return open_one


async def episode(
    js, run_id, tokenizer_dir, image, steps, *, fmt="tags", budget=None, task_id=FIXTURE, tmp=None, group=1
):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    cfg = repo_config(tasks=[task_id])
    cfg.sampler.domains["repo"].tool_format = fmt
    drawn = make_source(run_id, "repo", cfg).make_task(None, 1, 0)
    drawn.task = drawn.task.model_copy(update={"group_size": group})
    write_script(tmp, task_id, steps)
    engine = ScriptedEngine(tokenizer_dir, str(tmp))
    opened: list = []
    eps = await run_episodes(
        engine,
        [drawn.task],
        version=lambda: 0,
        open_sandbox=opener(js, reg, image, opened),
        tool_timeout=60,
        context_budget=budget or 16384,
        obs_caps=(1200, 600),
    )
    assert all(sb.closed for sb in opened)
    return eps, drawn


def score(ep, drawn):
    from verifier_workers.verifiers.repo import verify_repo

    return verify_repo(ep.trajectory(), drawn.hidden)


@docker_only
@pytest.mark.parametrize("fmt", ["tags", "json"])
async def test_tools_run_in_a_docker_sandbox_in_both_formats(
    js, run_id, drop_run, repo_image, tokenizer_dir, tmp_path, fmt
):
    task = load_task(FIXTURE)
    target = next(p for p in task.files if p.endswith(".py") and "test" not in p and "__init__" not in p)
    fixed = unified_diff(task.files, {**task.files, "NOTES.md": "looked at it\n"})
    steps = [
        {"tool": "list_files", "args": {"path": "."}},
        {"tool": "read_file", "args": {"path": target, "start": 1, "end": 3}},
        {"tool": "run", "args": {"command": "python3 -c \"print('y' * 9000)\""}},
        {"tool": "write_file", "args": {"path": "scratch/new.py", "content": "VALUE = 1\n"}},
        {"tool": "apply_patch", "args": {"unified_diff": fixed}},
        {
            "tool": "run",
            "args": {"command": "rm scratch/new.py && python -m pytest -q -p no:cacheprovider 2>&1 | tail -2"},
        },
        {"tool": "read_file", "args": {"path": "../../etc/passwd"}},
        {"tool": "submit", "args": {}},
    ]
    (ep,), drawn = await episode(js, run_id, tokenizer_dir, repo_image, steps, fmt=fmt, tmp=tmp_path)
    tools = [c.tool for c in ep.tool_calls]
    assert tools == [s["tool"] for s in steps] and ep.finish_reason == "stop"
    obs = [t.text for t in ep.turns if t.role == "tool"]
    assert all(path in obs[0] for path in task.files) and "lines 1-3" in obs[1]
    assert "<obs exit=0 trunc>" in obs[2] and len(obs[2]) < 1600 and ep.tool_calls[2].exit_code == 0
    assert "wrote scratch/new.py" in obs[3] and "applied: NOTES.md" in obs[4]
    assert ep.tool_calls[6].exit_code == 2 and "error:" in obs[6]
    assert all(c.exec_id for c in ep.tool_calls[:-1])  # every call but submit is a recorded execution
    assert ep.artifacts["diff"].decode() == fixed  # the new file, but not the removed scratch file
    v = score(ep, drawn)
    assert v.components["applied"] == 1.0 and v.components["resolved"] == 0.0


@docker_only
async def test_the_scripted_gold_patch_resolves_and_the_empty_script_does_not(
    js, run_id, drop_run, repo_image, tokenizer_dir, tmp_path
):
    task = load_task(FIXTURE)
    (gold, gold2), drawn = await episode(
        js, run_id, tokenizer_dir, repo_image, gold_steps(task.gold_patch), tmp=tmp_path / "gold", group=2
    )  # G samples: each its own sandbox
    assert gold2.artifacts == gold.artifacts and gold2.sandbox is None
    (empty,), _ = await episode(js, run_id, tokenizer_dir, repo_image, list(EMPTY_STEPS), tmp=tmp_path / "empty")
    assert gold.artifacts["diff"].decode() == task.gold_patch and empty.artifacts["diff"] == b""
    assert all(len(t.token_ids) > 0 for t in gold.turns) and gold.tool_calls[0].exit_code == 0
    g, e = score(gold, drawn), score(empty, drawn)
    assert g.components["resolved"] == 1.0 and e.components["resolved"] == 0.0, (g.details, e.details)


@docker_only
async def test_the_context_budget_ends_an_episode_with_length_and_it_is_still_verified(
    js, run_id, drop_run, repo_image, tokenizer_dir, tmp_path
):
    """A budget that fits the prompt, the apply_patch turn and its observation but not one more
    turn of max_tokens: the episode ends with `length` right after the patch, and its last
    state (the patched repository) is exported and resolves."""
    task = load_task(FIXTURE)
    steps = [
        {"tool": "apply_patch", "args": {"unified_diff": task.gold_patch}},
        {"tool": "run", "args": {"command": "python -m pytest -q -p no:cacheprovider"}},
        *EMPTY_STEPS,
    ]
    (full,), _ = await episode(js, run_id, tokenizer_dir, repo_image, steps, tmp=tmp_path / "a")
    used = sum(len(t.token_ids) // 4 for t in full.turns[:3])  # prompt, the patch turn, its observation
    (ep,), drawn = await episode(
        js, run_id, tokenizer_dir, repo_image, steps, budget=used + 1024 - 1, tmp=tmp_path / "b"
    )
    assert full.finish_reason == "stop" and len(full.tool_calls) == 3
    assert ep.finish_reason == "length" and [c.tool for c in ep.tool_calls] == ["apply_patch"]
    assert ep.artifacts["diff"].decode() == task.gold_patch
    assert score(ep, drawn).components["resolved"] == 1.0


# ---------------------------------------------------------------- docker: the example, end to end
ROOT = Path(__file__).resolve().parent.parent


BY_REFERENCE = (
    "--set",
    "sampler.domains.repo.params.max_workspace_bytes=64",
    "--set",
    "rollout.artifact_inline_bytes=64",
)
"""Limits under every fixture repository (about 400 bytes) and gold diff: both travel by reference."""


@docker_only
@pytest.mark.parametrize("by_reference", [False, True], ids=["inline", "by-reference"])
def test_rlbus_up_repo_example_gold_scripts_complete_every_eval_task(tmp_path, repo_image, by_reference):
    """`rlbus up examples/repo.toml` on the small fixture repositories with gold scripts: every
    published task is accounted for (lost 0) and the pipeline eval's completion rate is 1.0; the
    same with every repository and diff by reference (`bus.payloads`), eval tasks (published by
    the scheduler) included."""
    scripts = tmp_path / "gold"
    for tid in ("fixture-wordcount", "fixture-stack", "fixture-clamp", "fixture-partial"):
        write_script(scripts, tid, gold_steps(load_task(tid).gold_patch))
    run_id = f"repoup{abs(hash(str(tmp_path))) % 10**6}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            str(ROOT / "examples" / "repo.toml"),
            "--run-dir",
            str(tmp_path / "runs"),
            "--run-id",
            run_id,
            "--set",
            "run.max_minutes=1.6",
            "--set",
            "run.drain_seconds=20",
            "--set",
            f"rollout.scripted.dir={scripts}",
            "--set",
            "sampler.max_inflight_tasks=4",
            "--set",
            'sampler.domains.repo.params.tasks=["fixture-wordcount", "fixture-stack"]',
            "--set",
            'sampler.domains.repo.params.eval_tasks=["fixture-clamp", "fixture-partial"]',
            "--set",
            "scheduler.eval.timeout_s=90",
            *(BY_REFERENCE if by_reference else ()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    s = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert s["lost"] == 0 and s["dead_letters"] == 0 and s["tasks_published"] > 0, s
    assert sum(s["task_fates"].values()) == s["tasks_published"], s["task_fates"]
    repo = s["domains"]["repo"]
    assert repo["reward_mean"] == 1.0 and set(repo["statuses"]) == {"ok"}, repo
    ev = s["eval"]["repo"]
    # every pipeline round completes both eval tasks; the first round is recorded under the version
    # rollout served then, which under load can already be version 1 (then `baseline`, v0's score, is None)
    assert ev["n"] == 2 and ev["curve"] and set(ev["curve"].values()) == {1.0}, ev
    if by_reference:
        _check_by_reference(tmp_path / "runs" / run_id)


def _check_by_reference(run_path: Path) -> None:
    """Every stored reward's diff is a ref to its gold patch; every repository is in the payload store."""
    import asyncio

    from bus.payloads import get_payload, pack_files, payload_name, payload_ref
    from bus.weight_stores import NatsStore
    from rlbus.run.reader import iter_rewards, jetstream, reach_run

    async def read(access) -> tuple[list, set[str]]:
        async with jetstream(access, "pytest-by-reference") as js:
            rewards = [r async for _, r in iter_rewards(js, access.reg, "repo")]
            for r in rewards:
                ref = r.trajectory.artifact_refs["diff"]
                gold = load_task(r.trajectory.verifier_params["repo_task"]).gold_patch.encode()
                assert "diff" not in r.trajectory.artifacts and await get_payload(js, access.reg, ref) == gold
            return rewards, set(await NatsStore(js, access.reg.workspace_bucket).names())

    with reach_run(run_path) as access:
        rewards, names = asyncio.run(read(access))
        reg = access.reg
    assert {r.trajectory.purpose for r in rewards} == {"train", "eval"}
    for tid in ("fixture-wordcount", "fixture-stack", "fixture-clamp", "fixture-partial"):
        assert payload_name(payload_ref(reg, pack_files(load_task(tid).files)).sha256) in names, tid


class _LocalDir:
    """The two calls `export_diff` makes, run for real on a local directory (the runner as a subprocess)."""

    def __init__(self, root: Path):
        self.root = root

    async def execute(self, argv, timeout):
        p = subprocess.run([sys.executable, *argv[1:]], cwd=self.root, capture_output=True, text=True, timeout=60)
        out = p.stdout
        cap = 1 << 20  # the sandbox's output cap
        return ExecResult(exit_code=p.returncode, stdout=out[:cap], stderr=p.stderr, truncated=len(out) > cap)

    async def read_file(self, path):
        return (self.root / path).read_bytes()


def test_attack_oversized_export_is_the_episodes_zero(tmp_path):
    """A policy that makes the repository's state listing huge (issue 27) gets a refused export for its
    own trajectory (scored 0 by the verifier, `schemas.repo_task.EXPORT_REFUSED`), never an
    ExportFailed that fails the whole rollout batch; a small change still exports as a diff."""
    import asyncio

    from rollout_workers.repo_tools import export_diff
    from schemas.repo_task import EXPORT_REFUSED

    original = {"pkg/a.py": "A = 1\n"}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/a.py").write_text("A = 2\n")
    diff, skipped = asyncio.run(export_diff(_LocalDir(tmp_path), original))
    assert "+A = 2" in diff and not skipped
    many = tmp_path / "many"
    many.mkdir()
    for i in range(6000):
        (many / f"{i:05d}-{'x' * 80}.txt").write_text("")
    diff, skipped = asyncio.run(export_diff(_LocalDir(tmp_path), original))
    assert diff.startswith(EXPORT_REFUSED) and "over" in diff and skipped == []
