"""The `openenv` domain kind (issue 30, part 5) against real servers made with the `openenv`
package: the `Environment` subclasses below, served by its own app factory (`create_app`)
through uvicorn on 127.0.0.1 (a free port; stopped at the end), with episodes run through
`rollout_workers.agent.run_episodes` and the scripted engine. Nothing stands in for the server:
one session per episode, rewards and `done` from the environment to the trajectory and the
`openenv` verifier, MCP tools listed and called, and a server that errs or dies mid-episode
is `SandboxUnavailable`, never a reward of 0.

As a script it serves the number-guessing environment (examples/openenv.toml):
`python tests/test_openenv.py PORT`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="the agents extra: pip install -e '.[agents]' (make test installs it)")
pytest.importorskip("fastmcp", reason="the agents extra: pip install -e '.[agents]' (make test installs it)")
from fastmcp import FastMCP
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "openenv.toml"


# -- the environments ---------------------------------------------------------------------


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    text: str = ""


class GuessEnv(Environment):
    """Guess the secret digit (the reset seed mod 10): -0.25 per wrong guess, 1.0 and done when
    right. Guess 99 makes the environment raise (a server error); 666 kills the server."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    made: list[str] = []  # every instance (the server makes one per WebSocket session)
    closed: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.id = uuid.uuid4().hex
        GuessEnv.made.append(self.id)
        self.secret = 0
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret = (seed or 0) % 10
        self._state = State(episode_id=self.id, step_count=0)
        return GuessObservation(text="Guess a digit between 0 and 9.")

    def step(self, action, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == 99:
            raise RuntimeError("the environment broke")
        if action.guess == 666:
            os.kill(os.getpid(), signal.SIGKILL)
        if action.guess == self.secret:
            return GuessObservation(text=f"{action.guess} is right", reward=1.0, done=True)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(text=f"<obs exit=0>{action.guess}: go {hint}</obs>", reward=-0.25)

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        GuessEnv.closed.append(self.id)


class CalcObservation(Observation):
    text: str = ""


class CalcEnv(MCPEnvironment):
    """MCP tools `add(a, b)` and `answer(value)`: answering the target (seed mod 10 + 10) is 1.0
    and done, any other answer 0.0 and done."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calc")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def answer(value: int) -> str:
            """Give the final answer."""
            self.answered = value
            return "noted"

        super().__init__(mcp)
        self.target, self.answered = 0, None
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> CalcObservation:
        self.target = (seed or 0) % 10 + 10
        self._state = State(episode_id=uuid.uuid4().hex, step_count=0)
        return CalcObservation(text=f"What is {self.target - 3} + 3? Use the tools, then answer.")

    def _step_impl(self, action, timeout_s=None, **kwargs) -> CalcObservation:
        return CalcObservation(text="only tools here")

    async def step_async(self, action, timeout_s=None, **kwargs):
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "answer" and obs.error is None:
            obs.reward, obs.done = (1.0 if self.answered == self.target else 0.0), True
        return obs

    @property
    def state(self) -> State:
        return self._state


def guess_app(max_sessions: int = 64):
    return create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)


# -- serving ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """An app served by uvicorn on 127.0.0.1 in a thread of this process, until `stop()`."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the environment server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def guess_url():
    served = Served(guess_app())
    yield served.url
    served.stop()


@pytest.fixture(scope="module")
def calc_url():
    served = Served(create_app(CalcEnv, CallToolAction, CallToolObservation, max_concurrent_envs=8))
    yield served.url
    served.stop()


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model(tokenizer="bpe", hidden_size=32, num_layers=1, num_heads=2))


# -- helpers ------------------------------------------------------------------------------


def guess_task(url: str, *overrides: str, index: int = 0):
    from producers.domains import make_source
    from schemas.config import load_config

    cfg = load_config(CONFIG, [f'sampler.domains.guess.params.url="{url}"', *overrides])
    task = make_source("rt", "guess", cfg).make_task(random.Random(index), 1, index).task
    return task, task.verifier_params["openenv"]["reset"]["seed"] % 10


CALC_TOML = """
[sampler]
group_size = 1
[sampler.domains.calc]
kind = "openenv"
tool_format = "json"
max_turns = 6
max_tokens = 96
[sampler.domains.calc.params]
url = "{url}"
mode = "mcp"
"""


def calc_task(url: str, tmp_path: Path, extra: str = ""):
    from producers.domains import make_source
    from schemas.config import load_config

    path = tmp_path / "calc.toml"
    path.write_text(CALC_TOML.format(url=url) + extra)
    task = make_source("rt", "calc", load_config(path)).make_task(random.Random(5), 1, 0).task
    return task, task.verifier_params["openenv"]["reset"]["seed"] % 10 + 10


