"""Test fixtures: ONE real nats-server per test session, on a free port.

Every integration test talks to this server; nothing stands in for NATS. Each test gets
its own run id, so runs never see each other's streams.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from bus.server import EmbeddedNats

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    """A nats-server with JetStream for the whole session (stopped by PID at the end)."""
    # many runs share this server, and JetStream reserves every capped stream's max_bytes up front
    # (work streams and payload buckets: ~640 MiB a run), so the reservation ceiling is raised past
    # the disk's default 75%; nothing near it is ever written
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"), config="jetstream { max_file_store: 1T }\n").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Tiny models built once per session: `tiny_model(**build_tiny_model kwargs)` is the folder of
    the one model with those settings. Shared: a test that would change a model copies it first."""
    from rlbus.model.tiny_model import build_tiny_model

    built: dict[tuple, Path] = {}

    def get(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The one `rlbus up` of `make test` (tests/smoke_run.py): run once, read by several tests."""
    from tests.smoke_run import run_smoke

    return run_smoke(tmp_path_factory.mktemp("smoke"))


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    """URL of the session's server."""
    return nats_server.url


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest_asyncio.fixture
async def js(nats_url):
    """A connected JetStream context (closed after the test)."""
    from bus.conn import connect

    nc = await connect(nats_url, name="pytest")
    yield nc.jetstream(timeout=10)
    await nc.close()


@pytest.fixture
def spawn_worker(tmp_path, nats_url):
    """Start `rlbus worker ROLE` as a real OS process; all are killed after the test."""
    procs: list[subprocess.Popen] = []

    def start(role: str, run_id: str, config: Path, *extra: str, log_name: str | None = None) -> subprocess.Popen:
        log = open(tmp_path / f"{log_name or role}-{len(procs)}.log", "wb")
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlbus.cli",
                "worker",
                role,
                "--config",
                str(config),
                "--nats-url",
                nats_url,
                "--run-id",
                run_id,
                "--run-dir",
                str(tmp_path / "runs"),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


NULL_PIPELINE_CONFIG = """
[sampler]
group_size = 4
max_inflight_tasks = 32
[rollout]
engine = "null"
[learner]
policy = "null"
groups_per_step = 4
step_window_s = 0.5
"""


@pytest.fixture
def null_pipeline(tmp_path, run_id, spawn_worker) -> dict[str, subprocess.Popen]:
    """A live null-model pipeline for `run_id`: one learner, verifier, rollout and sampler worker
    (started in that order, with NULL_PIPELINE_CONFIG), as {role: process}; killed after the test."""
    cfg = tmp_path / "pipeline.toml"
    cfg.write_text(NULL_PIPELINE_CONFIG)
    return {role: spawn_worker(role, run_id, cfg) for role in ("learner", "verifier", "rollout", "sampler")}


@pytest_asyncio.fixture
async def drop_run(js, run_id):
    """Delete the test's run after it (and after its workers are killed): file streams
    reserve their byte caps against the session server's JetStream storage."""
    yield
    from bus.conn import delete_run
    from bus.subjects import Registry

    await delete_run(js, Registry(run_id))


async def settled_consumer(js, stream: str, durable: str, timeout: float = 5.0):
    """Consumer info once nothing is pending or un-acked (or the last info at the time-out).

    The server applies acks asynchronously, so an info request right after an ack can
    still count it as pending; tests assert on the settled state instead.
    """
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        info = await js.consumer_info(stream, durable)
        if (info.num_ack_pending == 0 and info.num_pending == 0) or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)


def logs(tmp_path: Path) -> str:
    """The tail of every worker log in `tmp_path` (for failure messages)."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp_path.glob("*.log")))


async def eventually(check, timeout: float, what: str, tmp_path: Path, every: float = 0.1):
    """Poll async `check()` until it returns a truthy value; fail with the workers' logs."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs(tmp_path)}")
        await asyncio.sleep(every)
