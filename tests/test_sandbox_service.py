"""The sandbox service over real NATS with real bwrap sandboxes, through `rlbus worker sandbox`.

Each test starts its own worker process on its own pool with its own TMPDIR, so every
sandbox work dir it makes lies there and every sandbox process names it in its argv:
"nothing left behind" is checked by looking at exactly those.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from bus.conn import connect
from bus.subjects import Registry
from sandbox_workers.async_sandbox import LocalAsyncSandbox, SandboxClosed, open_async_sandbox
from sandbox_workers.integrity import ToolTurn, verify_observations
from sandbox_workers.remote import (
    BadRequest,
    CapacityExceeded,
    RemoteSandbox,
    SandboxUnavailable,
    UnknownSession,
    pack,
    unpack,
)
from schemas.config import SandboxSection
from tests.conftest import ROOT, eventually, logs
from tests.proc_scan import live_pids

SECRET = "test-secret-0123456789abcdef0123"


def leftovers(tmpdir: Path) -> tuple[list[str], list[int]]:
    """(sandbox work dirs, live processes naming them) under `tmpdir`."""
    dirs = sorted(p.name for p in tmpdir.glob("rlbus-sbx-*"))
    needle = str(tmpdir).encode()
    return dirs, live_pids(lambda cmdline, _environ: needle in cmdline)


@pytest.fixture
def sandbox_worker(tmp_path, spawn_worker, run_id, monkeypatch):
    """Start `rlbus worker sandbox` on a fresh pool; returns (pool, sandbox TMPDIR, process)."""

    made: list[Path] = []

    def start(
        max_sessions: int = 4,
        ttl: float = 30.0,
        timeout: float = 10.0,
        backend: str = "process",
        max_exec_timeout: float = 600.0,
    ):
        pool = f"p{uuid.uuid4().hex[:8]}"
        # not under tmp_path: the sandbox uid must be able to traverse to its work dir
        tmpdir = Path(tempfile.mkdtemp(prefix=f"rlbus-test-{pool}-"))
        tmpdir.chmod(0o711)
        made.append(tmpdir)
        config = tmp_path / f"{pool}.toml"
        config.write_text(
            f'[sandbox]\npool = "{pool}"\nmax_sessions = {max_sessions}\n'
            f'session_ttl_s = {ttl}\ntimeout_s = {timeout}\nbackend = "{backend}"\n'
            f"max_exec_timeout_s = {max_exec_timeout}\n"
        )
        monkeypatch.setenv("TMPDIR", str(tmpdir))
        monkeypatch.setenv("RLBUS_TOOL_SECRET", SECRET)
        proc = spawn_worker("sandbox", run_id, config, log_name=f"sandbox-{pool}")
        monkeypatch.delenv("TMPDIR")
        return pool, tmpdir, proc

    yield start
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def nc(nats_url, run_id):
    conn = await connect(nats_url, name="pytest-sandbox")
    yield conn
    js = conn.jetstream()
    with contextlib.suppress(NotFoundError):
        await js.delete_key_value(Registry(run_id).toolrec_bucket)
    await conn.close()


async def open_when_ready(nc, reg: Registry, pool: str, tmp_path: Path, timeout: float = 30.0) -> RemoteSandbox:
    """The first session of a worker that is still starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await RemoteSandbox.open(nc, reg, pool, timeout=5)
        except SandboxUnavailable:
            if time.monotonic() > deadline:
                raise AssertionError(f"no sandbox worker on {pool} after {timeout}s\n{logs(tmp_path)}") from None
            await asyncio.sleep(0.1)


async def raw(nc, subject: str, body) -> dict:
    msg = await nc.request(subject, body if isinstance(body, bytes) else pack(body), timeout=10)
    return unpack(msg.data)