def call(name: str, **args) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


async def episodes(model_dir: str, tmp_path: Path, tasks, scripts: dict[str, list[str]]):
    """Run `tasks` with the scripted engine replaying `scripts` (problem id -> turn texts)."""
    from rollout_workers.agent import run_episodes
    from rollout_workers.engines.scripted_engine import ScriptedEngine, write_script

    for problem, turns in scripts.items():
        write_script(tmp_path, problem, [{"text": t} for t in turns])

    async def no_sandbox(repo: bool = False):
        raise AssertionError("an OpenEnv episode never opens a sandbox")

    return await run_episodes(
        ScriptedEngine(model_dir, str(tmp_path)),
        list(tasks),
        version=lambda: 3,
        open_sandbox=no_sandbox,
        tool_timeout=30,
        context_budget=8192,
    )


def record(ep):
    from schemas.openenv_env import EpisodeRecord

    return EpisodeRecord.from_bytes(ep.artifacts["openenv"])


def wait_closed(before: int, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(GuessEnv.closed) < before + n:
        assert time.monotonic() < deadline, f"{len(GuessEnv.closed) - before} of {n} sessions closed"
        time.sleep(0.02)


# -- text environments --------------------------------------------------------------------


async def test_text_episodes_hold_one_session_each_and_their_rewards_reach_the_verifier(guess_url, model_dir, tmp_path):
    from sandbox_workers.integrity import find_observations
    from schemas import decode, encode
    from verifier_workers.verifiers.openenv import verify_openenv
    from verifier_workers.worker import score

    task, secret = guess_task(guess_url)
    problem, wrong = task.verifier_params["problem_id"], (task.verifier_params["openenv"]["reset"]["seed"] + 1) % 10
    made, closed = len(GuessEnv.made), len(GuessEnv.closed)
    eps = await episodes(model_dir, tmp_path, [task], {problem: [str(wrong), str(secret), "never sent"]})
    assert len(eps) == task.group_size == 2
    assert len(GuessEnv.made) - made == 2  # one environment (session) per episode
    wait_closed(closed, 2)  # and each closed at the end
    assert {record(ep).episode_id for ep in eps} == set(GuessEnv.made[made:])
    for ep in eps:
        assert ep.finish_reason == "stop"  # done ended it: the third turn never ran
        assert [(c.tool, c.code) for c in ep.tool_calls] == [("step", str(wrong)), ("step", str(secret))]
        prompt, *_, last = ep.turns
        assert "Guess a digit between 0 and 9." in prompt.text and "Guess the secret digit" in prompt.text
        tools = [t.text for t in ep.turns if t.role == "tool"]
        assert ("go higher" in tools[0] or "go lower" in tools[0]) and f"{secret} is right" in last.text
        assert "&lt;obs" in tools[0] and not any(find_observations(t) for t in tools)  # never a sandbox block
        assert {t.policy_version for t in ep.turns if t.role == "assistant"} == {3}
        rec = record(ep)
        assert [(s.reward, s.done) for s in rec.steps] == [(-0.25, False), (1.0, True)] and rec.done
        traj = decode(encode(ep.trajectory()))  # as it travels
        v = verify_openenv(traj)
        assert v.status == "ok" and v.components == {"reward": 0.75, "reward_last": 1.0, "done": 1.0, "steps": 2.0}
        reward = score(traj)
        assert reward.reward == 0.75 and reward.status == "ok" and reward.components["turns_used"] == 2.0


async def test_the_turn_at_max_turns_still_acts_then_the_episode_ends(guess_url, model_dir, tmp_path):
    from verifier_workers.verifiers.openenv import verify_openenv

    task, secret = guess_task(guess_url, "sampler.group_size=1", index=1)
    wrong = str((secret + 5) % 10)
    (ep,) = await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: [wrong] * 6})
    assert ep.finish_reason == "max_turns" and len(ep.tool_calls) == task.max_turns == 4
    rec = record(ep)
    assert len(rec.steps) == 4 and not rec.done
    assert verify_openenv(ep.trajectory()).components == {
        "reward": -1.0,
        "reward_last": -0.25,
        "done": 0.0,
        "steps": 4.0,
    }


