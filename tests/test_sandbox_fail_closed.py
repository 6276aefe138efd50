"""Sandboxes fail closed: without bubblewrap nothing runs unisolated unless allowed on purpose.

bwrap is hidden by giving PATH a folder that links every tool of the usual bin dirs but
`bwrap` (the process backend looks it up on PATH), so the rest of the machine is as is.

- Hidden: the process backend refuses (`SandboxRefused`, naming the fix), and the
  refusal reaches the pipeline as an infrastructure error (the agent's
  `SandboxUnavailable`, the code verifier's `SandboxInfraError`), never a reward;
  `rlbus sandbox exec` exits 1 with the reason on stderr; `rlbus up` stops before SFT.
- Allowed (`allow_degraded`, `--allow-degraded-sandbox`): commands run degraded, each
  sandbox's temp files stay in its own work dir, and a short `rlbus up` says so in red
  and in summary.json (`sandbox_isolation: "degraded"`).
- bwrap present: `sandbox_isolation: "bwrap"` and no warning.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sandbox_workers.process as proc_mod
from sandbox_workers.base import SandboxRefused
from sandbox_workers.factory import open_sandbox, probe_isolation
from sandbox_workers.process import ALLOW_DEGRADED_ENV, ProcessSandbox

ROOT = Path(__file__).resolve().parents[1]
BIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
FIX = "apt-get install -y bubblewrap"


def _bwrap_usable() -> bool:
    try:
        return probe_isolation("process") == "bwrap"
    except SandboxRefused:
        return False


BWRAP_OK = _bwrap_usable()
needs_bwrap = pytest.mark.skipif(
    not BWRAP_OK, reason="bwrap missing or cannot create namespaces (apt-get install -y bubblewrap)"
)


@pytest.fixture(scope="module")
def no_bwrap_path(tmp_path_factory) -> str:
    """A PATH with every tool of the usual bin dirs except bwrap (the venv's first)."""
    d = tmp_path_factory.mktemp("nobwrap-bin")
    for src in (str(Path(sys.executable).parent), *BIN_DIRS):
        if not os.path.isdir(src):
            continue
        for entry in os.scandir(src):
            link = d / entry.name
            if entry.name != "bwrap" and not link.exists() and not link.is_symlink():
                link.symlink_to(entry.path)
    return str(d)


@pytest.fixture
def bwrap_hidden(monkeypatch, no_bwrap_path) -> str:
    """This process sees no bwrap and no opt-in from the environment."""
    monkeypatch.setenv("PATH", no_bwrap_path)
    monkeypatch.delenv(ALLOW_DEGRADED_ENV, raising=False)
    assert proc_mod.bwrap_path() is None
    return no_bwrap_path


def _env(path: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ALLOW_DEGRADED_ENV}
    return {**env, "PATH": path, "PYTHONUNBUFFERED": "1", **extra}


# ------------------------------------------------------------------ the backend itself
def test_process_backend_refuses_and_names_the_fix(bwrap_hidden, tmp_path):
    for isolation in ("auto", "degraded"):  # an explicit degraded sandbox needs the permission too
        box = ProcessSandbox(isolation=isolation, base_dir=str(tmp_path))
        with pytest.raises(SandboxRefused) as err:
            box.start()
        assert FIX in str(err.value) and "docker" in str(err.value) and "allow_degraded" in str(err.value)
        assert box.workdir is None and list(tmp_path.iterdir()) == []  # nothing left behind
    with pytest.raises(SandboxRefused, match="bubblewrap"):
        open_sandbox("process")
    with pytest.raises(SandboxRefused):
        probe_isolation("process")


def test_allowed_it_runs_degraded_with_private_temp_paths(bwrap_hidden, monkeypatch):
    with ProcessSandbox(allow_degraded=True) as box:
        box.start()
        r = box.execute('echo "$TMPDIR $HOME"; pwd')
        assert r.exit_code == 0 and r.isolation == "degraded"
        tmpdir, home, cwd = r.stdout.split()
        assert tmpdir == home == cwd == box.workdir and os.stat(box.workdir).st_mode & 0o077 == 0
    monkeypatch.setenv(ALLOW_DEGRADED_ENV, "1")  # how `rlbus worker` passes sandbox.allow_degraded on
    assert probe_isolation("process") == "degraded"


# ------------------------------------------------------------------ infra errors, never rewards
def test_refusal_is_an_infra_error_for_the_agent(bwrap_hidden, run_id):
    from rollout_workers.agent import SandboxUnavailable, run_episodes
    from sandbox_workers.async_sandbox import open_async_sandbox
    from schemas.config import SandboxSection
    from tests.test_agent import ScriptedEngine, task

    async def go(sc: SandboxSection):
        engine = ScriptedEngine(["<py>print(6*7)</py>", "=42"])
        return await run_episodes(
            engine, [task(run_id, 6, 7)], version=lambda: 0, open_sandbox=lambda: open_async_sandbox(sc)
        )

    with pytest.raises(SandboxUnavailable, match="SandboxRefused.*bubblewrap"):
        asyncio.run(go(SandboxSection()))
    eps = asyncio.run(go(SandboxSection(allow_degraded=True)))
    assert [c.exit_code for ep in eps for c in ep.tool_calls] == [0, 0]
    assert all("42" in ep.turns[2].text for ep in eps)


def test_refusal_is_an_infra_error_for_the_code_verifier(bwrap_hidden, monkeypatch):
    from verifier_workers.verifiers.code import SandboxInfraError, check_program

    program, tests = "def f(x):\n    return 2 * x\n", "def check(candidate):\n    assert candidate(3) == 6\n"
    with pytest.raises(SandboxInfraError, match="SandboxRefused.*bubblewrap"):
        check_program(program, tests, "f", backend="process")
    monkeypatch.setenv(ALLOW_DEGRADED_ENV, "1")
    # one after another, as different sandbox uids when root: the harness's runner output once
    # went to the host's /tmp/runner.out, which the second sandbox could not open
    for _ in range(2):
        v = check_program(program, tests, "f", backend="process")
        assert v.components["correct"] == 1.0 and v.status == "ok" and "process/degraded" in v.details, v


CODE_ADD = {
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
    "entry_point": "add",
    "prompt": 'def add(a, b):\n    """Sum."""\n',
}


async def _verify_in_worker(js, reg, spawn_worker, tmp_path, i: int, allow: bool) -> tuple[list, list]:
    """One code trajectory through a real `rlbus worker verifier`: (its rewards, its dead letters)."""
    from bus.hidden import put_hidden
    from bus.publish import publish_many
    from bus.streams import iter_stream
    from schemas import DeadLetter, Reward, Trajectory, decode
    from tests.conftest import eventually

    ref = f"code.add{i}.x"
    await put_hidden(js, reg, ref, CODE_ADD)
    t = Trajectory(
        run_id=reg.run_id,
        msg_id=f"tr-code-{i}",
        task_id=f"t{i}",
        task_msg_id=f"task-{i}",
        domain="code",
        group_id=f"g{i}",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="code",
        hidden_ref=ref,
        verifier_params={"entry_point": "add"},
        policy_version=0,
        final_text="def add(a, b):\n    return a + b\n",
    )
    from tests.messages import store_checks

    await store_checks(js, reg, [t])
    await publish_many(js, [(reg.traj("code"), t)])
    cfg = tmp_path / f"verifier{i}.toml"
    cfg.write_text(
        "[verifier]\nack_wait_s = 1.0\nretry_base_s = 0.05\nretry_max_s = 0.2\nconcurrency = 1\n"
        f"[sandbox]\nallow_degraded = {str(allow).lower()}\n"
    )
    proc = spawn_worker("verifier", reg.run_id, cfg, "--until-idle", "60")

    async def outcome():
        rewards = [decode(d, Reward) async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("code"))]
        letters = [decode(d, DeadLetter) async for _, d in iter_stream(js, reg.stream("DLQ"), reg.dlq("verifier"))]
        rewards = [r for r in rewards if r.trajectory.msg_id == t.msg_id]
        letters = [dl for dl in letters if decode(dl.original_data, Trajectory).msg_id == t.msg_id]
        return (rewards, letters) if rewards or letters else None

    try:
        return await eventually(outcome, 90, f"a reward or a dead letter for {t.msg_id}", tmp_path, every=0.5)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
