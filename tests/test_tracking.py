"""Experiment tracking: the tracker role writes TensorBoard event files and an offline wandb
run from real bus messages (a real nats-server), without losing or repeating a point
across restarts; a missing package names the extra.

TensorBoard is read back with TensorBoard's own `EventAccumulator`. The offline wandb run
is read back from its transaction log (`offline-run-*/run-<id>.wandb`, the file `wandb
sync` uploads): a LevelDB-style record log whose records are wandb's own protobuf
`Record` messages (`wandb.proto.wandb_internal_pb2`), so the test decodes exactly what
wandb wrote, history rows and the run config included.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bus.conn import connect, ensure_topology
from bus.kv import CURRICULUM, put_json
from bus.publish import publish
from bus.session import WorkerContext
from bus.subjects import Registry
from rlbus.run.launcher import roles_to_start
from rlbus.tracking import tracker
from rlbus.tracking.points import Steps, Timeline, Windows
from schemas import EvalResult, Reward, WeightVersion
from schemas.config import load_config
from tests.conftest import ROOT, logs
from tests.messages import make_task, make_trajectory

pytest.importorskip("tensorboard", reason="the tracking extra: pip install -e '.[tracking]'")
pytest.importorskip("wandb", reason="the tracking extra: pip install -e '.[tracking]'")

STEP1 = {
    "loss": 0.5,
    "pg_loss": 0.45,
    "kl": 0.01,
    "clip_frac": 0.125,
    "ratio_mean": 1.0,
    "ratio_max": 1.5,
    "grad_norm": 2.0,
    "tokens": 40.0,
    "staleness_mean": 0.5,
    "staleness_max": 1.0,
    "reward_mean": 0.75,
}


# -- reading back what the backends wrote ----------------------------------------------
def tb_scalars(run_path: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar in the run's TensorBoard dir (all event files)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tb_texts(run_path: Path, tag: str = "samples") -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    name = f"{tag}/text_summary"
    if name not in acc.Tags()["tensors"]:
        return []
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(name)]


def wandb_records(run_file: Path) -> list:
    """Every `Record` of a wandb transaction log (header `:W&B`, 32 KiB blocks, chunked records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, out, part = run_file.read_bytes(), 32 * 1024, 7, [], b""
    assert data[:4] == b":W&B", f"{run_file} is not a wandb log"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):  # full or last chunk: one record
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
    return out


def wandb_runs(run_path: Path) -> list[tuple[Path, dict, list[dict]]]:
    """(offline run dir, run config, history rows) per offline run of the rlbus run."""
    out = []
    for d in sorted((run_path / "wandb").glob("offline-run-*")):
        config, rows = {}, []
        for rec in wandb_records(next(d.glob("run-*.wandb"))):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                config = {u.key: json.loads(u.value_json) for u in rec.run.config.update}
            elif kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        out.append((d, config, rows))
    return out


def wandb_points(run_path: Path, tag: str) -> list[tuple[int, float]]:
    """(learner step, value) of `tag` over every offline run of the rlbus run."""
    return [(row["learner/step"], row[tag]) for _, _, rows in wandb_runs(run_path) for row in rows if tag in row]


# -- publishing real messages ----------------------------------------------------------
def reward(reg: Registry, domain: str, value: float, purpose: str = "train") -> Reward:
    task = make_task(reg.run_id, f"{domain}-{value}")
    traj = make_trajectory(reg.run_id, task).model_copy(update={"domain": domain, "purpose": purpose})
    return Reward(run_id=reg.run_id, trajectory=traj, reward=value, components={"correct": value, "format": 1.0})


async def version(js, reg: Registry, v: int, step: int, metrics: dict | None = None) -> None:
    await publish(
        js,
        reg.weights,
        WeightVersion(
            run_id=reg.run_id,
            version=v,
            step=step,
            uri=f"nats://w/{v}",
            sha256="0" * 64,
            bytes=1,
            metrics=metrics or {},
        ),
    )


async def rewards(js, reg: Registry, *items: tuple[str, float]) -> None:
    for domain, value in items:
        await publish(js, reg.rewards(domain), reward(reg, domain, value))