async def test_round_trip_through_worker(nc, run_id, sandbox_worker, tmp_path):
    pool, tmpdir, _ = sandbox_worker()
    reg = Registry(run_id)
    sbx = await open_when_ready(nc, reg, pool, tmp_path)
    assert sbx.isolation == "bwrap"
    await sbx.write_file("src/a.py", b"print(6 * 7)\n")
    assert await sbx.read_file("/work/src/a.py") == b"print(6 * 7)\n"
    obs = await sbx.observe(["python3", "src/a.py"])
    assert (obs.result.exit_code, obs.result.stdout, obs.text) == (0, "42\n", "<obs exit=0>\n42\n</obs>")
    failed = await sbx.observe("python3 -c 'import sys; sys.exit(\"boom\")'")
    assert failed.result.exit_code == 1 and failed.text == "<obs exit=1>\n<err>boom</err>\n</obs>"
    slow = await sbx.observe("sleep 30", timeout=0.5)
    assert slow.result.timed_out and slow.result.exit_code == 137 and "timeout" in slow.text
    with pytest.raises(FileNotFoundError):
        await sbx.read_file("missing.txt")
    with pytest.raises(BadRequest):
        await sbx.read_file("../etc/passwd")
    await sbx.reset()
    with pytest.raises(FileNotFoundError):
        await sbx.read_file("src/a.py")
    ok, forged = await verify_observations(
        nc.jetstream(), reg, SECRET.encode(), [ToolTurn(o.exec_id, o.text) for o in (obs, failed, slow)]
    )
    assert len(ok) == 3 and forged == []
    await sbx.close()
    await sbx.close()  # idempotent
    reply = await raw(nc, reg.sandbox_session_op(pool, sbx.worker, "exec"), {"session": sbx.session, "cmd": "true"})
    assert reply["error"]["code"] == "unknown_session" and "open a new one" in reply["error"]["message"]
    assert leftovers(tmpdir) == ([], [])


async def test_bad_requests_get_error_replies(nc, run_id, sandbox_worker, tmp_path):
    pool, _, _ = sandbox_worker()
    reg = Registry(run_id)
    sbx = await open_when_ready(nc, reg, pool, tmp_path)
    op = lambda name: reg.sandbox_session_op(pool, sbx.worker, name)
    assert (await raw(nc, op("exec"), b"\xc1 not msgpack"))["error"]["code"] == "bad_request"
    assert (await raw(nc, op("exec"), [1, 2]))["error"]["code"] == "bad_request"
    assert (await raw(nc, op("exec"), {"session": sbx.session, "cmd": 5}))["error"]["code"] == "bad_request"
    assert (await raw(nc, op("exec"), {"session": sbx.session, "cmd": "true", "timeout": -1}))["error"][
        "code"
    ] == "bad_request"
    assert (await raw(nc, op("write"), {"session": sbx.session, "path": "x", "data": "str"}))["error"][
        "code"
    ] == "bad_request"
    unknown_op = f"sandbox.{pool}.s.{sbx.worker}.fly"
    assert (await raw(nc, unknown_op, {"session": sbx.session}))["error"]["code"] == "bad_request"
    assert (await raw(nc, op("exec"), {"session": sbx.session, "cmd": "true", "timeout": True}))["error"][
        "code"
    ] == "bad_request"
    assert (await raw(nc, op("exec"), {"session": sbx.session, "cmd": "true", "timeout": float("nan")}))["error"][
        "code"
    ] == "bad_request"
    assert (await sbx.execute("echo still-fine")).stdout == "still-fine\n"
    with pytest.raises(UnknownSession):
        await RemoteSandbox(
            nc, reg, pool, {"session": "nope", "worker": sbx.worker, "timeout_s": 1, "ttl_s": 60}
        ).execute("true")
    await sbx.close()


async def test_two_sessions_run_concurrently(nc, run_id, sandbox_worker, tmp_path):
    pool, tmpdir, _ = sandbox_worker()
    reg = Registry(run_id)
    a = await open_when_ready(nc, reg, pool, tmp_path)
    b = await RemoteSandbox.open(nc, reg, pool)
    assert a.session != b.session
    await a.write_file("who", b"a")
    await b.write_file("who", b"b")
    slow = asyncio.create_task(a.execute("sleep 2; cat who"))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    fast = await b.execute("cat who")
    assert fast.stdout == "b" and time.monotonic() - t0 < 1.0, "a slow exec in one session delayed another"
    assert (await slow).stdout == "a"
    for s in (a, b):
        await s.close()
    assert leftovers(tmpdir) == ([], [])


async def test_capacity_is_a_structured_error(nc, run_id, sandbox_worker, tmp_path):
    pool, _, _ = sandbox_worker(max_sessions=2)
    reg = Registry(run_id)
    held = [await open_when_ready(nc, reg, pool, tmp_path), await RemoteSandbox.open(nc, reg, pool)]
    with pytest.raises(CapacityExceeded, match="max_sessions"):
        await RemoteSandbox.open(nc, reg, pool, attempts=2)
    await held.pop().close()
    third = await RemoteSandbox.open(nc, reg, pool)
    assert (await third.execute("echo ok")).stdout == "ok\n"
    for s in (*held, third):
        await s.close()


async def test_no_worker_says_how_to_start_one(nc, run_id):
    with pytest.raises(SandboxUnavailable, match="rlbus worker sandbox"):
        await RemoteSandbox.open(nc, Registry(run_id), f"nobody{uuid.uuid4().hex[:6]}")


