"""Per-role NATS users against a real nats-server started with `bus.auth.server_auth_config`.

Each role does its job with its own user (topology, consumers, fetch, ack, publish, KV,
object store); the policy side can not reach hidden task data nor publish rewards or
weights; the monitor tails rewards but never sees hidden data. A denied publish is
dropped by the server (it never lands in a stream); a denied subscription receives nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
import pytest_asyncio

from bus.auth import USERS, random_passwords, role_permissions, server_auth_config
from bus.conn import (
    NatsAuthError,
    PermissionDenied,
    check_permitted,
    connect,
    ensure_topology,
    publish_checked,
    pull_subscription,
)
from bus.hidden import get_hidden, put_hidden
from bus.kv import WEIGHTS_LATEST, get_json
from bus.objects import get_blob
from bus.publish import publish
from bus.pull import fetch
from bus.server import EmbeddedNats
from bus.subjects import Registry
from learner.weights import publish_version
from schemas import ChatMessage, Reward, Task, Trajectory, decode

RUN = f"auth{uuid.uuid4().hex[:8]}"
DENIED_WITHIN = 1.5


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A nats-server with every rlbus user, permissions for run RUN."""
    passwords = random_passwords()
    server = EmbeddedNats(tmp_path_factory.mktemp("nats-auth"), config=server_auth_config([RUN], passwords)).start()
    yield server, passwords
    server.stop()


@pytest_asyncio.fixture
async def as_user(auth_server):
    """`await as_user(name)` -> a connection as that user (all closed after the test)."""
    server, passwords = auth_server
    conns = []

    async def open_(user: str):
        nc = await connect(server.url, name=f"test-{user}", user=user, password=passwords[user])
        conns.append(nc)
        return nc

    yield open_
    for nc in conns:
        with contextlib.suppress(Exception):
            await nc.close()


def task(reg: Registry, n: int = 0) -> Task:
    return Task(
        run_id=reg.run_id,
        task_id=f"t{n}",
        domain="arith",
        group_size=1,
        verifier="exact",
        prompt=[ChatMessage(role="user", content="1+1=")],
        hidden_ref=f"arith.t{n}",
    )


def trajectory(t: Task) -> Trajectory:
    return Trajectory(
        run_id=t.run_id,
        task_id=t.task_id,
        task_msg_id=t.msg_id,
        domain=t.domain,
        group_id="g",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier=t.verifier,
        hidden_ref=t.hidden_ref,
        final_text="2",
        policy_version=0,
    )


async def denied(coro) -> bool:
    """True if a JetStream request is dropped by the server (no reply within DENIED_WITHIN s)."""
    try:
        await asyncio.wait_for(coro, DENIED_WITHIN)
    except (asyncio.TimeoutError, TimeoutError):
        return True
    except Exception as exc:  # nats errors also derive from TimeoutError or say "permission"
        return "timeout" in type(exc).__name__.lower() or "permission" in str(exc).lower()
    return False


async def stored(js, reg: Registry, family: str) -> int:
    return (await js.stream_info(reg.stream(family))).state.messages


async def listen(nc, subject: str, seconds: float, action) -> list:
    """Messages `nc` receives on `subject` while `action()` runs (plus `seconds`)."""
    got: list = []

    async def cb(msg):
        got.append(msg)

    sub = await nc.subscribe(subject, cb=cb)
    await nc.flush()
    await action()
    await asyncio.sleep(seconds)
    await sub.unsubscribe()
    return got


