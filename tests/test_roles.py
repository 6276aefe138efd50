"""One role table (`bus/roles.py`) drives every list of roles: subjects, `--max-messages` units,
NATS users and topology rights, the `worker` command, the container entry point, the
launcher's start and drain order, and the bus bench's pipeline."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect

import pytest

from bus import auth, roles, session, subjects, telemetry
from bus.roles import ROLES
from schemas.config import load_config

START = ("learner", "scheduler", "tracker", "sandbox", "verifier", "rollout", "sampler")
"""The launcher's start order as it was before the table (pinned: the table must not change it)."""
DRAIN = [
    (["sampler"], 30),
    (["rollout", "verifier", "sandbox"], 30),
    (["learner"], 60),
    (["scheduler"], 60),
    (["tracker"], 60),
]
"""The launcher's drain as it was before the table: (roles stopped together, seconds before SIGKILL)."""


def test_the_table_is_well_formed():
    names = [r.name for r in ROLES]
    assert len(set(names)) == len(names) and len({r.start for r in ROLES}) == len(ROLES)
    assert subjects.ROLES == roles.NAMES == tuple(names)
    for r in ROLES:
        subjects.check_token("role", r.name)
        assert r.limit_unit and r.stop_timeout_s > 0
        assert roles.role(r.name) is r
    with pytest.raises(ValueError, match="unknown role 'nope'"):
        roles.role("nope")


@pytest.mark.parametrize("role", ROLES, ids=lambda r: r.name)
def test_every_role_module_imports_and_runs_a_coroutine(role):
    module = importlib.import_module(role.module)
    assert inspect.iscoroutinefunction(module.run), f"{role.module}.run must be `async def run(cfg, ctx)`"


def test_nats_users_and_topology_read_the_table():
    assert auth.USERS[: len(ROLES)] == tuple(r.nats_user for r in ROLES)
    assert auth.USERS[len(ROLES) :] == (auth.MONITOR, auth.ADMIN)
    assert auth.ROLE_TOPOLOGY == {r.name: r.creates for r in ROLES}
    reg = subjects.Registry("r1")
    assert all(auth.stream_name(reg, f) for r in ROLES for f in r.creates)
    conf = auth.server_auth_config(["r1"])
    for r in ROLES:
        perms = auth.role_permissions(r.nats_user, ["r1"])
        assert f"metrics.r1.{r.name}.*" in perms["publish"]["allow"], r.name  # its own heartbeats
        assert f'user: "{r.nats_user}"' in conf


def test_max_messages_units_read_the_table():
    assert session.ROLE_LIMIT == {r.name: r.limit_unit for r in ROLES}


def test_the_worker_command_reads_the_table():
    from rlbus.commands import worker

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    worker.register(sub)
    parser = sub.choices["worker"]
    (positional,) = [a for a in parser._actions if a.dest == "role"]
    assert tuple(positional.choices) == roles.NAMES
    (limit,) = [a for a in parser._actions if a.dest == "max_messages"]
    assert all(f"{r.name}: {r.limit_unit}" in limit.help for r in ROLES)


def test_the_container_entry_point_reads_the_table():
    from rlbus import entrypoint

    assert all(r.name in entrypoint.USAGE for r in ROLES)
    assert entrypoint.ROLES == roles.NAMES


def test_the_launcher_starts_in_table_order():
    from rlbus.run.launcher import roles_to_start

    everything = load_config(None, ['tracking.backends=["tensorboard"]', "sandbox.remote=true"])
    assert tuple(roles_to_start(everything)) == START == roles.in_start_order(roles.NAMES)
    assert tuple(roles_to_start(load_config(None))) == tuple(r for r in START if r not in ("tracker", "sandbox"))
    assert "sandbox" in roles_to_start(load_config(None, ["sandbox.remote=true"]))
    assert "tracker" not in roles_to_start(load_config(None, ["sandbox.remote=true"]))


class _Sup:
    """A supervisor that records what it is told to stop."""

    def __init__(self):
        self.calls: list[tuple[list[str], float]] = []
        self.procs = {r: None for r in roles.NAMES}

    async def stop(self, names, timeout):
        self.calls.append((list(names), timeout))


def _drained(stop_reason: str) -> list[tuple[list[str], float]]:
    from rlbus.run.launcher import RunLoop
    from rlbus.run.live import Snapshot

    loop = RunLoop.__new__(RunLoop)  # only what drain() touches
    loop.sup, loop.cfg = _Sup(), load_config(None, ["run.drain_seconds=5"])
    loop.snap = Snapshot(run_id="r1")
    loop.snap.depths.update(tasks=0, traj=0, rewards=0)  # drained at once
    loop.interrupted = asyncio.Event()

    async def refresh():
        return None

    loop._refresh = refresh
    asyncio.run(RunLoop.drain(loop, stop_reason))
    return loop.sup.calls


def test_the_launcher_drains_in_table_order():
    assert _drained("max_steps") == DRAIN
    assert [(list(rs), t) for rs, t in roles.stop_phases()] == DRAIN
    assert _drained("failed") == [(list(roles.NAMES), 5)]  # after a failure: everyone at once


def test_the_bus_bench_starts_the_pipeline_in_table_order():
    bench_bus = importlib.import_module("bench.bus")
    assert bench_bus.ROLES == ("learner", "verifier", "rollout", "sampler")
    assert bench_bus.ROLES == roles.in_start_order(telemetry.STAGE_COUNTER)