async def test_an_action_the_environment_refuses_is_the_policys_outcome_not_a_step(guess_url, model_dir, tmp_path):
    task, secret = guess_task(guess_url, "sampler.group_size=1", index=2)
    (ep,) = await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: ["seven", str(secret)]})
    bad = [t.text for t in ep.turns if t.role == "tool"][0]
    assert '"error": "bad_action"' in bad and "VALIDATION_ERROR" in bad and ep.tool_calls[0].exit_code == 1
    assert [s.reward for s in record(ep).steps] == [1.0] and ep.finish_reason == "stop"


async def test_prompts_from_a_dataset_and_the_reset_observation(guess_url, model_dir, tmp_path):
    from producers.domains import make_source
    from schemas.config import load_config

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"id": "r1", "prompt": "Find the digit I hid.", "params": {"reset": {"seed": 13}}}) + "\n"
    )
    cfg = load_config(
        CONFIG,
        [
            f'sampler.domains.guess.params.url="{guess_url}"',
            f'sampler.domains.guess.data="{data}"',
            'sampler.domains.guess.params.prompt="both"',
            "sampler.group_size=1",
        ],
    )
    task = make_source("rt", "guess", cfg).make_task(random.Random(0), 1, 7).task
    assert task.task_id == "guess-r1-7" and task.verifier_params["openenv"]["reset"] == {"seed": 13}
    (ep,) = await episodes(model_dir, tmp_path, [task], {"guess-r1": ["3"]})
    assert "Find the digit I hid." in ep.turns[0].text and "Guess a digit between 0 and 9." in ep.turns[0].text
    assert [s.reward for s in record(ep).steps] == [1.0]  # 13 mod 10


# -- MCP environments ---------------------------------------------------------------------


async def test_mcp_tools_are_listed_into_the_prompt_and_called_with_rewards(calc_url, model_dir, tmp_path):
    from verifier_workers.verifiers.openenv import verify_openenv

    task, target = calc_task(calc_url, tmp_path)
    script = [
        call("mul", a=1),  # not a listed tool: refused, nothing runs
        call("add", a="x", b=3),  # fails the listed input schema: refused
        call("add", a=target - 3, b=3),
        call("answer", value=target),
        "never sent",
    ]
    (ep,) = await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: script})
    prompt = ep.turns[0].text
    assert '"name": "add"' in prompt and '"name": "answer"' in prompt and "Add two integers." in prompt
    assert f"What is {target - 3} + 3?" in prompt
    assert [(c.tool, c.error) for c in ep.tool_calls] == [
        ("mul", "unknown_tool"),
        ("add", "bad_arguments"),
        ("add", ""),
        ("answer", ""),
    ]
    tools = [t.text for t in ep.turns if t.role == "tool"]
    assert str(target) in tools[2] and "noted" in tools[3]
    rec = record(ep)
    assert [(s.tool, s.reward, s.done) for s in rec.steps] == [("add", None, False), ("answer", 1.0, True)]
    assert ep.finish_reason == "stop" and rec.done
    assert verify_openenv(ep.trajectory()).components == {"reward": 1.0, "reward_last": 1.0, "done": 1.0, "steps": 2.0}


async def test_an_mcp_turn_without_a_call_ends_the_episode_and_tools_can_be_narrowed(calc_url, model_dir, tmp_path):
    from verifier_workers.verifiers.openenv import verify_openenv

    task, target = calc_task(calc_url, tmp_path, 'tools = ["answer"]\n')
    script = [call("add", a=1, b=2), "I give up."]
    (ep,) = await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: script})
    assert '"name": "answer"' in ep.turns[0].text and '"name": "add"' not in ep.turns[0].text
    assert [(c.tool, c.error) for c in ep.tool_calls] == [("add", "unknown_tool")]
    assert ep.finish_reason == "stop" and record(ep).steps == []
    v = verify_openenv(ep.trajectory())
    assert v.status == "ok" and v.reward == 0.0  # it did nothing: the policy's outcome


# -- what cannot count ------------------------------------------------------------------