def test_config_renders_every_user_and_no_secret_by_default():
    conf = server_auth_config([RUN])
    for user in USERS:
        assert f'user: "{user}"' in conf and f"$RLBUS_NATS_PASSWORD_{user.upper()}" in conf
    rollout = role_permissions("rollout", [RUN])
    flat = " ".join(rollout["publish"]["allow"] + rollout["subscribe"]["allow"])
    assert (
        f"hidden-{RUN}" not in flat and "rewards." not in flat and f"weights.{RUN}" not in rollout["publish"]["allow"]
    )
    # its inbox, the weights announcements and prefetch hints, and its own role's heartbeats (healthcheck)
    assert rollout["subscribe"]["allow"] == sorted(
        ["_INBOX_rollout.>", f"weights.{RUN}", f"weights.{RUN}.prefetch", f"metrics.{RUN}.rollout.*"]
    )
    assert f"weights.{RUN}.prefetch" in role_permissions("learner", [RUN])["publish"]["allow"]
    with pytest.raises(ValueError, match="run id"):
        server_auth_config([])


async def test_rollout_does_its_job_and_nothing_more(as_user):
    reg = Registry(RUN)
    admin, sampler, rollout, learner = [await as_user(u) for u in ("admin", "sampler", "rollout", "learner")]
    ajs, sjs, rjs, ljs = (nc.jetstream(timeout=5) for nc in (admin, sampler, rollout, learner))
    await ensure_topology(rjs, reg, role="rollout")  # creates what it uses, missing ones only
    await ensure_topology(sjs, reg, role="sampler")
    await ensure_topology(ljs, reg, role="learner")
    t = task(reg)
    await put_hidden(sjs, reg, t.hidden_ref, {"gold": "2"})  # sampler: write-only hidden
    await publish(sjs, reg.tasks("arith"), t)
    wv = await publish_version(ljs, reg, None, 0, 0, {})  # learner: object store + weights + KV

    # rollout: consume the task, read weights (KV + object store + WEIGHTS stream), publish a trajectory
    sub = await pull_subscription(rjs, reg.rollout_consumer())
    msgs = await fetch(sub, 10, 3.0)
    assert [decode(m.data, Task).task_id for m in msgs] == [t.task_id]
    for m in msgs:
        await m.ack()
    latest = await get_json(rjs, reg, WEIGHTS_LATEST)
    assert latest["version"] == 0
    assert await get_blob(rjs, latest["uri"], latest["sha256"]) == b"null-policy"
    seen = asyncio.Queue()
    wsub = await rjs.subscribe(reg.weights, cb=seen.put, ordered_consumer=True)
    assert (await asyncio.wait_for(seen.get(), 5)).headers["Nats-Msg-Id"] == wv.msg_id
    await wsub.unsubscribe()
    await publish(rjs, reg.traj("arith"), trajectory(t))
    assert await stored(ajs, reg, "TRAJ") == 1

    # ...and nothing more: no hidden data by any route, no rewards, no weights
    assert await denied(get_hidden(rjs, reg, t.hidden_ref))
    assert await denied(rjs.get_msg(f"KV_{reg.hidden_bucket}", 1))
    assert await denied(rjs.stream_info(f"KV_{reg.hidden_bucket}"))
    assert await denied(publish(rjs, reg.rewards("arith"), Reward(run_id=RUN, trajectory=trajectory(t), reward=1.0)))
    assert await denied(publish(rjs, reg.weights, wv))
    assert await stored(ajs, reg, "REWARDS") == 0 and await stored(ajs, reg, "WEIGHTS") == 1
    # eavesdropping: hidden puts and other roles' replies never reach the rollout user
    for subject in (f"$KV.{reg.hidden_bucket}.>", "_INBOX_verifier.>", "_INBOX.>", "sandbox.>", ">"):
        got = await listen(rollout, subject, 0.3, lambda: put_hidden(sjs, reg, "arith.other", {"gold": "secret"}))
        assert got == [], subject


