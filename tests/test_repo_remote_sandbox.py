"""Repository episodes with `sandbox.remote` (issue 18): the rollout worker asks the sandbox service for
`sandbox.repo_image`, and the service starts only images of its own allow-list (`sandbox.image`,
`sandbox.repo_image`), refusing any other name before anything starts.

The service runs in-process on the real session nats-server; the docker test (marked `docker`,
skipped with the reason when no engine answers) runs a scripted gold episode in the service's
repo-image container and scores it with the real `repo` verifier.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from bus.conn import connect
from bus.session import Session, WorkerContext
from bus.subjects import Registry
from sandbox_workers.remote import ImageNotAllowed, RemoteSandbox
from sandbox_workers.service import SandboxService, allowed_images
from schemas.config import RunConfig, SandboxSection
from tests.test_repo_episode import FIXTURE, docker_only, repo_image, tokenizer_dir  # noqa: F401 - fixtures

SECRET = b"s" * 32


@contextlib.asynccontextmanager
async def service(nats_url: str, run_id: str, **sandbox):
    """A sandbox service on a fresh pool: (connection, registry, service)."""
    nc = await connect(nats_url, name="pytest-remote-repo")
    reg = Registry(run_id)
    sc = SandboxSection(pool=f"p{uuid.uuid4().hex[:8]}", **sandbox)
    svc = SandboxService(nc, nc.jetstream(timeout=10), reg, sc, SECRET)
    await svc.start()
    try:
        yield nc, reg, svc
    finally:
        await svc.stop()
        js = nc.jetstream()
        with contextlib.suppress(Exception):
            await js.delete_key_value(reg.toolrec_bucket)
        await nc.close()


async def test_the_service_refuses_an_image_outside_its_allow_list_before_starting_anything(nats_url, run_id):
    sc = SandboxSection(image="img-a:1", repo_image="img-b:2")
    assert allowed_images(sc) == {"img-a:1", "img-b:2"}
    async with service(nats_url, run_id, backend="process", image="img-a:1", repo_image="img-b:2") as (nc, reg, svc):
        for image in ("evil/miner:latest", "img-a:10", ""):
            with pytest.raises(ImageNotAllowed, match="does not start image"):
                await RemoteSandbox.open(nc, reg, svc.pool, image=image, timeout=10)
        reply = await nc.request(reg.sandbox_open(svc.pool), b"\x82\xa6run_id\xa1r\xa5image\x01", timeout=10)
        assert b"image_not_allowed" in reply.data  # a non-string image: refused, not started
        assert svc.sessions == {} and svc.opening == 0
        assert svc.counters["errors_image_not_allowed"] == 4


@docker_only
async def test_a_remote_repo_episode_runs_in_the_repo_image_and_resolves(
    nats_url, run_id, repo_image, tokenizer_dir, tmp_path
):
    from producers.domains import make_source
    from producers.repo_cache import load_task
    from rollout_workers.agent import run_episodes
    from rollout_workers.engines.scripted_engine import ScriptedEngine, gold_steps, write_script
    from rollout_workers.worker import sandbox_opener
    from verifier_workers.verifiers.repo import verify_repo

    # the service's default image is not the repo image (and need not even exist here): only the
    # image the episode asks for can give it pytest and the wheelhouse
    async with service(
        nats_url,
        run_id,
        backend="docker",
        image="rlbus-sandbox:latest",
        repo_image=repo_image,
        memory_mb=512,
        pids=64,
        timeout_s=60,
    ) as (nc, reg, svc):
        cfg = RunConfig.model_validate(
            {
                "sandbox": {"remote": True, "pool": svc.pool, "repo_image": repo_image, "timeout_s": 60},
                "sampler": {
                    "group_size": 1,
                    "domains": {
                        "repo": {"max_turns": 6, "max_tokens": 1024, "params": {"tasks": [FIXTURE], "eval_tasks": []}}
                    },
                },
            }
        )
        ctx = WorkerContext(run_id=run_id, nats_url=nats_url, run_path=tmp_path)
        open_one = await sandbox_opener(cfg, ctx, Session(nc, nc.jetstream(), reg, cfg, ctx, asyncio.Event()))
        sb = await open_one(repo=True)
        try:
            assert isinstance(sb, RemoteSandbox) and sb.image == repo_image
            probe = await sb.execute("python3 -c 'import pytest' && test -d /opt/wheelhouse && echo repo-image")
            assert probe.exit_code == 0 and "repo-image" in probe.stdout, probe
        finally:
            await sb.close()
        with pytest.raises(ImageNotAllowed):  # an image the engine holds, but not one the service was given
            await RemoteSandbox.open(nc, reg, svc.pool, image="python:3.11-slim", timeout=10)

        task = load_task(FIXTURE)
        drawn = make_source(run_id, "repo", cfg).make_task(None, 1, 0)
        write_script(tmp_path / "gold", FIXTURE, gold_steps(task.gold_patch))
        (ep,) = await run_episodes(
            ScriptedEngine(tokenizer_dir, str(tmp_path / "gold")),
            [drawn.task],
            version=lambda: 0,
            open_sandbox=open_one,
            tool_timeout=60,
            context_budget=16384,
        )
        assert ep.tool_calls[0].exec_id and ep.tool_calls[0].exit_code == 0  # recorded by the service
        assert ep.artifacts["diff"].decode() == task.gold_patch
        verdict = verify_repo(ep.trajectory(), drawn.hidden)
        assert verdict.components["resolved"] == 1.0, verdict.details
        assert svc.counters["sessions_opened"] == 2 and svc.sessions == {}