async def test_verifier_worker_refusal_is_an_infra_error_and_the_config_allows(
    bwrap_hidden, monkeypatch, js, run_id, tmp_path, spawn_worker, drop_run
):
    from bus.conn import ensure_topology
    from bus.subjects import Registry

    monkeypatch.setenv("RLBUS_CODE_SANDBOX", "process")  # the worker inherits PATH without bwrap, too
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    rewards, letters = await _verify_in_worker(js, reg, spawn_worker, tmp_path, 1, allow=False)
    assert rewards == [] and len(letters) == 1, (rewards, letters)  # retried, then dead-lettered: never a 0
    assert letters[0].error_type == "infra_error" and FIX in letters[0].reason, letters[0].reason
    # sandbox.allow_degraded reaches the code verifier through `rlbus worker` (the environment)
    rewards, letters = await _verify_in_worker(js, reg, spawn_worker, tmp_path, 2, allow=True)
    assert letters == [] and [r.reward for r in rewards] == [1.0], (rewards, letters)
    assert "process/degraded" in rewards[0].details, rewards[0].details


# ------------------------------------------------------------------ the CLI
def _sandbox_exec(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "sandbox", "exec", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(path),
    )


def test_sandbox_exec_exits_1_with_the_reason(no_bwrap_path):
    p = _sandbox_exec(no_bwrap_path, "--", "echo", "hi")
    assert p.returncode == 1 and p.stdout == "", (p.stdout, p.stderr)
    assert "rlbus sandbox exec:" in p.stderr and FIX in p.stderr and "--allow-degraded-sandbox" in p.stderr
    p = _sandbox_exec(no_bwrap_path, "--allow-degraded-sandbox", "--", "echo", "hi")
    row = json.loads(p.stdout)
    assert p.returncode == 0 and row["isolation"] == "degraded" and row["stdout"] == "hi\n", p.stderr