async def test_verifier_scores_with_hidden_data_and_monitor_tails_rewards(as_user):
    reg = Registry(RUN)
    sampler, verifier, monitor, admin = [await as_user(u) for u in ("sampler", "verifier", "monitor", "admin")]
    sjs, vjs, mjs, ajs = (nc.jetstream(timeout=5) for nc in (sampler, verifier, monitor, admin))
    await ensure_topology(sjs, reg, role="sampler")
    await ensure_topology(vjs, reg, role="verifier")
    t = task(reg, 7)
    await put_hidden(sjs, reg, t.hidden_ref, {"gold": "2"})
    await ensure_topology(ajs, reg, role="rollout")
    await publish(ajs, reg.traj("arith"), trajectory(t))  # as a rollout worker would

    tailed: list = []

    async def on_reward(msg):
        tailed.append(msg)

    tail = await monitor.subscribe(reg.all("rewards"), cb=on_reward)
    await monitor.flush()

    sub = await pull_subscription(vjs, reg.verifier_consumer())
    msgs = await fetch(sub, 10, 3.0)
    assert len(msgs) >= 1
    for m in msgs:
        traj = decode(m.data, Trajectory)
        gold = await get_hidden(vjs, reg, traj.hidden_ref)
        await publish(
            vjs,
            reg.rewards("arith"),
            Reward(run_id=RUN, trajectory=traj, reward=float(traj.final_text == gold["gold"])),
        )
        await m.ack()
    for _ in range(50):
        if tailed:
            break
        await asyncio.sleep(0.05)
    assert [decode(m.data, Reward).reward for m in tailed][-1] == 1.0
    await tail.unsubscribe()
    assert await denied(publish(vjs, reg.weights, decode(msgs[0].data, Trajectory)))  # verifier can't publish weights

    # monitor: status APIs yes, hidden data no, publishing no
    assert (await mjs.stream_info(reg.stream("REWARDS"))).state.messages >= 1
    assert (await mjs.consumer_info(reg.stream("TRAJ"), "verifier")).name == "verifier"
    assert len(await mjs.streams_info()) >= 1
    assert await denied(get_hidden(mjs, reg, t.hidden_ref))
    assert await denied(mjs.get_msg(f"KV_{reg.hidden_bucket}", 1))
    assert await denied(publish(mjs, reg.rewards("arith"), Reward(run_id=RUN, trajectory=trajectory(t), reward=0.0)))
    got = await listen(monitor, ">", 0.3, lambda: get_hidden(vjs, reg, t.hidden_ref))
    got += await listen(monitor, ">", 0.3, lambda: put_hidden(sjs, reg, "arith.more", {"gold": "secret"}))
    assert got, "the monitor's '>' subscription sees the traffic around the hidden read (not its data)"
    leaked = [m.subject for m in got if b"secret" in m.data or b"gold" in m.data]
    assert leaked == []


@pytest.mark.e2e
async def test_payloads_by_reference_each_role_exactly_its_rights(as_user):
    """Sampler puts a workspace, rollout reads it and puts a diff, verifier reads both; the rollout
    writes no workspace (not even a meta: issue 27's poisoning), the verifier writes no payload, and
    neither rollout nor verifier writes (or the verifier reads) weights."""
    from bus.objects import put_blob
    from bus.payloads import get_payload, put_payload
    from bus.weight_stores import NatsStore

    reg = Registry(RUN)
    admin, sampler, rollout, verifier = [await as_user(u) for u in ("admin", "sampler", "rollout", "verifier")]
    ajs, sjs, rjs, vjs = (nc.jetstream(timeout=5) for nc in (admin, sampler, rollout, verifier))
    for js, role in ((sjs, "sampler"), (rjs, "rollout"), (vjs, "verifier")):
        await ensure_topology(js, reg, role=role)  # sampler: workspaces, rollout: artifacts, when missing
    workspace = await put_payload(sjs, reg, b"w" * 3000)
    assert await put_payload(sjs, reg, b"w" * 3000) == workspace  # already there: nothing written, no purge needed
    assert await get_payload(rjs, reg, workspace, "workspace") == b"w" * 3000
    assert await get_payload(vjs, reg, workspace) == b"w" * 3000
    diff = await put_payload(rjs, reg, b"d" * 3000, "artifact")
    assert await get_payload(vjs, reg, diff, "artifact") == b"d" * 3000
    assert await denied(put_payload(vjs, reg, b"v" * 3000, "artifact"))
    assert await denied(put_payload(rjs, reg, b"r" * 3000, "workspace"))  # no workspace from the policy side
    # a planted meta (or a replaced object) under the workspace's own name: refused to rollout
    assert await denied(rjs.publish(f"$O.{reg.workspace_bucket}.M.planted", b"{}"))
    assert await denied(put_blob(rjs, reg.workspace_bucket, f"sha256-{workspace.sha256}", b"x", purge_replaced=False))
    wv = await publish_version(ajs, reg, None, 0, 0, {})
    assert await denied(get_blob(vjs, wv.uri, wv.sha256))
    for js in (rjs, vjs):
        assert await denied(put_blob(js, reg.object_bucket, "v000009.safetensors", b"forged"))
    assert await denied(sjs.purge_stream(f"OBJ_{reg.workspace_bucket}"))
    assert await get_payload(vjs, reg, workspace) == b"w" * 3000  # unchanged by every refused write
    assert len(await NatsStore(ajs, reg.workspace_bucket).names()) == 1
    assert len(await NatsStore(ajs, reg.artifact_bucket).names()) == 1
    assert "v000009.safetensors" not in await NatsStore(ajs, reg.object_bucket).names()


