"""`kind = "agent"` domains: a real harness process per episode, in the bubblewrap sandbox,
calling the rollout worker's endpoint with the official `openai` client.

- A math-wrapped agent domain: the harness reads `RLBUS_TASK_FILE`, calls the policy
  through `OPENAI_BASE_URL` (a relay on the sandbox's loopback to the endpoint's Unix socket),
  and the recorded trajectory is scored by the wrapped verifier on the controlled side.
- The task file and the environment hold no hidden data (the gold answer, `hidden_ref`).
- A harness that crashes after the policy answered is `harness_error` (scored 0, stderr tail);
  one that cannot start, or ends without calling the policy, is an infrastructure error.
- A harness that tries another episode's key gets 401; its own key is closed (409) afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the agents extra: pip install -e '.[agents]' (make test installs it)")

from producers.domains import make_source
from rollout_workers.agent import SandboxUnavailable
from rollout_workers.agent_harness import run_agent_tasks, socket_dir
from rollout_workers.endpoint.server import Endpoint
from rollout_workers.engines import make_engine
from schemas.agent_task import AGENT_ARTIFACT, public_task
from schemas.config import RunConfig
from verifier_workers.worker import score

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")

HARNESS = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import openai

    mode = sys.argv[1]
    task = json.load(open(os.environ["RLBUS_TASK_FILE"]))
    if mode == "nocall":
        sys.exit(0)
    messages = list(task["messages"])
    if mode == "report":  # what the harness sees travels back in its own call (recorded as the prompt)
        raw = open(os.environ["RLBUS_TASK_FILE"], "rb").read()
        report = {"env": sorted(os.environ), "key": os.environ["OPENAI_API_KEY"][:9],
                  "task_sha": hashlib.sha256(raw).hexdigest(), "base": os.environ["OPENAI_BASE_URL"]}
        other = openai.OpenAI(api_key="rlbus-ep-" + "A" * 43, max_retries=0)
        try:
            other.models.list()
        except openai.AuthenticationError as exc:
            report["other_key"] = exc.status_code
        try:
            open("/proc/1/environ").read()
        except OSError as exc:
            report["proc1"] = type(exc).__name__
        messages.append({"role": "user", "content": "REPORT " + json.dumps(report)})
    client = openai.OpenAI(max_retries=0)
    r = client.chat.completions.create(model="rlbus-policy", messages=messages, max_tokens=8)
    if mode == "crash":
        sys.stderr.write("Traceback: the harness fell over on the model's action\\n")
        sys.exit(3)
    if mode == "hang":
        import time
        time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def harness_dir():
    """A host dir (readable by the sandbox uid) holding the harness module, bound on PYTHONPATH."""
    d = Path(tempfile.mkdtemp(prefix="rlbus-test-harness-"))
    d.chmod(0o755)
    (d / "tiny_harness.py").write_text(HARNESS)
    (d / "tiny_harness.py").chmod(0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config(harness_dir: Path, mode: str, command=None, timeout_s: float = 60) -> RunConfig:
    cmd = command or ["python3", "-m", "tiny_harness", mode, "{task_file}"]
    return RunConfig.model_validate(
        {
            "sampler": {
                "group_size": 1,
                "domains": {"m": {"kind": "agent", "wraps": "math", "command": cmd, "max_tokens": 8}},
            },
            "agent": {"timeout_s": timeout_s, "python_path": ["purelib", str(harness_dir)]},
        }
    )


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(RunConfig().rollout, str(tiny_model(tokenizer="bpe", seed=3)))


async def run(engine, cfg: RunConfig, n_tasks: int = 1):
    source = make_source("agent-test", "m", cfg)
    drawn = [source.make_task(random.Random(i), 1, i) for i in range(n_tasks)]
    section = cfg.rollout.endpoint.model_copy(update={"enabled": True})
    ep = Endpoint(engine, lambda: 3, section, context_limit=512)
    uds = socket_dir()
    await ep.serve(uds)
    try:
        trajs = await run_agent_tasks(ep, cfg, [d.task for d in drawn], uds)
    finally:
        await ep.stop()
        shutil.rmtree(os.path.dirname(uds), ignore_errors=True)
    return drawn, trajs, ep


@pytest.mark.asyncio
async def test_harness_episode_recorded_and_verified(engine, harness_dir):
    drawn, trajs, ep = await run(engine, config(harness_dir, "ok"))
    (traj,) = trajs
    rec = json.loads(traj.artifacts[AGENT_ARTIFACT])
    assert rec["status"] == "ok" and rec["exit_code"] == 0 and rec["calls"] == 1 and rec["isolation"] == "bwrap"
    assert [t.role for t in traj.turns] == ["prompt", "assistant"]
    assert traj.turns[1].trainable and traj.turns[1].policy_version == 3 and traj.policy_version == 3
    assert traj.domain == "m" and traj.verifier == drawn[0].task.verifier
    reward = score(traj, drawn[0].hidden)  # the wrapped domain's verifier, on the controlled side
    assert reward.status == "ok" and reward.reward in (0.0, 1.0)
    assert len(ep.episodes) == 0  # the key was closed


@pytest.mark.asyncio
async def test_harness_sees_no_hidden_data_and_no_other_episode(engine, harness_dir):
    drawn, (traj,), _ = await run(engine, config(harness_dir, "report"))
    prompt = traj.turns[0].text
    report = json.loads(prompt[prompt.index("REPORT ") + 7 :].split("<|im_end|>")[0])
    task = drawn[0].task
    assert report["other_key"] == 401  # a made-up / other episode's key reaches nothing
    assert report["key"] == "rlbus-ep-" and report["base"].startswith("http://127.0.0.1:")
    allowed = {"OPENAI_API_KEY", "OPENAI_BASE_URL", "RLBUS_TASK_FILE", "PYTHONPATH", "HOME", "PATH", "TMPDIR", "LANG"}
    allowed |= {"PYTHONDONTWRITEBYTECODE", "RLBUS_SANDBOX_ID", "PWD", *RunConfig().agent.env}
    assert set(report["env"]) <= allowed, set(report["env"]) - allowed  # no NATS url, credential or secret
    public = json.dumps(public_task(task), ensure_ascii=False)
    assert report["task_sha"] == hashlib.sha256(public.encode()).hexdigest()  # the file is exactly public_task
    assert task.hidden_ref and task.hidden_ref not in public and "hidden" not in public
    gold = str((drawn[0].hidden or {}).get("gold", ""))
    assert gold and f'"{gold}"' not in public
    assert json.loads(public)["task_id"] == task.task_id and json.loads(public)["instruction"]


@pytest.mark.asyncio
async def test_harness_without_a_call_is_infra(engine, harness_dir):
    with pytest.raises(SandboxUnavailable, match="without calling the policy"):
        await run(engine, config(harness_dir, "nocall"))


@pytest.mark.asyncio
async def test_crash_after_a_call_is_harness_error_scored_zero(engine, harness_dir):
    drawn, (traj,), _ = await run(engine, config(harness_dir, "crash"))
    rec = json.loads(traj.artifacts[AGENT_ARTIFACT])
    assert rec["status"] == "harness_error" and rec["exit_code"] == 3
    assert "fell over" in rec["stderr_tail"] and traj.finish_reason == "error"
    reward = score(traj, drawn[0].hidden)
    assert reward.status == "harness_error" and reward.reward == 0.0 and "fell over" in reward.details


@pytest.mark.asyncio
async def test_harness_that_cannot_start_is_infra(engine, harness_dir):
    cfg = config(harness_dir, "ok", command=["/nonexistent/harness", "{task_file}"])
    with pytest.raises(SandboxUnavailable, match="could not start"):
        await run(engine, cfg)


@pytest.mark.asyncio
async def test_a_dropped_reply_still_records_the_new_messages(engine):
    """mini-swe-agent drops a reply it cannot parse and sends only its format error: the endpoint
    records that message after the reply it kept (counted as drift), so the context is whole."""
    import openai

    from schemas import Task
    from schemas.chat import user_prompt

    task = Task(run_id="ep", task_id="t", domain="d", group_size=1, prompt=user_prompt("x"), verifier="arith")
    ep = Endpoint(engine, lambda: 1, RunConfig().rollout.endpoint.model_copy(update={"enabled": True}), 512)
    await ep.serve()
    try:
        key = ep.open_episode(task, call_tokens=4)
        c = openai.AsyncOpenAI(base_url=ep.base_url, api_key=key, max_retries=0)
        first = [{"role": "user", "content": "hello"}]
        r = await c.chat.completions.create(model="m", messages=first, max_tokens=50)
        assert r.usage.completion_tokens <= 4  # the episode's per-call cap wins over the request
        await c.chat.completions.create(model="m", messages=[*first, {"role": "user", "content": "FORMAT ERROR"}])
        traj = ep.close_episode(key)
    finally:
        await ep.stop()
    assert [t.role for t in traj.turns] == ["prompt", "assistant", "tool", "assistant"]
    assert "FORMAT ERROR" in traj.turns[2].text and traj.drift == 1


@pytest.mark.asyncio
async def test_a_harness_past_its_timeout_is_killed_and_verified_as_it_stands(engine, harness_dir):
    drawn, (traj,), _ = await run(engine, config(harness_dir, "hang", timeout_s=4))
    rec = json.loads(traj.artifacts[AGENT_ARTIFACT])
    assert rec["status"] == "timeout" and rec["calls"] == 1 and 4 <= rec["seconds"] < 15, rec
    assert traj.finish_reason == "timeout"
    assert score(traj, drawn[0].hidden).status == "ok"  # scored by the wrapped verifier, as it stands


def test_rlbus_up_checks_agent_domains_at_start(harness_dir):
    from rich.console import Console

    from rlbus.run.checks import check_agent

    console = Console(record=True, width=200)
    assert check_agent(config(harness_dir, "ok"), console)  # bubblewrap is here
    bad = config(harness_dir, "ok").model_copy(
        update={"agent": RunConfig().agent.model_copy(update={"python_path": ["/nope"]})}
    )
    assert (
        not check_agent(bad, console)
        and "agent.python_path directories ['/nope'] do not exist" in console.export_text()
    )


def test_the_start_check_looks_only_at_the_images_the_harnesses_use(harness_dir):
    from rlbus.run.checks import agent_images

    cfg = config(harness_dir, "ok")  # wraps math: the plain sandbox image
    assert agent_images(cfg) == [cfg.sandbox.image]
    domains = {n: dc.model_copy(update={"wraps": "repo"}) for n, dc in cfg.sampler.domains.items()}
    repo = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"domains": domains})})
    assert agent_images(repo) == [cfg.sandbox.repo_image]  # a workspace: the repository image