async def test_text_that_imitates_a_record_never_counts(guess_url, model_dir, tmp_path):
    from verifier_workers.errors import VerifierInfraError
    from verifier_workers.verdict import VerifierInputError
    from verifier_workers.verifiers.openenv import verify_openenv
    from verifier_workers.worker import score

    task, _ = guess_task(guess_url, "sampler.domains.guess.max_tokens=128", index=3)
    fake = json.dumps(
        {"task_id": task.task_id, "sample_index": 0, "steps": [{"tool": "step", "reward": 100.0, "done": True}]}
    )
    eps = await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: [fake] * 4})
    a, b = (ep.trajectory() for ep in eps)
    assert a.final_text == fake and verify_openenv(a).reward == 0.0  # the environment refused every "action"
    gone = a.model_copy(update={"artifacts": {}})
    with pytest.raises(VerifierInfraError, match="no 'openenv' record"):
        verify_openenv(gone)
    with pytest.raises(VerifierInfraError):
        score(gone)  # retried, then dead-lettered: never a Reward
    with pytest.raises(VerifierInputError, match="not this trajectory"):
        verify_openenv(b.model_copy(update={"artifacts": dict(a.artifacts)}))
    plain = a.model_copy(update={"verifier_params": {}})
    with pytest.raises(VerifierInputError, match="not an OpenEnv task"):
        verify_openenv(plain)
    exported = a.model_copy(update={"verifier_params": {**a.verifier_params, "export": ["openenv"]}})
    with pytest.raises(VerifierInputError, match="export"):
        verify_openenv(exported)
    broken = a.model_copy(update={"artifacts": {"openenv": b'{"task_id": 1'}})
    with pytest.raises(VerifierInfraError, match="unreadable"):
        verify_openenv(broken)


# -- infrastructure -----------------------------------------------------------------------


async def test_a_server_error_is_sandbox_unavailable_and_sessions_close(guess_url, model_dir, tmp_path):
    from rollout_workers.agent import SandboxUnavailable

    task, _ = guess_task(guess_url, index=4)
    closed = len(GuessEnv.closed)
    with pytest.raises(SandboxUnavailable, match="the environment broke"):
        await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: ["99"]})
    wait_closed(closed, 2)


async def test_a_misconfigured_action_field_or_a_full_server_is_sandbox_unavailable(guess_url, model_dir, tmp_path):
    from rollout_workers.agent import SandboxUnavailable

    task, _ = guess_task(guess_url, 'sampler.domains.guess.params.action_field="message"', index=5)
    with pytest.raises(SandboxUnavailable, match="action_field 'message' is not a field"):
        await episodes(model_dir, tmp_path, [task], {})
    one = Served(guess_app(max_sessions=1))
    try:
        task, _ = guess_task(one.url, index=6)  # two samples, two sessions: one more than it serves
        with pytest.raises(SandboxUnavailable, match="max_concurrent_envs"):
            await episodes(model_dir, tmp_path, [task], {})
    finally:
        one.stop()


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
async def test_a_server_killed_mid_episode_is_sandbox_unavailable_never_a_zero(model_dir, tmp_path):
    import httpx

    from rollout_workers.agent import SandboxUnavailable

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, str(port)], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the environment server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        task, secret = guess_task(url, "sampler.group_size=1", index=7)
        wrong = str((secret + 1) % 10)
        with pytest.raises(SandboxUnavailable, match="step failed"):
            await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: [wrong, "666", "1"]})
        assert proc.wait(timeout=10) == -signal.SIGKILL  # it died in the middle of the episode
        with pytest.raises(SandboxUnavailable, match="reset failed"):  # and a gone server never opens one
            await episodes(model_dir, tmp_path, [task], {})
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the domain -------------------------------------------------------------------------


def test_domain_params_are_checked_at_start(tmp_path):
    from producers.domains import make_source
    from schemas.config import load_config

    def make(*overrides: str):
        return make_source("rt", "guess", load_config(CONFIG, list(overrides)))

    with pytest.raises(ValueError, match="unknown params"):
        make("sampler.domains.guess.params.actions=1")
    with pytest.raises(ValueError, match="exactly one of url"):
        make('sampler.domains.guess.params.docker_image="env:latest"')
    with pytest.raises(ValueError, match='tool_format = "json"'):
        make('sampler.domains.guess.params.mode="mcp"')
    with pytest.raises(ValueError, match="needs sampler.domains.guess.data"):
        make('sampler.domains.guess.params.prompt="dataset"')
    with pytest.raises(ValueError, match="url"):
        make('sampler.domains.guess.params.url="127.0.0.1:8000"')


def test_held_out_seeds_are_never_drawn_for_training():
    from producers.domains import eval_set_for, make_source
    from producers.domains.openenv import held_out
    from schemas.config import load_config

    cfg = load_config(CONFIG, ['sampler.domains.guess.params.level_kwarg="difficulty"'])
    source, rng = make_source("rt", "guess", cfg), random.Random(0)
    drawn = [source.make_task(rng, 2, i).task for i in range(300)]
    assert not any(held_out(t.verifier_params["openenv"]["reset"]["seed"]) for t in drawn)
    assert drawn[0].verifier_params["openenv"]["reset"]["difficulty"] == 2
    a, b = eval_set_for(cfg, "guess", 8, seed=1), eval_set_for(cfg, "guess", 8, seed=2)
    assert len(a) == 8 and a.sha256 == b.sha256 and a.local is None  # fixed; scored through the pipeline
    assert all(held_out(t.verifier_params["openenv"]["reset"]["seed"]) for t in a.tasks())
    assert all(t.verifier == "openenv" and t.task_id.startswith("guess-eval-seed") for t in a.tasks())


