"""`kind = "agent"` harnesses in per-episode Docker containers (`agent.sandbox`, `sandbox.backend = "docker"`).

- The real `openai`-package harness of tests/test_agent_harness.py runs in a container (the
  venv's site-packages bound read-only: the image's python3 is the same 3.11), calls the
  policy through the launcher's relay to the bound endpoint socket; the episode is recorded
  and scored by the wrapped verifier.
- No network from inside: a TCP listener on the host (every address) is unreachable, and the
  container has no interface but `lo`.
- The harness's environment holds no secret; another episode's key is 401.
- Fail closed: with `agent.sandbox = "docker"` and no engine answering, the episode is an
  infrastructure error (`SandboxUnavailable`), never a host process.
- The container is removed afterwards.
"""

from __future__ import annotations

import json
import socket
import textwrap

import pytest

pytest.importorskip("openai", reason="the agents extra: pip install -e '.[agents]' (make test installs it)")

from rollout_workers.agent import SandboxUnavailable
from rollout_workers.agent_harness import harness_sandbox
from schemas.agent_task import AGENT_ARTIFACT
from schemas.config import RunConfig
from tests.test_agent_harness import config, engine, harness_dir, run  # noqa: F401 - fixtures
from tests.test_repo_episode import docker_only
from verifier_workers.worker import score

NET_PROBE = textwrap.dedent(
    """
    import json, os, socket, sys
    import openai

    task = json.load(open(os.environ["RLBUS_TASK_FILE"]))
    port = int(sys.argv[1])
    seen = {"ifaces": sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:])}
    for host in sys.argv[2:]:
        try:
            socket.create_connection((host, port), timeout=3).close()
            seen[host] = "connected"
        except OSError as exc:
            seen[host] = type(exc).__name__ + ":" + str(exc.errno)
    messages = [*task["messages"], {"role": "user", "content": "NET " + json.dumps(seen)}]
    openai.OpenAI(max_retries=0).chat.completions.create(model="rlbus-policy", messages=messages, max_tokens=8)
    """
)


@pytest.fixture(scope="module")
def sandbox_image():
    from sandbox_workers.docker_pool import shutdown_pools
    from sandbox_workers.images import ensure_image

    ensure_image()
    yield
    shutdown_pools()


def docker_config(cfg: RunConfig, choice: str = "auto") -> RunConfig:
    """`cfg` with `sandbox.backend = "docker"` and `agent.sandbox = choice`."""
    return cfg.model_copy(
        update={
            "sandbox": cfg.sandbox.model_copy(update={"backend": "docker"}),
            "agent": cfg.agent.model_copy(update={"sandbox": choice}),
        }
    )


def harness_containers() -> list[str]:
    from sandbox_workers.docker_engine import get_client
    from sandbox_workers.docker_harness import HARNESS_LABEL

    return [c["Id"] for c in get_client().api.containers(all=True, filters={"label": f"{HARNESS_LABEL}=1"})]


def test_agent_sandbox_follows_the_backend(harness_dir):
    cfg = config(harness_dir, "ok")
    assert harness_sandbox(cfg) == "bwrap" and harness_sandbox(docker_config(cfg)) == "docker"
    assert harness_sandbox(docker_config(cfg, "bwrap")) == "bwrap"
    assert harness_sandbox(cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"sandbox": "docker"})}))
    with pytest.raises(ValueError, match="sandbox"):
        RunConfig.model_validate({"agent": {"sandbox": "vm"}})


@docker_only
@pytest.mark.asyncio
async def test_openai_harness_in_a_container_recorded_and_verified(engine, harness_dir, sandbox_image):
    drawn, (traj,), ep = await run(engine, docker_config(config(harness_dir, "ok")))
    rec = json.loads(traj.artifacts[AGENT_ARTIFACT])
    assert rec["status"] == "ok" and rec["exit_code"] == 0 and rec["calls"] == 1, rec
    assert rec["isolation"] == "docker"
    assert [t.role for t in traj.turns] == ["prompt", "assistant"] and traj.turns[1].trainable
    reward = score(traj, drawn[0].hidden)
    assert reward.status == "ok" and reward.reward in (0.0, 1.0)
    assert len(ep.episodes) == 0 and harness_containers() == []