# ------------------------------------------------------------------ rlbus up
TINY = """
[run]
max_steps = 2
max_minutes = 4
drain_seconds = 2
[model]
hidden_size = 32
num_layers = 1
num_heads = 2
[sft]
enabled = false
[sampler]
group_size = 2
max_tokens = 4
max_inflight_tasks = 8
[sampler.domains.arith]
weight = 0.5
[sampler.domains.tool_calc]
weight = 0.5
max_turns = 2
max_tokens = 12
[rollout]
batch_tasks = 4
[learner]
groups_per_step = 2
step_window_s = 0.5
[scheduler.eval]
n = 4
every_versions = 100
"""


def _up(tmp_path: Path, path: str, *args: str, timeout: float = 200) -> tuple[int, str, Path]:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    run_id = f"fc{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            str(cfg),
            "--run-dir",
            str(tmp_path / "runs"),
            "--run-id",
            run_id,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(path, RLBUS_CODE_SANDBOX="process"),
    )
    return p.returncode, p.stdout + p.stderr, tmp_path / "runs" / run_id


def test_up_stops_before_sft_without_bwrap(tmp_path, no_bwrap_path):
    rc, out, run_path = _up(tmp_path, no_bwrap_path, timeout=60)
    assert rc == 1, out[-3000:]
    assert FIX in out and "--allow-degraded-sandbox" in out and "sandbox.allow_degraded=true" in out, out[-3000:]
    assert not run_path.exists() and "SFT" not in out and "nats-server" not in out, out[-3000:]


@pytest.mark.e2e
def test_up_allowed_degraded_says_so(tmp_path, no_bwrap_path):
    rc, out, run_path = _up(tmp_path, no_bwrap_path, "--allow-degraded-sandbox")
    assert rc == 0, out[-3000:]
    s = json.loads((run_path / "summary.json").read_text())
    assert s["final"] is True and s["sandbox_isolation"] == "degraded", s
    assert s["domains"]["tool_calc"]["rewards"] > 0, s["domains"]  # the tool pipeline ran
    assert out.count("sandbox isolation: DEGRADED") >= 2, out[-3000:]  # at start and after the summary
    assert "DEGRADED (allowed by sandbox.allow_degraded" in out, out[-3000:]  # and by each degraded sandbox itself


@pytest.mark.e2e
@needs_bwrap
def test_up_with_bwrap_nothing_changes(tmp_path):
    rc, out, run_path = _up(tmp_path, os.environ["PATH"])
    assert rc == 0, out[-3000:]
    s = json.loads((run_path / "summary.json").read_text())
    assert s["final"] is True and s["sandbox_isolation"] == "bwrap", s
    assert "DEGRADED" not in out and "sandbox.degraded" not in out, out[-3000:]
