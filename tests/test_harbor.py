"""Harbor task directories without a docker engine: the reader, the domain's public and hidden
halves, the tools' call syntax, reward files, the protected-path diff, image tags and the
repo -> Harbor export (read back). The container half is tests/test_harbor_docker.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from producers.domains import DomainContext, DomainUnavailable, make_source
from schemas.config import load_config
from schemas.harbor_task import HarborTaskError, find_tasks, read_task, warned
from schemas.tool_protocol import HARBOR_TOOLS, parse_call, repo_call_text

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "examples" / "harbor"
CONFIG = ROOT / "examples" / "harbor.toml"


@pytest.fixture
def checks(tmp_path, monkeypatch):
    """An empty check cache (no task was checked)."""
    monkeypatch.setenv("RLBUS_HARBOR_CHECKS", str(tmp_path / "checks"))
    return tmp_path / "checks"


def copy_task(tmp_path: Path, name: str = "hello-file") -> Path:
    dst = tmp_path / "tasks" / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_every_fixture_reads_and_only_multi_step_is_refused():
    tasks = [read_task(p) for p in find_tasks(str(FIXTURES / "*"))]
    assert len(tasks) >= 12
    refused = {t.name: t.refusal for t in tasks if t.refusal}
    assert list(refused) == ["multi-step"] and "[[steps]]" in refused["multi-step"]
    hello = next(t for t in tasks if t.name == "hello-file")
    assert hello.task_id == f"hello-file-{hello.content_hash[:12]}" and "test.sh" in hello.tests
    assert "solve.sh" in hello.solution and hello.instruction.startswith("# Hello")
    prebuilt = next(t for t in tasks if t.name == "prebuilt-image")
    assert prebuilt.docker_image == "python:3.11-slim" and not prebuilt.environment
    assert next(t for t in tasks if t.name == "json-from-csv").verifier_user == "nobody"
    assert next(t for t in tasks if t.name == "net-allowed").allow_internet


def test_the_content_hash_follows_every_file(tmp_path):
    path = copy_task(tmp_path)
    first = read_task(path)
    assert read_task(path).content_hash == first.content_hash  # stable
    (path / "tests" / "test.sh").write_text((path / "tests" / "test.sh").read_text() + "\n# edited\n")
    second = read_task(path)
    assert second.content_hash != first.content_hash and second.env_hash == first.env_hash
    (path / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /srv\n")
    assert read_task(path).env_hash != first.env_hash


def test_bad_task_directories_say_which_file(tmp_path):
    path = copy_task(tmp_path)
    (path / "task.toml").write_text('version = "1.0"\n[verifier\ntimeout_sec = 3\n')
    with pytest.raises(HarborTaskError, match=r"task\.toml: TOML error: .*line 2"):
        read_task(path)
    (path / "task.toml").write_text('version = "2.0"\n')
    with pytest.raises(HarborTaskError, match="newer than the 1.4"):
        read_task(path)
    (path / "task.toml").write_text('version = "1.4"\n[verifier]\ntimeout_sec = -1\n')
    with pytest.raises(HarborTaskError, match="timeout_sec = -1 must be a positive number"):
        read_task(path)
    (path / "instruction.md").unlink()
    with pytest.raises(HarborTaskError, match=r"instruction\.md: missing"):
        read_task(path)


def test_unknown_keys_are_ignored_with_one_warning_each(tmp_path):
    path = copy_task(tmp_path)
    toml = (path / "task.toml").read_text().replace("[agent]", "[agent]\nfancy_knob_x = 1")
    (path / "task.toml").write_text('weird_top_y = "z"\n' + toml)
    task = read_task(path)
    assert {"agent.fancy_knob_x", "weird_top_y"} <= warned() and task.refusal == ""


def test_a_missing_test_sh_disables_the_task(tmp_path):
    path = copy_task(tmp_path)
    (path / "tests" / "test.sh").unlink()
    assert read_task(path).refusal == "tests/test.sh is missing"


def harbor_cfg(tasks_glob: str, held_out: bool = True, **harbor):
    overrides = [f'sampler.domains.tb.tasks="{tasks_glob}"'] + [f"harbor.{k}={v}" for k, v in harbor.items()]
    overrides += [] if held_out else ["sampler.domains.tb.params.eval_tasks=[]"]
    return load_config(str(CONFIG), overrides)


def test_the_domain_keeps_tests_hidden_and_holds_tasks_out_by_hash(checks):
    cfg = harbor_cfg(str(FIXTURES / "*"))
    src = make_source("r1", "tb", cfg)
    assert {t.name for t in src.eval} == {"hello-file", "csv-report", "service-kv", "fix-calc-bug"}
    assert "multi-step" in src.disabled and "broken-no-reward" not in src.disabled  # never checked here
    drawn = src.make_task(None, 1, 0)
    task, hidden = drawn.task, drawn.hidden
    assert task.verifier == "harbor" and task.tools == list(HARBOR_TOOLS) and task.hidden_ref
    public = task.model_dump_json()
    assert "test.sh" not in public and "/logs/verifier" not in public
    assert hidden["harbor"]["tests"]["test.sh"].startswith(b"#!/bin/bash")
    assert hidden["harbor"]["verify_in"] == "same" and "/usr/bin" in hidden["harbor"]["protected"]
    spec = task.verifier_params["harbor"]
    assert spec["image"].startswith("rlbus-harbor/") and spec["network"] is False
    assert task.prompt[0].content.splitlines()[0].endswith(task.verifier_params["harbor_task"])
    ids = {src.make_task(None, 1, i).task.verifier_params["harbor_task"] for i in range(30)}
    assert len(ids) == len(src.train) and not ids & {t.task_id for t in src.eval}
    assert len(src.eval_set(16, 0)) == 4


def test_network_needs_both_the_task_and_the_operator(checks):
    def net(**h):
        src = make_source("r1", "tb", harbor_cfg(str(FIXTURES / "net-allowed"), False, **h))
        return src.make_task(None, 1, 0).task.verifier_params["harbor"]["network"]

    assert net() is False and net(allow_internet="true") is True
    src = make_source("r1", "tb", harbor_cfg(str(FIXTURES / "hello-file"), False, allow_internet="true"))
    assert src.make_task(None, 1, 0).task.verifier_params["harbor"]["network"] is False


def test_invalid_folders_stop_the_domain_unless_skipped(tmp_path, checks):
    copy_task(tmp_path)
    (tmp_path / "tasks" / "junk").mkdir()
    (tmp_path / "tasks" / "junk" / "task.toml").write_text('version = "1.0"\n')
    with pytest.raises(ValueError, match=r"junk/instruction\.md: missing.*skip_invalid"):
        make_source("r1", "tb", harbor_cfg(str(tmp_path / "tasks" / "*"), False))
    src = make_source("r1", "tb", harbor_cfg(str(tmp_path / "tasks" / "*"), False, skip_invalid="true"))
    assert src.skipped["invalid"] == 1 and [t.name for t in src.train] == ["hello-file"]


def test_a_failed_check_disables_the_task_and_none_left_is_unavailable(tmp_path, checks):
    from sandbox_workers.harbor_check import CheckResult, _store

    cfg = harbor_cfg(str(FIXTURES / "hello-file"), False)
    task = read_task(FIXTURES / "hello-file")
    _store(task, cfg.harbor, CheckResult(task.name, task.task_id, False, "the oracle scores 0 (no_reward_file), not 1"))
    with pytest.raises(DomainUnavailable, match="no runnable harbor task"):
        make_source("r1", "tb", cfg)
    ctx = DomainContext("r1", "tb", cfg, cfg.sampler.domains["tb"])
    from producers.domains.harbor import disabled_reasons, load_tasks

    assert "no_reward_file" in disabled_reasons(load_tasks(ctx)[0], cfg.harbor)["hello-file"]


@pytest.mark.parametrize("fmt", ["tags", "json"])
def test_the_container_tools_parse_in_both_formats(fmt):
    tools = list(HARBOR_TOOLS)
    for tool, args in (
        ("bash", {"command": "ls -la /app && echo 'a<b>'", "timeout": 30, "cwd": "/tmp"}),
        ("read_file", {"path": "/app/x.txt", "start": 2, "end": 9}),
        ("write_file", {"path": "out.txt", "content": "line\n  two\n"}),
        ("submit", {}),
    ):
        call = parse_call(repo_call_text(tool, args, fmt), fmt, tools)
        assert call is not None and not call.error and call.tool == tool and call.args == args
    bad = parse_call(
        '<tool_call>{"name": "bash", "arguments": {"command": "x", "timeout": 0}}</tool_call>', "json", tools
    )
    assert bad.error == "bad_arguments"


def test_reward_files_parse_strictly():
    from sandbox_workers.harbor_verify import parse_reward

    assert parse_reward("reward.txt", b" 0.75\n") == ({"reward": 0.75}, "ok", "reward.txt: 0.75")
    comps, status, _ = parse_reward("reward.json", b'{"reward": 0.5, "header": 1, "rows": 0.25}')
    assert status == "ok" and comps == {"reward": 0.5, "header": 1.0, "rows": 0.25}
    assert parse_reward("reward.json", b'{"score": 1}')[0] == {"score": 1.0, "reward": 1.0}
    for name, raw in (
        ("reward.txt", b"pass"),
        ("reward.txt", b"nan"),
        ("reward.json", b"[1]"),
        ("reward.json", b'{"reward": "1"}'),
        ("reward.json", b'{"reward": true}'),
        ("reward.json", b'{"a": 1, "b": 2}'),
        ("reward.json", b"{}"),
    ):
        assert parse_reward(name, raw)[:2] == (None, "bad_reward_file"), raw


def test_protected_changes_take_topmost_paths_only():
    from sandbox_workers.harbor_protect import protected_changes
    from schemas.config.harbor import DEFAULT_PROTECTED

    diff = [
        {"Path": "/usr", "Kind": 0},
        {"Path": "/usr/bin", "Kind": 0},
        {"Path": "/usr/bin/python3", "Kind": 0},
        {"Path": "/usr/local/lib/evil", "Kind": 1},
        {"Path": "/usr/local/lib/evil/x.py", "Kind": 1},
        {"Path": "/etc/ld.so.preload", "Kind": 1},
        {"Path": "/usr/lib/x86_64-linux-gnu/libc.so.6", "Kind": 2},
        {"Path": "/app/out.txt", "Kind": 1},
        {"Path": "/etc/hosts", "Kind": 0},
    ]
    changed, deleted, added = protected_changes(diff, tuple(DEFAULT_PROTECTED))
    assert changed == ["/usr/bin", "/usr/bin/python3"]
    assert deleted == ["/usr/lib/x86_64-linux-gnu/libc.so.6"]
    assert added == ["/etc/ld.so.preload", "/usr/local/lib/evil"]


def test_image_tags_follow_the_environment_and_the_map():
    from sandbox_workers.harbor_images import map_dockerfile, task_image

    task = read_task(FIXTURES / "edit-config")
    assert "FROM python:3.11-slim" in map_dockerfile("FROM ubuntu:24.04\nRUN x\n", {"ubuntu:24.04": "python:3.11-slim"})
    assert map_dockerfile("FROM --platform=linux/amd64 a:1 AS b\n", {"a:1": "c:2"}).startswith(
        "FROM --platform=linux/amd64 c:2 AS b"
    )
    a, b = task_image(task, {}), task_image(task, {"ubuntu:24.04": "python:3.11-slim"})
    assert a != b and a.startswith("rlbus-harbor/edit-config:") and task_image(task, {}) == a
    assert task_image(read_task(FIXTURES / "prebuilt-image"), {"python:3.11-slim": "mine:1"}) == "mine:1"


def test_the_scripted_oracle_writes_the_solution_then_runs_it():
    from rlbus.commands.tasks_harbor import gold_steps

    steps = gold_steps({"solve.sh": b"echo hi\n", "data/x.txt": b"1\n"})
    assert [s["tool"] for s in steps] == ["write_file", "write_file", "bash", "submit"]
    assert steps[0]["args"]["path"] == "/solution/data/x.txt" and "solve.sh" in steps[2]["args"]["command"]


def test_repo_tasks_export_as_harbor_directories_that_read_back(tmp_path):
    from producers.repo_cache import list_tasks
    from rlbus.commands.harbor_export import export_repo_task

    repo = list_tasks(None)[0]
    path = export_repo_task(repo, tmp_path)
    task = read_task(path)
    assert task.refusal == "" and repo.issue.strip() in task.instruction
    assert set(task.tests) >= {"test.sh", "expected.json"} | {f"hidden/{p}" for p in repo.hidden_files}
    assert task.environment["Dockerfile"].startswith(b"FROM rlbus-repo-sandbox:latest")
    assert all(f"repo/{p}" in task.environment for p in repo.files)
    assert task.oracle.startswith("#!/bin/bash") and task.metadata["rlbus_task_id"] == repo.task_id


@pytest.mark.parametrize("fmt", ["tags", "json"])
def test_sft_from_solution_demonstrates_solve_sh_as_one_bash_call(checks, fmt):
    import random

    from producers.demos import domain_demos

    plain = make_source("r1", "tb", harbor_cfg(str(FIXTURES / "*")))
    assert not plain.demonstrable  # off unless asked for
    with pytest.raises(ValueError, match="sft_from_solution"):
        plain.demonstration(random.Random(0), 1)
    sets = ["sampler.domains.tb.params.sft_from_solution=true", f'sampler.domains.tb.tool_format="{fmt}"']
    cfg = load_config(str(CONFIG), [f'sampler.domains.tb.tasks="{FIXTURES / "*"}"', *sets, "sft.enabled=true"])
    src = make_source("r1", "tb", cfg)
    assert src.demonstrable and {t.name for t in src.demonstrated} == {t.name for t in src.train}
    held_out = {t.name for t in src.eval}
    by_prompt = {t.name: t for t in src.train}
    rng, seen = random.Random(0), set()
    for _ in range(40):
        (prompt, p_trained), (call, c_trained), (submit, s_trained) = src.demonstration(rng, 1)
        assert (p_trained, c_trained, s_trained) == (False, True, True)  # the prompt is context, the calls learned
        name = next(n for n, t in by_prompt.items() if prompt.splitlines()[0].endswith(t.task_id))
        assert name not in held_out
        parsed = parse_call(call, fmt, list(HARBOR_TOOLS))
        assert (
            parsed.tool == "bash"
            and not parsed.error
            and parsed.args["command"].strip() == by_prompt[name].oracle.strip()
        )
        assert parse_call(submit, fmt, list(HARBOR_TOOLS)).tool == "submit"
        seen.add(name)
    assert len(seen) > 3
    demos = domain_demos(cfg)
    assert [s.ctx.name for s in demos.sources] == ["tb"]
    batch = next(demos.batches(0, 3))
    assert len(batch) == 3 and all(len(d) == 3 for d in batch)