@docker_only
@pytest.mark.asyncio
async def test_no_network_from_the_harness_container(engine, harness_dir, sandbox_image):
    (harness_dir / "net_probe.py").write_text(NET_PROBE)
    (harness_dir / "net_probe.py").chmod(0o644)
    listener = socket.create_server(("0.0.0.0", 0))  # every host address, the docker bridge's included
    port = listener.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            host_ip = s.getsockname()[0]
        except OSError:
            host_ip = "127.0.0.1"
    targets = [host_ip, "172.17.0.1", "127.0.0.1"]
    cmd = ["python3", "-m", "net_probe", str(port), *targets]
    try:
        _, (traj,), _ = await run(engine, docker_config(config(harness_dir, "ok", command=cmd)))
    finally:
        listener.close()
    prompt = traj.turns[0].text
    seen = json.loads(prompt[prompt.index("NET ") + 4 :].split("<|im_end|>")[0])
    assert seen["ifaces"] == ["lo"], seen
    assert all(seen[h] != "connected" for h in targets), seen  # the host's listener is out of reach
    assert json.loads(traj.artifacts[AGENT_ARTIFACT])["isolation"] == "docker"


@docker_only
@pytest.mark.asyncio
async def test_no_engine_is_an_infrastructure_error_never_a_host_process(engine, harness_dir, monkeypatch):
    from sandbox_workers import docker_engine

    monkeypatch.setattr(docker_engine, "_client", None)  # the next client is made from DOCKER_HOST
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    cfg = config(harness_dir, "ok")
    cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"sandbox": "docker", "allow_host": True})})
    with pytest.raises(SandboxUnavailable, match="no Docker engine answers"):
        await run(engine, cfg)


@docker_only
@pytest.mark.asyncio
async def test_a_harness_past_its_timeout_is_killed_in_its_container(engine, harness_dir, sandbox_image):
    drawn, (traj,), _ = await run(engine, docker_config(config(harness_dir, "hang", timeout_s=4)))
    rec = json.loads(traj.artifacts[AGENT_ARTIFACT])
    assert rec["status"] == "timeout" and rec["calls"] == 1 and rec["isolation"] == "docker", rec
    assert 4 <= rec["seconds"] < 15 and traj.finish_reason == "timeout"
    assert score(traj, drawn[0].hidden).status == "ok" and harness_containers() == []


@docker_only
def test_rlbus_up_checks_the_harness_images(harness_dir, sandbox_image):
    from rich.console import Console

    from rlbus.run.checks import check_agent

    console = Console(record=True, width=300)
    cfg = docker_config(config(harness_dir, "ok"))
    assert check_agent(cfg, console)
    bad = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"image": "rlbus-no-such-image:latest"})})
    assert not check_agent(bad, console)
    said = console.export_text()
    assert "agent harnesses run in docker" in said and "rlbus sandbox build-image" in said, said


@docker_only
@pytest.mark.asyncio
async def test_the_container_holds_no_secret_and_no_other_episode(engine, harness_dir, sandbox_image):
    _, (traj,), _ = await run(engine, docker_config(config(harness_dir, "report")))
    prompt = traj.turns[0].text
    report = json.loads(prompt[prompt.index("REPORT ") + 7 :].split("<|im_end|>")[0])
    assert report["other_key"] == 401 and report["key"] == "rlbus-ep-", report
    assert report["proc1"] == "PermissionError"  # docker-init runs as another uid
    allowed = {"OPENAI_API_KEY", "OPENAI_BASE_URL", "RLBUS_TASK_FILE", "PYTHONPATH", "HOME", "PATH", "TMPDIR", "LANG"}
    allowed |= {"PYTHONDONTWRITEBYTECODE", "HOSTNAME", "PWD", *RunConfig().agent.env}
    assert set(report["env"]) <= allowed, set(report["env"]) - allowed  # no NATS url, credential or secret
