"""The learner's external launch (`learner.launch = "external"`, learner/rendezvous.py): one rank per
process, started from outside as Kubernetes pods or srun tasks start them, finding each other
through torch's env:// variables. On CPU with gloo, on loopback, no mocks:

- Two ranks started separately: rank 1 is the real pod command (`rlbus worker learner` with
  RANK=1, MASTER_ADDR/MASTER_PORT, WORLD_SIZE; it opens no bus session), rank 0 is this
  process's `RankGroup` with the rendezvous `resolve` reads from the same variables. Their
  steps equal the one-process learner's on the same batches (the reference of
  tests/test_sharded_learner.py), and rank 1 exits 0 after rank 0's stop. (e2e: two torch
  processes load the model and train, about 30 s on 2 shared cores.)
- Every missing or malformed variable is named in one error; the StatefulSet ordinal of the
  host name is a rank; a rank that never comes, a rank 0 that is not there, and a rank taken
  twice each end the rendezvous with what to check, in about a second, not a hang.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from learner.rendezvous import Rendezvous, RendezvousError, join, resolve, wait_for_ranks
from schemas.config import LearnerSection

ROOT = Path(__file__).resolve().parents[1]
LC = LearnerSection(world_size=2, launch="external", backend="gloo", rendezvous_timeout_s=1.0)


def env(**kw) -> dict[str, str]:
    return {k: str(v) for k, v in kw.items()}


def test_resolve_reads_the_torch_variables_and_the_pod_ordinal():
    rv = resolve(LC, env(MASTER_ADDR="exp-7-learner-0.exp-7-learner", MASTER_PORT=29500, RANK=1, WORLD_SIZE=2), "h")
    assert rv == Rendezvous(1, 2, "exp-7-learner-0.exp-7-learner", 29500, 0, "RANK")
    pod = resolve(LC, env(MASTER_ADDR="a", MASTER_PORT=29500), "exp-7-learner-1")  # a StatefulSet pod's host name
    assert (pod.rank, pod.rank_from) == (1, "host name exp-7-learner-1")
    srun = resolve(LC, env(MASTER_ADDR="a", MASTER_PORT=1, SLURM_PROCID=1, SLURM_LOCALID=3), "node7")
    assert (srun.rank, srun.local_rank, srun.rank_from) == (1, 3, "SLURM_PROCID")
    assert resolve(LC, env(MASTER_ADDR="a", MASTER_PORT=1, RANK=0, LOCAL_RANK=2), "exp-7-learner-1").rank == 0


@pytest.mark.parametrize(
    "variables, hostname, says",
    [
        ({}, "node7", ["MASTER_ADDR is not set", "MASTER_PORT is not set", "set RANK"]),
        (dict(MASTER_ADDR="a", MASTER_PORT="x", RANK=0), "h", ["MASTER_PORT='x' is not an integer"]),
        (dict(MASTER_ADDR="a", MASTER_PORT=70000, RANK=0), "h", ["MASTER_PORT=70000 is not a TCP port"]),
        (dict(MASTER_ADDR="a", MASTER_PORT=1, RANK=0, WORLD_SIZE=4), "h", ["WORLD_SIZE=4 but learner.world_size = 2"]),
        (dict(MASTER_ADDR="a", MASTER_PORT=1), "exp-7-learner-2", ["rank 2 (from host name exp-7-learner-2)"]),
    ],
)
def test_a_missing_or_bad_variable_says_what_to_set(variables, hostname, says):
    with pytest.raises(RendezvousError) as err:
        resolve(LC, env(**variables), hostname)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("learner.launch = 'external'"), msg
    assert all(s in msg for s in says), msg


def test_a_missing_rank_times_out_with_the_missing_ranks_named():
    import torch.distributed  # noqa: F401 - imported before the clock starts (slow on a loaded machine)

    from bus.server import free_port

    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"only ranks \[0\] of 2 joined .* missing ranks \[1\]"):
        join(Rendezvous(0, 2, "127.0.0.1", port), LC, "gloo")  # rank 0 alone
    assert time.monotonic() - started < 30  # the 1 s timeout, not a hang (the default is 600 s)


def test_no_rank_0_and_a_rank_taken_twice_are_errors():
    from torch.distributed import TCPStore

    from bus.server import free_port

    port = free_port()
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=f"could not reach rank 0 at 127.0.0.1:{port} within 1 s"):
        join(Rendezvous(1, 2, "127.0.0.1", port), LC, "gloo")
    assert time.monotonic() - started < 30
    from datetime import timedelta

    master = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=5))
    master.add("rlbus/rendezvous/rank/1", 1)  # rank 1 arrived
    with pytest.raises(RendezvousError, match="learner rank 1 joined twice"):
        wait_for_ranks(client, Rendezvous(1, 2, "127.0.0.1", port), 1.0)  # a second process claims rank 1
    wait_for_ranks(client, Rendezvous(0, 2, "127.0.0.1", port), 1.0)  # rank 0 completes the world


def _worker_cli(tmp_path: Path, model_dir: Path, extra_env: dict[str, str], *sets: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlbus.cli",
        "worker",
        "learner",
        "--config",
        "examples/smoke.toml",
        "--run-id",
        "ext",
        "--run-dir",
        str(tmp_path / "runs"),
        "--nats-url",
        "nats://127.0.0.1:1",  # nothing listens: a follower rank must never connect
        "--set",
        "learner.world_size=2",
        "--set",
        "learner.launch=external",
        "--set",
        "learner.backend=gloo",
        "--set",
        f"model.path={model_dir}",
        *[x for s in sets for x in ("--set", s)],
    ]


def test_worker_without_master_addr_exits_naming_it(tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "SLURM_PROCID")}
    out = subprocess.run(
        _worker_cli(tmp_path, tmp_path / "no-model", {}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rlbus worker learner: learner.launch = 'external'"), out.stderr
    assert "MASTER_ADDR is not set" in last and "MASTER_PORT is not set" in last, last


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_separately_started_ranks_match_one_rank(tiny_model, tmp_path):
    from bus.server import free_port
    from learner.ranks import RankGroup
    from tests.test_sharded_learner import EQUIV_ATOL, TINY, batches, max_diff, one_rank

    model_dir = tiny_model(**TINY)
    lc = LearnerSection(
        world_size=2,
        launch="external",
        backend="gloo",
        lr=1e-3,
        micro_batch_size=5,
        micro_batch_max_padding=0.0,
        dist_timeout_s=60,
        rendezvous_timeout_s=120,
    )
    k = 3
    steps = batches(k)
    want, want_metrics = one_rank(model_dir, lc, steps)
    port = free_port()
    variables = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2)
    rank1 = subprocess.Popen(
        _worker_cli(tmp_path, model_dir, {}, "learner.lr=1e-3", "learner.micro_batch_size=5"),
        cwd=ROOT,
        env={**os.environ, **variables, "RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    async def rank0():
        group = RankGroup(lc, model_dir, tmp_path / "run0", rendezvous=resolve(lc, {**variables, "RANK": "0"}, "h"))
        await group.start()
        try:
            metrics = [await group.train(batch, lc) for batch in steps]
            return metrics, await group.full_state()
        finally:
            await group.close()

    try:
        metrics, got = asyncio.run(rank0())
        log = rank1.communicate(timeout=60)[0]
    finally:
        if rank1.poll() is None:
            rank1.kill()
    assert rank1.returncode == 0, log
    assert "learner.rendezvous" in log and "learner.rank_stopped" in log, log
    diff = max_diff(got, want)
    print(f"external launch, 2 ranks vs 1 rank after {k} steps: max abs param diff {diff:.3g}")
    assert diff <= EQUIV_ATOL, diff
    for m, w in zip(metrics, want_metrics):
        assert m["loss"] == pytest.approx(w["loss"], abs=1e-5) and m["samples"] == w["samples"] == 15
        assert m["micro_batches"] == w["micro_batches"] == 3  # one rank ran a zero-weighted micro-batch


def test_health_of_a_follower_rank_is_its_metrics(monkeypatch, capsys):
    """`rlbus-entrypoint health learner` (the pod's liveness probe) on rank > 0 of a per-rank pod: no bus
    heartbeat there, so healthy exactly when its /metrics answers."""
    from prometheus_client import CollectorRegistry, start_http_server

    from bus.server import free_port
    from learner.rendezvous import follower_rank
    from rlbus.entrypoint import main

    assert follower_rank({"RLBUS_LEARNER_LAUNCH": "external"}, "exp-7-learner-2") == 2
    assert follower_rank({"RLBUS_LEARNER_LAUNCH": "external"}, "exp-7-learner-0") is None  # rank 0: the heartbeat
    assert follower_rank({}, "exp-7-learner-2") is None  # not a per-rank pod
    port = free_port()
    for k, v in {"RLBUS_LEARNER_LAUNCH": "external", "RANK": "1", "RLBUS_METRICS_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    assert main(["health", "learner"]) == 1
    assert f"unhealthy: learner rank 1: /metrics on port {port} does not answer" in capsys.readouterr().err
    server, thread = start_http_server(port, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        assert main(["health", "learner"]) == 0
    finally:
        server.shutdown()
        thread.join(5)


def test_rlbus_up_refuses_an_external_learner():
    """`rlbus up` starts one learner process: an external launch there would wait for ranks nobody starts."""
    import io

    from rich.console import Console

    from rlbus.run.checks import check_learner
    from schemas.config import load_config

    out = io.StringIO()
    cfg = load_config(ROOT / "examples" / "smoke.toml", ["learner.world_size=2", "learner.launch=external"])
    assert not check_learner(cfg, Console(file=out, width=400))
    assert "rlbus up: learner.launch = 'external'" in out.getvalue() and "set learner.launch = 'auto'" in out.getvalue()
    assert check_learner(load_config(ROOT / "examples" / "smoke.toml", ["learner.world_size=2"]), Console(file=out))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_rank_0_notices_a_lost_rank_while_idle(tiny_model, tmp_path):
    """SIGKILL of rank 1 (a pod lost) while rank 0 waits for rewards: rank 0's keepalive ping fails and
    rank 0 stops (`peer_lost`; in the worker it exits with RANK_DIED_EXIT) instead of keeping a group a
    restarted rank 1 could never rejoin."""
    from bus.server import free_port
    from learner.ranks import RankGroup, _leave
    from tests.test_sharded_learner import TINY

    model_dir = tiny_model(**TINY)
    lc = LearnerSection(world_size=2, launch="external", backend="gloo", dist_timeout_s=6, rendezvous_timeout_s=120)
    variables = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=2)
    rank1 = subprocess.Popen(
        _worker_cli(tmp_path, model_dir, {}, "learner.dist_timeout_s=6"),
        cwd=ROOT,
        env={**os.environ, **variables, "RANK": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def rank0() -> str | None:
        rv = resolve(lc, {**variables, "RANK": "0"}, "h")
        group = RankGroup(lc, model_dir, tmp_path / "run0", exit_on_rank_death=False, rendezvous=rv)
        await group.start()
        try:
            rank1.kill()
            rank1.wait(10)
            deadline = time.monotonic() + 60
            while group.dead is None and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            return group.dead
        finally:
            group.abort()
            # this pytest process runs other tests: leave the failed group (a worker would exit)
            await group.call(_leave)
            group.pool.shutdown()

    try:
        dead = asyncio.run(rank0())
    finally:
        if rank1.poll() is None:
            rank1.kill()
    assert dead and dead.startswith("a learner rank left the group"), dead


RANK0 = """
import asyncio, sys
from learner.ranks import RankGroup
from learner.rendezvous import resolve
from schemas.config import LearnerSection

async def main():
    lc = LearnerSection(world_size=2, launch="external", backend="gloo", rendezvous_timeout_s=120)
    group = RankGroup(lc, sys.argv[1], sys.argv[2], rendezvous=resolve(lc))
    await group.start()
    print("up", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_follower_exits_with_rank_died_when_rank_0_goes(tiny_model, tmp_path):
    """SIGKILL of rank 0 (its pod lost): rank 1, the real pod command, logs `learner.rank_died` and exits
    with RANK_DIED_EXIT at once (its collective fails), so its pod restarts and meets the new rank 0."""
    from bus.server import free_port
    from learner.ranks import RANK_DIED_EXIT
    from tests.test_sharded_learner import TINY

    model_dir = tiny_model(**TINY)
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    variables = {**os.environ, **env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=2)}
    rank1 = subprocess.Popen(
        _worker_cli(tmp_path, model_dir, {}),
        cwd=ROOT,
        env={**variables, "RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rank0 = subprocess.Popen(
        [sys.executable, str(script), str(model_dir), str(tmp_path / "run0")],
        cwd=ROOT,
        env={**variables, "RANK": "0", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        while rank0.stdout.readline().strip() != "up":  # skip the log lines
            assert rank0.poll() is None
        rank0.kill()
        rank0.wait(10)
        started = time.monotonic()
        log = rank1.communicate(timeout=60)[0]
        waited = time.monotonic() - started
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
    assert rank1.returncode == RANK_DIED_EXIT, log[-2000:]
    assert "learner.rank_died" in log and "learner.rank_stopped" not in log, log[-2000:]
    assert waited < 30, waited  # not the 120 s collective timeout: the closed connection ends it