CLIENT = """
import asyncio, sys
from bus.conn import connect
from bus.subjects import Registry
from sandbox_workers.remote import RemoteSandbox

async def main(url, run_id, pool, cmd):
    nc = await connect(url)
    sbx = await RemoteSandbox.open(nc, Registry(run_id), pool)
    await sbx.write_file("data.txt", b"x" * 1000)
    print(sbx.worker, sbx.session, flush=True)
    await sbx.execute(cmd, timeout=30)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.e2e  # fault case (a killed worker / client): make test-e2e
async def test_ttl_reaps_session_of_a_dead_client(nc, nats_url, run_id, sandbox_worker, tmp_path):
    pool, tmpdir, _ = sandbox_worker(ttl=1.0)
    reg = Registry(run_id)
    keeper = await open_when_ready(nc, reg, pool, tmp_path)  # a live client: its pings keep it
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, nats_url, run_id, pool, "sleep 4"], stdout=subprocess.PIPE, cwd=ROOT
    )
    worker, session = client.stdout.readline().decode().split()

    async def running():  # the client's exec has started (under load it can take a while)
        dirs, pids = leftovers(tmpdir)
        return len(dirs) == 2 and bool(pids)

    await eventually(running, 3.5, "the client's exec to be running", tmp_path)
    client.kill()
    client.wait()

    async def reaped():  # (a ping would refresh the TTL: look at the host instead)
        dirs, pids = leftovers(tmpdir)
        return len(dirs) == 1 and pids == []  # only the keeper's work dir, no process

    await eventually(reaped, 10, "the dead client's session to be reaped", tmp_path)
    reply = await raw(nc, reg.sandbox_session_op(pool, worker, "ping"), {"session": session})
    assert reply["error"]["code"] == "unknown_session"
    assert (await keeper.execute("echo alive")).stdout == "alive\n"
    await keeper.close()
    assert leftovers(tmpdir) == ([], [])


async def test_stop_closes_every_session(nc, run_id, sandbox_worker, tmp_path):
    pool, tmpdir, proc = sandbox_worker()
    reg = Registry(run_id)
    sessions = [await open_when_ready(nc, reg, pool, tmp_path), await RemoteSandbox.open(nc, reg, pool)]
    assert len(leftovers(tmpdir)[0]) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0, logs(tmp_path)
    assert leftovers(tmpdir) == ([], [])
    for s in sessions:
        await s.close()  # the worker is gone: close still returns


async def test_local_async_sandbox_one_thread(nc, run_id):
    sc = SandboxSection(timeout_s=5)
    sbx = await open_async_sandbox(sc)
    assert isinstance(sbx, LocalAsyncSandbox)
    async with sbx:
        threads = await asyncio.gather(*(sbx.execute("true") for _ in range(3)))
        assert all(r.exit_code == 0 for r in threads)
        await sbx.write_file("f", b"1")
        assert await sbx.read_file("f") == b"1"
        assert len(sbx._executor._threads) == 1
        obs = await sbx.observe("echo hi")
        assert obs.exec_id is None and obs.text == "<obs exit=0>\nhi\n</obs>"
    with pytest.raises(SandboxClosed):
        await sbx.execute("true")
    with pytest.raises(ValueError, match="NATS connection"):
        await open_async_sandbox(SandboxSection(remote=True))


# -- soak -------------------------------------------------------------------------
SOAK_CLIENT = """
import asyncio, random, sys
from bus.conn import connect
from bus.subjects import Registry
from sandbox_workers.remote import RemoteSandbox, CapacityExceeded

async def main(url, run_id, pool, seed):
    rng = random.Random(int(seed))
    nc = await connect(url)
    reg = Registry(run_id)
    while True:
        try:
            sbx = await RemoteSandbox.open(nc, reg, pool, attempts=5)
        except CapacityExceeded:
            await asyncio.sleep(0.2)
            continue
        print("opened", sbx.session, flush=True)
        await sbx.write_file("f.txt", b"abc")
        r = rng.random()
        if r < 0.2:  # an exec still running when the client closes, abandons or is killed
            asyncio.ensure_future(sbx.execute("sleep 2", timeout=10))
            await asyncio.sleep(0.05)
        else:
            await sbx.execute("cat f.txt")
        if r < 0.1 or 0.2 <= r < 0.35:
            sbx._keepalive.cancel()  # abandoned: never closed, never pinged again
        else:
            await sbx.close()

