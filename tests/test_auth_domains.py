"""Per-role NATS permissions with many domains and held-out eval rounds: the wildcards cover a
hundred domain subjects, and the scheduler may publish eval tasks and put (never read) the
hidden gold of a domain's own eval set."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

from bus.auth import random_passwords, role_permissions, server_auth_config
from bus.conn import connect, ensure_topology
from bus.hidden import HiddenDataMissing, get_hidden, put_hidden
from bus.publish import publish_many
from bus.server import EmbeddedNats
from bus.subjects import Registry
from schemas import ChatMessage, Task

RUN = f"authd{uuid.uuid4().hex[:8]}"
DOMAINS = [f"d{i:03d}" for i in range(100)]


def test_wildcards_cover_every_domain_subject():
    reg = Registry(RUN)
    allowed = {
        role: role_permissions(role, [RUN])["publish"]["allow"]
        for role in ("sampler", "rollout", "verifier", "scheduler")
    }
    for d in DOMAINS:  # one wildcard per role and family, never one per domain
        assert reg.tasks(d).startswith(f"tasks.{RUN}.") and f"tasks.{RUN}.>" in allowed["sampler"]
        assert reg.traj(d).startswith(f"traj.{RUN}.") and f"traj.{RUN}.>" in allowed["rollout"]
        assert reg.rewards(d).startswith(f"rewards.{RUN}.") and f"rewards.{RUN}.>" in allowed["verifier"]
    tokens = {t for subjects in allowed.values() for s in subjects for t in s.split(".")}
    assert not tokens & set(DOMAINS)  # no domain named as a subject token (RUN's hex may hold "d012")
    assert f"tasks.{RUN}.>" in allowed["scheduler"]  # pipeline eval rounds
    assert f"$KV.{reg.hidden_bucket}.>" in allowed["scheduler"]  # puts only


async def test_scheduler_publishes_eval_tasks_and_puts_hidden_but_cannot_read_it(tmp_path):
    passwords = random_passwords()
    server = EmbeddedNats(tmp_path / "nats", config=server_auth_config([RUN], passwords)).start()
    conns = []
    try:

        async def as_user(user):
            nc = await connect(server.url, name=f"test-{user}", user=user, password=passwords[user])
            conns.append(nc)
            return nc.jetstream(timeout=5)

        reg = Registry(RUN)
        sjs = await as_user("scheduler")
        await ensure_topology(await as_user("admin"), reg)
        await put_hidden(sjs, reg, "zs.e0.abc", {"gold": "0"})
        tasks = [
            Task(
                run_id=RUN,
                task_id=f"eval-{d}-0",
                domain=d,
                purpose="eval",
                group_size=1,
                temperature=0.0,
                verifier="math",
                prompt=[ChatMessage(role="user", content="q")],
                hidden_ref="zs.e0.abc",
            )
            for d in DOMAINS
        ]
        await publish_many(sjs, [(reg.tasks(t.domain), t) for t in tasks])
        info = await sjs.stream_info(reg.stream("TASKS"))
        assert info.state.messages == 100
        vjs = await as_user("verifier")
        assert (await get_hidden(vjs, reg, "zs.e0.abc")) == {"gold": "0"}
        with pytest.raises(Exception) as denied:  # a timeout or a permission error, not "missing"
            await asyncio.wait_for(get_hidden(sjs, reg, "zs.e0.abc"), 2.0)
        assert not isinstance(denied.value, HiddenDataMissing)
    finally:
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()