def tracking_config(tmp_path: Path, run_id: str, backends=("tensorboard", "wandb")):
    path = tmp_path / "tracking.toml"
    path.write_text(
        f'[run]\nrun_id = "{run_id}"\n[tracking]\nbackends = {json.dumps(list(backends))}\n'
        'project = "rlbus-test"\ntags = ["ci"]\nsamples_every_n_steps = 1\nsamples_per_table = 2\n'
    )
    return path, load_config(path)


@pytest.fixture(autouse=True)
def wandb_offline():
    """wandb offline in this process and the workers it spawns, even where a WANDB_API_KEY is set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        yield


async def run_tracker(cfg, nats_url: str, run_path: Path, **limits) -> dict:
    ctx = WorkerContext(run_id=cfg.run.run_id, nats_url=nats_url, run_path=run_path, **limits)
    return await tracker.run(cfg, ctx)


# -- the tests -------------------------------------------------------------------------
async def test_tensorboard_and_wandb_get_every_metric(js, nats_url, run_id, tmp_path, drop_run):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    _, cfg = tracking_config(tmp_path, run_id)
    run_path = tmp_path / "runs" / run_id
    await version(js, reg, 0, 0)
    await rewards(js, reg, ("arith", 1.0), ("arith", 0.0), ("tool_calc", 1.0))
    await publish(js, reg.rewards("arith"), reward(reg, "arith", 0.0, purpose="eval"))  # not a train reward
    await put_json(
        js,
        reg,
        CURRICULUM,
        {"version": 1, "weights": {"arith": 0.7, "tool_calc": 0.3}, "levels": {"arith": 2, "tool_calc": 1}},
    )
    await version(js, reg, 1, 1, STEP1)
    await rewards(js, reg, ("arith", 1.0), ("arith", 1.0))
    await publish(
        js,
        reg.eval("arith"),
        EvalResult(run_id=run_id, version=1, step=1, domain="arith", score=0.7, n=10, eval_set_sha256="e" * 64),
    )
    await version(js, reg, 2, 2, {**STEP1, "loss": 0.25})

    counters = await run_tracker(cfg, nats_url, run_path, until_idle=1.0)
    assert counters["weights"] == 3 and counters["rewards"] == 6 and counters["evals"] == 1, counters

    tb = tb_scalars(run_path)
    assert tb["learner/loss"] == [(1, 0.5), (2, 0.25)]
    for name in ("kl", "clip_frac", "ratio_mean", "grad_norm", "tokens", "staleness_mean", "reward_mean"):
        assert tb[f"learner/{name}"][0] == (1, pytest.approx(STEP1[name])), name
    assert tb["train/reward_mean"] == [(0, pytest.approx(2 / 3)), (1, 1.0)]
    assert tb["train/arith/reward_mean"] == [(0, 0.5), (1, 1.0)]
    assert tb["train/tool_calc/reward_mean"] == [(0, 1.0)]
    assert tb["train/samples"] == [(0, 3.0), (1, 2.0)]
    assert tb["train/neg_logprob_mean"][0] == (0, pytest.approx(0.375))  # -(-0.5 - 0.25) / 2 tokens
    assert tb["eval/arith"] == [(1, pytest.approx(0.7))]
    assert tb["curriculum/arith/weight"] == [(0, pytest.approx(0.7))]
    assert tb["curriculum/arith/level"] == [(0, 2.0)]
    for tag in ("queue/tasks", "queue/trajectories", "dead_letters/total"):
        assert tag in tb, sorted(tb)
    samples = tb_texts(run_path)
    assert [s for s, _ in samples] == [0, 1] and "| step | domain | reward |" in samples[0][1], samples

    runs = wandb_runs(run_path)
    assert len(runs) == 1 and runs[0][0].name.endswith(f"-{run_id}"), runs
    _, config, _ = runs[0]
    assert config["tracking"]["backends"] == ["tensorboard", "wandb"] and config["run"]["run_id"] == run_id
    assert wandb_points(run_path, "learner/loss") == [(1, 0.5), (2, 0.25)]
    assert wandb_points(run_path, "train/arith/reward_mean") == [(0, 0.5), (1, 1.0)]
    assert wandb_points(run_path, "eval/arith") == [(1, 0.7)]
    assert wandb_points(run_path, "curriculum/tool_calc/weight") == [(0, 0.3)]
    assert [step for step, _ in wandb_points(run_path, "samples/nrows")] == [0, 1]


@pytest.mark.e2e  # multi-process / fault case: make test-e2e
async def test_a_restarted_tracker_neither_loses_nor_repeats_a_point(
    js, nats_url, run_id, tmp_path, drop_run, spawn_worker
):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    config_path, cfg = tracking_config(tmp_path, run_id)
    run_path = tmp_path / "runs" / run_id
    await version(js, reg, 0, 0)
    await rewards(js, reg, ("arith", 1.0), ("arith", 0.0))
    await version(js, reg, 1, 1, STEP1)
    await rewards(js, reg, ("arith", 1.0))
    first = await run_tracker(cfg, nats_url, run_path, until_idle=1.0)
    assert first["rewards"] == 3, first

    # the server forgets every ack position: only the tracker's own state says where it was
    for feed in tracker.FEEDS:
        spec = reg.tracker_consumer(feed, CURRICULUM if feed == "kv" else "")
        await js.delete_consumer(spec.stream, spec.durable)
    await rewards(js, reg, ("arith", 0.0))  # late for step 1 (written at the clean stop): counts at step 2
    await version(js, reg, 2, 2, {**STEP1, "loss": 0.25})
    await rewards(js, reg, ("arith", 1.0), ("arith", 1.0))
    await publish(
        js,
        reg.eval("arith"),
        EvalResult(run_id=run_id, version=2, step=2, domain="arith", score=0.5, n=4, eval_set_sha256="e" * 64),
    )
    await version(js, reg, 3, 3, {**STEP1, "loss": 0.125})
    proc = spawn_worker("tracker", run_id, config_path, "--until-idle", "1.5")  # the real `rlbus worker tracker`
    rc = await asyncio.to_thread(proc.wait, 120)
    assert rc == 0, logs(tmp_path)

    tb = tb_scalars(run_path)
    assert len(list((run_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per process
    for tag, points in tb.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), f"{tag} repeats or reorders a step: {points}"
    assert tb["learner/loss"] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert tb["eval/arith"] == [(2, 0.5)]
    # every train reward counted exactly once: 2 + 1 before the restart, 1 late + 2 after it
    assert sum(n for _, n in tb["train/samples"]) == 6, tb["train/samples"]
    assert tb["train/arith/reward_mean"] == [(0, 0.5), (1, 1.0), (2, pytest.approx(2 / 3))]

    runs = wandb_runs(run_path)
    assert len(runs) == 2 and all(
        d.name.endswith(f"-{run_id}") or d.name.endswith(f"-{run_id}-1") for d, _, _ in runs
    ), runs  # the same wandb run id: one run when synced
    for tag in ("learner/loss", "train/arith/reward_mean", "train/samples", "eval/arith"):
        steps = [s for s, _ in wandb_points(run_path, tag)]
        assert steps == sorted(set(steps)), f"wandb {tag} repeats a step: {steps}"
    assert wandb_points(run_path, "learner/loss") == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert sum(n for _, n in wandb_points(run_path, "train/samples")) == 6


BLOCKER = """
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorboard", "wandb"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _Block())
"""


def test_a_missing_tracking_package_names_the_extra(tmp_path, run_id):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    config_path, _ = tracking_config(tmp_path, run_id, backends=("tensorboard",))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{ROOT}")
    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "worker",
            "tracker",
            "--config",
            str(config_path),
            "--nats-url",
            "nats://127.0.0.1:1",
            "--run-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert worker.returncode != 0
    assert "tensorboard" in worker.stderr and "pip install -e '.[tracking]'" in worker.stderr, worker.stderr
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlbus.cli",
            "up",
            str(config_path),
            "--run-dir",
            str(tmp_path / "runs"),
            "--set",
            'tracking.backends=["wandb"]',
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert up.returncode == 1 and "pip install -e '.[tracking]'" in up.stdout, up.stdout + up.stderr
    assert not (tmp_path / "runs" / run_id).exists()  # stopped before anything started


def test_up_starts_a_tracker_only_with_a_backend(tmp_path):
    assert "tracker" not in roles_to_start(load_config(None))
    assert "tracker" in roles_to_start(load_config(None, ['tracking.backends=["tensorboard"]']))


def test_a_late_reward_counts_in_the_next_window_written():
    w = Windows(samples_every=2, samples_per_table=1)
    w.add_reward(0, 1.0, "a", 1.0, 2, (1.0, 2.0), ["s0"])
    w.add_reward(1, 2.0, "a", 0.0, 2, (1.0, 2.0), ["s1"])
    points, tables = w.close_below(1)
    assert {(p.tag, p.step, p.value) for p in points} >= {("train/reward_mean", 0, 1.0), ("train/a/samples", 0, 1.0)}
    assert [(t.step, t.rows) for t in tables] == [(0, (("s0",),))]  # step 1 is not a multiple of 2: no table
    w.add_reward(0, 3.0, "a", 0.0, 2, (1.0, 2.0), ["late"])  # its window is written: carried
    restored = Windows(2, 1, json.loads(json.dumps(w.state())))  # through the state file
    points, tables = restored.close_all()
    assert [(p.step, p.value) for p in points if p.tag == "train/a/samples"] == [(1, 2.0)] and not tables


def test_each_tag_stays_strictly_increasing_and_the_timeline_maps_time_to_steps():
    from rlbus.tracking.points import Point

    steps = Steps({"learner/loss": 3})
    kept = steps.admit([Point("learner/loss", 3, 0.1, 0), Point("learner/loss", 4, 0.2, 0), Point("eval/a", 1, 1, 0)])
    assert [(p.tag, p.step) for p in kept] == [("eval/a", 1), ("learner/loss", 4)] and steps.dropped == 1
    t = Timeline([[10.0, 0], [20.0, 1]])
    t.add(30.0, 2)
    assert (t.step_at(5.0), t.step_at(10.0), t.step_at(25.0), t.step_at(99.0), t.latest) == (0, 0, 1, 2, 2)


async def test_the_tracker_user_reads_and_publishes_nothing(tmp_path):
    """As NATS user `tracker` (permissions from bus.auth), the tracker binds its durables and
    writes points, while a publish of any data subject is refused."""
    from bus.auth import random_passwords, server_auth_config
    from bus.conn import PermissionDenied, publish_checked
    from bus.server import EmbeddedNats
    from rlbus.tracking.backends import open_backends

    run_id = "trk" + os.urandom(4).hex()
    passwords = random_passwords()
    server = EmbeddedNats(tmp_path / "nats", config=server_auth_config([run_id], passwords)).start()
    try:
        admin = await connect(server.url, user="admin", password=passwords["admin"])
        ajs, reg = admin.jetstream(timeout=10), Registry(run_id)
        await ensure_topology(ajs, reg)
        await version(ajs, reg, 0, 0)
        await rewards(ajs, reg, ("arith", 1.0))
        await version(ajs, reg, 1, 1, STEP1)
        nc = await connect(server.url, user="tracker", password=passwords["tracker"])
        _, cfg = tracking_config(tmp_path, run_id, backends=("tensorboard",))
        t = tracker.Tracker(
            nc.jetstream(timeout=5), reg, cfg, tmp_path / "run", open_backends(cfg, tmp_path / "run"), {}
        )
        await t.bind()
        await tracker.track(t, asyncio.Event(), until_idle=0.5)
        t.close()
        assert tb_scalars(tmp_path / "run")["learner/loss"] == [(1, 0.5)]
        for subject in (reg.rewards("arith"), reg.weights, reg.tasks("arith"), reg.dlq("tracker")):
            with pytest.raises(PermissionDenied):
                await publish_checked(nc, subject, b"x")
        await nc.close()
        await admin.close()
    finally:
        server.stop()