asyncio.run(main(*sys.argv[1:]))
"""


def _labelled_containers() -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", "label=rlbus.sandbox=1"], capture_output=True, text=True)
    return out.stdout.split()


def _docker_or_skip():
    from sandbox_workers.factory import docker_available

    if not docker_available():
        pytest.skip("no Docker engine answers (start one: ../shared/tools/docker-engine)")
    from sandbox_workers.images import ensure_image

    ensure_image()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["process", pytest.param("docker", marks=pytest.mark.docker)])
async def test_soak_sessions_with_client_kills(nc, nats_url, run_id, sandbox_worker, tmp_path, backend):
    if backend == "docker":
        _docker_or_skip()
    total, clients, ttl = 1000, 6, 2.0
    pool, tmpdir, proc = sandbox_worker(max_sessions=64, ttl=ttl, backend=backend)
    reg = Registry(run_id)
    await (await open_when_ready(nc, reg, pool, tmp_path)).close()
    rng, opened, kills, live = random.Random(7), 0, 0, []
    t0 = time.monotonic()
    while opened < total:
        while len(live) < clients:
            out = open(tmp_path / f"soak-{kills}-{len(live)}.out", "wb")
            p = subprocess.Popen(
                [sys.executable, "-c", SOAK_CLIENT, nats_url, run_id, pool, str(rng.randrange(1 << 30))],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
            out.close()
            live.append((p, out.name, rng.uniform(1.5, 6.0) + time.monotonic()))
        await asyncio.sleep(0.1)
        for item in [i for i in live if time.monotonic() > i[2]]:
            assert item[0].poll() is None, f"soak client died on its own: {Path(item[1]).read_text()[-2000:]}"
            item[0].kill()
            item[0].wait()
            kills += 1
            live.remove(item)
            opened += Path(item[1]).read_bytes().count(b"opened ")
        assert proc.poll() is None, logs(tmp_path)
    for p, name, _ in live:
        p.kill()
        p.wait()
        opened += Path(name).read_bytes().count(b"opened ")
    elapsed = time.monotonic() - t0

    async def clean():
        return leftovers(tmpdir) == ([], [])

    await eventually(clean, ttl + 30, "every abandoned session to be reaped", tmp_path, every=0.5)
    print(
        f"\nsoak ({backend}): {opened} sessions, {kills} client kills, {elapsed:.1f}s, "
        f"{opened / elapsed:.1f} sessions/s"
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    if backend == "docker":
        assert _labelled_containers() == [], "sandbox containers left after the worker stopped"


async def test_client_cannot_choose_the_run_its_execs_are_recorded_in(nc, run_id, sandbox_worker, tmp_path):
    """Issue 27: an `open` naming another run (`victim`) still records in the worker's own run's bucket;
    before, the record went to `toolrec-victim`, where that run's verifiers would trust it."""
    pool, _, _ = sandbox_worker()
    reg = Registry(run_id)
    await (await open_when_ready(nc, reg, pool, tmp_path)).close()  # the worker is up
    victim = Registry(f"victim{uuid.uuid4().hex[:6]}")
    opened = await raw(nc, reg.sandbox_open(pool), {"run_id": victim.run_id})
    assert "error" not in opened, opened
    sbx = RemoteSandbox(nc, victim, pool, opened)
    obs = await sbx.observe("echo recorded")
    ok, forged = await verify_observations(nc.jetstream(), reg, SECRET.encode(), [ToolTurn(obs.exec_id, obs.text)])
    assert len(ok) == 1 and forged == []
    with contextlib.suppress(NotFoundError):  # no bucket at all: nothing was written for the victim
        ok_v, _ = await verify_observations(nc.jetstream(), victim, SECRET.encode(), [ToolTurn(obs.exec_id, obs.text)])
        assert ok_v == []
    # a malformed run id is ignored as well (never a subject token)
    assert "error" not in await raw(nc, reg.sandbox_open(pool), {"run_id": "bad.id"})
    await sbx.close()


async def test_exec_timeout_is_clamped_to_the_configured_maximum(nc, run_id, sandbox_worker, tmp_path):
    """Issue 27: a client asking for a huge (or infinite) timeout gets `sandbox.max_exec_timeout_s`;
    before, `sleep 30` with timeout 1e9 ran its full 30 s and held the session (and a worker slot)."""
    pool, _, _ = sandbox_worker(max_exec_timeout=1.0)
    reg = Registry(run_id)
    sbx = await open_when_ready(nc, reg, pool, tmp_path)
    for asked in (1e9, float("inf")):
        t0 = time.monotonic()
        reply = await raw(
            nc,
            reg.sandbox_session_op(pool, sbx.worker, "exec"),
            {"session": sbx.session, "cmd": "sleep 30", "timeout": asked},
        )
        took = time.monotonic() - t0
        assert "error" not in reply, reply
        assert reply["result"]["timed_out"] and took < 8, (asked, took, reply)
    await sbx.close()