async def test_generated_env_and_rendered_conf_work_together(tmp_path):
    """`natsauth write-env` + `write-conf`: the server reads passwords from its environment."""
    import subprocess

    from bus.server import nats_server_binary
    from rlbus.natsauth import read_env, render_conf, write_env_file

    env_file = write_env_file(tmp_path / ".env")
    assert env_file.stat().st_mode & 0o777 == 0o600
    env = read_env(env_file)
    assert write_env_file(tmp_path / ".env") and read_env(env_file) == env  # kept, not rotated
    # the host's login: the read-only monitor, with the monitor's password
    assert env["RLBUS_NATS_USER"] == "monitor" and env["RLBUS_NATS_PASSWORD"] == env["RLBUS_NATS_PASSWORD_MONITOR"]
    assert all(v.startswith("pw") for k, v in env.items() if k.startswith("RLBUS_NATS_PASSWORD"))
    conf = render_conf([RUN])
    assert all(pw not in conf for k, pw in env.items() if k.startswith("RLBUS_NATS_PASSWORD"))
    (tmp_path / "rendered.conf").write_text(conf)
    check = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(tmp_path / "rendered.conf")],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr + check.stdout
    with EmbeddedNats(tmp_path / "srv", config=server_auth_config([RUN]), env=env) as server:
        nc = await connect(server.url, name="env-pw", user="rollout", password=env["RLBUS_NATS_PASSWORD_ROLLOUT"])
        await ensure_topology(nc.jetstream(timeout=5), Registry(RUN), role="rollout")
        await nc.close()
        with pytest.raises(Exception):
            await connect_once(server.url, "rollout", "not-the-password")


async def connect_once(url: str, user: str, password: str):
    import nats

    return await nats.connect(
        url, user=user, password=password, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0
    )


async def test_denied_publish_and_subscribe_raise_a_clear_permission_error_and_are_logged(as_user, auth_server):
    """The server's refusal reaches the caller as PermissionDenied naming user and subject, and is logged."""
    from structlog.testing import capture_logs

    reg = Registry(RUN)
    monitor, rollout = await as_user("monitor"), await as_user("rollout")
    with capture_logs() as logs:
        with pytest.raises(PermissionDenied, match=rf"(?i)'monitor'.*publish.*rewards\.{RUN}\.x"):
            await publish_checked(monitor, f"rewards.{RUN}.x", b"{}")
        await rollout.subscribe(f"$KV.{reg.hidden_bucket}.>")
        with pytest.raises(PermissionDenied, match=rf"(?i)'rollout'.*subscription.*hidden-{RUN}"):
            await check_permitted(rollout)
        await publish_checked(rollout, f"metrics.{RUN}.rollout.w1", b"{}")  # allowed: no error
    denied = [e for e in logs if e["event"] == "bus.permission_denied"]
    assert {e["user"] for e in denied} == {"monitor", "rollout"}, logs
    assert any(f"rewards.{RUN}.x" in e["error"] for e in denied)