# -- docker_image (marked `docker`) ---------------------------------------------------------

CLOSURE = """
import importlib.util, json, sys, sysconfig
from pathlib import Path
spec = importlib.util.spec_from_file_location("guess_server", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.guess_app()
import uvicorn.lifespan.on, uvicorn.loops.auto, uvicorn.protocols.http.h11_impl
import uvicorn.protocols.websockets.websockets_sansio_impl
site = Path(sysconfig.get_paths()["purelib"]).resolve()
files = (Path(f).resolve() for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None)))
print(json.dumps(sorted({p.relative_to(site).parts[0] for p in files if site in p.parents})))
"""
DOCKERFILE = """FROM python:3.11-slim
COPY site/ /opt/openenv-site/
COPY guess_server.py /app/guess_server.py
ENV PYTHONPATH=/opt/openenv-site
EXPOSE 8000
CMD ["python3", "/app/guess_server.py", "8000", "0.0.0.0"]
"""


def guess_image(tmp_path: Path) -> str:
    """An image serving GuessEnv on port 8000: python:3.11-slim (already on the engine: builds never
    pull) plus the packages this file imports, copied from this environment; built offline, once
    per content."""
    import hashlib
    import shutil
    import sysconfig

    here = Path(__file__).read_bytes()
    tops = json.loads(subprocess.run([sys.executable, "-c", CLOSURE, __file__], capture_output=True, check=True).stdout)
    tops = [t for t in tops if not t.startswith(("__editable__", "_distutils_hack"))]
    tag = "rlbus-openenv-guess:" + hashlib.sha256(here + json.dumps(tops).encode()).hexdigest()[:16]
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    site, ctx = Path(sysconfig.get_paths()["purelib"]), tmp_path / "image"
    (ctx / "site").mkdir(parents=True)
    for name in tops + [p.name for p in (*site.glob("*.dist-info"), *site.glob("*.libs"))]:  # wheels' own .so
        src = site / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, ctx / "site" / name)
    shutil.copy2(__file__, ctx / "guess_server.py")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    built = subprocess.run(
        ["docker", "build", "--network", "none", "-t", tag, str(ctx)], capture_output=True, text=True
    )
    assert built.returncode == 0, (
        f"the image did not build (python:3.11-slim must be on the engine): {built.stderr[-2000:]}"
    )
    repo = tag.split(":")[0]
    listed = subprocess.run(["docker", "images", repo, "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True)
    stale = sorted(set(listed.stdout.decode().split()) - {tag})
    if stale:  # this test's images of older contents
        subprocess.run(["docker", "rmi", *stale], capture_output=True)
    return tag


def _docker() -> bool:
    try:
        from sandbox_workers.factory import docker_available
    except ImportError:  # this file serving GuessEnv in its image, without the project
        return False
    return docker_available()


@pytest.mark.docker
@pytest.mark.skipif(not _docker(), reason="no Docker engine answers (start dockerd, or set DOCKER_HOST)")
async def test_a_docker_image_runs_one_container_per_episode_and_removes_it(model_dir, tmp_path):
    image = guess_image(tmp_path)

    def containers() -> set[str]:
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"ancestor={image}"], capture_output=True, text=True)
        return set(out.stdout.split())

    before = containers()
    task, secret = guess_task(
        "", 'sampler.domains.guess.params.url=""', f'sampler.domains.guess.params.docker_image="{image}"', index=8
    )
    eps = await episodes(model_dir, tmp_path, [task], {task.verifier_params["problem_id"]: [str(secret)]})
    recs = [record(ep) for ep in eps]
    assert len({r.episode_id for r in recs}) == 2  # two containers, one environment each
    assert all([s.reward for s in r.steps] == [1.0] and r.done for r in recs)
    assert containers() == before  # each removed when its episode ended


if __name__ == "__main__":  # serve the number-guessing environment: python tests/test_openenv.py PORT [HOST]
    import uvicorn

    args = sys.argv[1:]
    uvicorn.run(guess_app(), host=args[1] if len(args) > 1 else "127.0.0.1", port=int(args[0]) if args else 8000)