async def test_login_without_or_with_wrong_credentials_fails_at_once(auth_server, monkeypatch):
    """connect() retries unreachable servers forever, but a refused login raises NatsAuthError."""
    server, passwords = auth_server
    for var in ("RLBUS_NATS_USER", "RLBUS_NATS_PASSWORD", "RLBUS_NATS_PASSWORD_FILE", "RLBUS_NATS_CREDS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(NatsAuthError, match="without credentials"):
        await asyncio.wait_for(connect(server.url, name="anon"), 10)
    with pytest.raises(NatsAuthError, match="as user 'rollout'"):
        await asyncio.wait_for(connect(server.url, name="bad", user="rollout", password="pwwrong"), 10)
    monkeypatch.setenv("RLBUS_NATS_USER", "monitor")
    monkeypatch.setenv("RLBUS_NATS_PASSWORD", passwords["monitor"])
    nc = await connect(server.url, name="env-login")  # the environment's login, as the CLI uses it
    assert nc.is_connected
    await nc.close()


def test_cli_exits_with_the_reason_on_a_refused_login_and_a_denied_subject(auth_server, tmp_path):
    """`rlbus status`/`tail` as a subprocess: no credentials -> refused; monitor tailing hidden data -> denied."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    server, passwords = auth_server
    rlbus = str(Path(sys.executable).parent / "rlbus")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_NATS_")}
    r = subprocess.run(
        [rlbus, "status", "--nats-url", server.url, "--run-id", RUN, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "refused the login without credentials" in r.stderr, r.stderr
    env.update(RLBUS_NATS_USER="monitor", RLBUS_NATS_PASSWORD=passwords["monitor"])
    r = subprocess.run(
        [rlbus, "tail", f"$KV.hidden-{RUN}.>", "--nats-url", server.url, "--timeout", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "not allowed" in r.stderr and "subscription" in r.stderr.lower(), r.stderr
    r = subprocess.run(
        [rlbus, "--nats-creds", str(tmp_path / "missing.creds"), "status", "--nats-url", server.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "missing.creds" in r.stderr and "does not exist" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


async def test_creds_file_is_passed_as_nats_user_credentials(tmp_path, monkeypatch):
    """--nats-creds / RLBUS_NATS_CREDS: the standard NATS .creds file, given to nats-py as user_credentials."""
    import nats as nats_mod

    creds = tmp_path / "rollout.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.e30.x\n------END NATS USER JWT------\n")
    seen = {}

    async def fake_connect(servers, **kw):
        seen.update(kw, servers=servers)
        return type("NC", (), {})()

    monkeypatch.setattr(nats_mod, "connect", fake_connect)
    monkeypatch.setenv("RLBUS_NATS_CREDS", str(creds))
    monkeypatch.setenv("RLBUS_NATS_USER", "rollout")
    monkeypatch.setenv("RLBUS_NATS_PASSWORD", "ignored-with-creds")
    import sys
    import types

    monkeypatch.setitem(sys.modules, "nkeys", None)  # not installed: a clear error, not nats-py's ImportError later
    with pytest.raises(NatsAuthError, match="nkeys"):
        await connect("nats://127.0.0.1:1", name="creds")
    monkeypatch.setitem(sys.modules, "nkeys", types.ModuleType("nkeys"))  # installed (nats-py uses it to sign)
    await connect("nats://127.0.0.1:1", name="creds")
    assert seen["user_credentials"] == str(creds) and "password" not in seen and "user" not in seen
    assert seen["inbox_prefix"] == "_INBOX_rollout"
    monkeypatch.setenv("RLBUS_NATS_CREDS", str(tmp_path / "nope.creds"))
    with pytest.raises(NatsAuthError, match="does not exist"):
        await connect("nats://127.0.0.1:1", name="creds")
