"""The run store (SQLite and PostgreSQL) and the recorder against the real NATS server.

Every store test runs on SQLite in tmp_path and on the PostgreSQL at 127.0.0.1:5432
(database `test`, trust auth) in a fresh schema that is dropped afterwards; the
PostgreSQL cases are skipped with the reason when that server is not reachable.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from bus.conn import ensure_topology
from bus.publish import publish, publish_many
from bus.subjects import Registry
from scheduler.domain_stats import domain_stats
from scheduler.recorder import FEEDS, record
from scheduler.store import open_store, resolve_url
from scheduler.store_rows import (
    CostRow,
    CurriculumUpdateRow,
    DeadLetterRow,
    DomainStatRow,
    EvalResultRow,
    RewardRow,
    RunRow,
    WeightVersionRow,
)
from schemas import DeadLetter, EvalResult, Reward, Trajectory, Turn, WeightVersion
from tests.conftest import settled_consumer

pytestmark = pytest.mark.usefixtures("drop_run")  # delete the run's streams afterwards

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def _pg_unreachable_reason() -> str | None:
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    try:
        psycopg.connect(PG_URL, connect_timeout=2).close()
    except (psycopg.Error, OSError) as exc:
        return f"PostgreSQL at {PG_URL} is not reachable: {str(exc).splitlines()[0]}"
    return None


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """An open store on SQLite (tmp_path/run.db) or in a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        s = open_store(None, tmp_path)
        yield s
        s.close()
        return
    reason = _pg_unreachable_reason()
    if reason:
        pytest.skip(reason)
    import psycopg

    schema = f"rlbus_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    s = open_store(f"{PG_URL}?options=-csearch_path%3D{schema}", tmp_path)
    try:
        yield s
    finally:
        s.close()
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def reward(
    run_id: str,
    domain: str = "arith",
    value: float = 1.0,
    created_at: float | None = None,
    purpose: str = "train",
    i: int = 0,
) -> Reward:
    traj = Trajectory(
        run_id=run_id,
        task_id=f"t{i}",
        task_msg_id=f"task-{i}",
        domain=domain,
        difficulty=2,
        purpose=purpose,
        group_id=f"g{i}",
        group_size=2,
        sample_index=0,
        turns=[Turn(role="assistant", text="4", trainable=True, policy_version=3)],
        verifier="exact",
        policy_version=3,
    )
    kw = {} if created_at is None else {"created_at": created_at}
    return Reward(run_id=run_id, trajectory=traj, reward=value, **kw)


def weights(run_id: str, version: int) -> WeightVersion:
    return WeightVersion(
        run_id=run_id,
        version=version,
        step=version * 2,
        uri=f"nats-object://b/v{version}",
        sha256="ab" * 32,
        bytes=1234,
        metrics={"loss": 0.5},
    )


def evaluation(run_id: str, version: int, domain: str = "arith") -> EvalResult:
    return EvalResult(
        run_id=run_id, version=version, step=version * 2, domain=domain, score=0.25, n=64, eval_set_sha256="cd" * 32
    )


def letter(run_id: str, i: int = 0) -> DeadLetter:
    return DeadLetter(
        run_id=run_id,
        stage="verifier",
        reason="boom",
        error_type="rejected",
        original_subject=f"traj.{run_id}.arith",
        original_data=b"\x01",
        original_msg_id=f"o{i}",
        delivery_count=5,
        task_msg_id=f"task-{i}",
    )


def test_every_table_round_trips(store, run_id):
    assert store.ensure_run(run_id, {"learner": {"lr": 1e-5}})
    assert not store.ensure_run(run_id, {"other": 1})
    store.set_run_status(run_id, "finished")
    (run,) = store.rows(RunRow, run_id)
    assert run.config == {"learner": {"lr": 1e-5}} and run.status == "finished"

    r = reward(run_id, value=0.75)
    assert store.record_rewards([r]) == 1
    (rr,) = store.rows(RewardRow, run_id)
    assert (rr.msg_id, rr.domain, rr.difficulty, rr.reward, rr.status, rr.policy_version, rr.purpose) == (
        r.msg_id,
        "arith",
        2,
        0.75,
        "ok",
        3,
        "train",
    )
    assert rr.created_at == pytest.approx(r.created_at)

    w = weights(run_id, 1)
    store.record_weights([w])
    (wr,) = store.rows(WeightVersionRow, run_id)
    assert (wr.version, wr.step, wr.sha256, wr.bytes, wr.uri, wr.metrics) == (
        1,
        2,
        w.sha256,
        1234,
        w.uri,
        {"loss": 0.5},
    )

    e0 = evaluation(run_id, 0)
    store.record_evals([e0])  # no cost yet: cost columns are NULL
    store.set_cost(run_id, "rollout", cpu_seconds=10.0, tokens=100)
    store.set_cost(run_id, "learner", cpu_seconds=5.0, gpu_seconds=2.0, tokens=0)
    store.set_cost(run_id, "rollout", cpu_seconds=12.0, tokens=150)  # totals replace
    e1 = evaluation(run_id, 1)
    store.record_evals([e1])
    er0, er1 = store.rows(EvalResultRow, run_id, order_by="version")
    assert (er0.score, er0.n, er0.eval_set_sha256, er0.cost_cpu_seconds, er0.cost_tokens) == (
        0.25,
        64,
        e0.eval_set_sha256,
        None,
        None,
    )
    assert (er1.cost_cpu_seconds, er1.cost_gpu_seconds, er1.cost_tokens) == (17.0, 2.0, 150)
    costs = {c.stage: (c.cpu_seconds, c.gpu_seconds, c.tokens) for c in store.rows(CostRow, run_id)}
    assert costs == {"rollout": (12.0, 0.0, 150), "learner": (5.0, 2.0, 0)}

    d = letter(run_id)
    store.record_dead_letters([d])
    (dr,) = store.rows(DeadLetterRow, run_id)
    assert (
        dr.msg_id,
        dr.stage,
        dr.reason,
        dr.error_type,
        dr.original_subject,
        dr.delivery_count,
        dr.task_msg_id,
        dr.original_msg_id,
    ) == (d.msg_id, "verifier", "boom", "rejected", d.original_subject, 5, "task-0", "o0")

    assert store.record_curriculum_update(run_id, "cu-1", {"arith": 0.7, "code": 0.3}, {"arith": 2}, "gap")
    (cu,) = store.rows(CurriculumUpdateRow, run_id)
    assert (cu.weights, cu.levels, cu.reason) == ({"arith": 0.7, "code": 0.3}, {"arith": 2}, "gap")

    stats = domain_stats(store, run_id, 60.0)
    assert [(s.domain, s.n, s.reward_mean) for s in stats] == [("arith", 1, 0.75)]
    assert store.count(DomainStatRow, run_id) == 1


def test_same_msg_id_twice_gives_one_row(store, run_id):
    r, w, e, d = reward(run_id), weights(run_id, 1), evaluation(run_id, 1), letter(run_id)
    assert store.record_rewards([r, r]) == 1  # a duplicate inside one batch
    assert store.record_rewards([r]) == 0
    assert store.record_rewards([r.model_copy(update={"reward": 0.0})]) == 0  # first write wins
    store.record_weights([w]), store.record_weights([w])
    store.record_evals([e]), store.record_evals([e])
    store.record_dead_letters([d, d])
    assert store.record_curriculum_update(run_id, "cu-1", {"a": 1.0}, {})
    assert not store.record_curriculum_update(run_id, "cu-1", {"a": 0.0}, {})
    for model in (RewardRow, WeightVersionRow, EvalResultRow, DeadLetterRow, CurriculumUpdateRow):
        assert store.count(model, run_id) == 1, model.__name__
    assert store.rows(RewardRow, run_id)[0].reward == 1.0


def test_domain_stats_per_window(store, run_id):
    t0 = 1_700_000_000.0  # a multiple of 10
    rs = [
        reward(run_id, "arith", 1.0, t0 + 1),
        reward(run_id, "arith", 0.0, t0 + 2),
        reward(run_id, "arith", 1.0, t0 + 11),
        reward(run_id, "code", 0.2, t0 + 3),
        reward(run_id, "code", 1.0, t0 + 4, purpose="eval"),  # eval rewards are not training stats
        reward(run_id + "x", "code", 1.0, t0 + 4),
    ]  # another run
    store.record_rewards(rs)
    got = [(s.window_start, s.domain, s.n, s.reward_mean, s.success_rate) for s in domain_stats(store, run_id, 10.0)]
    assert got == [
        (t0, "arith", 2, 0.5, 0.5),
        (t0, "code", 1, pytest.approx(0.2), 0.0),
        (t0 + 10, "arith", 1, 1.0, 1.0),
    ]
    domain_stats(store, run_id, 10.0)  # recomputing upserts, never duplicates
    assert store.count(DomainStatRow, run_id) == 3
    store.delete_run(run_id + "x")


def test_open_store_default_path_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("RLBUS_DB_URL", raising=False)
    s = open_store(None, tmp_path / "run")
    s.ensure_run("r1")
    s.close()
    assert (tmp_path / "run" / "run.db").exists()
    monkeypatch.setenv("RLBUS_DB_URL", f"sqlite:///{tmp_path / 'other.db'}")
    s = open_store(None, tmp_path / "run")
    assert s.count(RunRow) == 0
    s.close()
    assert (tmp_path / "other.db").exists()
    assert resolve_url("postgresql://u@h/db", tmp_path).startswith("postgresql+psycopg://")
    assert resolve_url("sqlite:///x.db", tmp_path) == "sqlite:///x.db"


async def _record_once(js, reg, store) -> dict[str, float]:
    return await asyncio.wait_for(record(js, reg, store, stop=asyncio.Event(), until_idle=0.6, fetch_timeout=0.3), 20)


async def test_recorder_copies_streams_once(js, run_id, store):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    rewards = [reward(run_id, "arith" if i % 2 else "code", float(i % 3 == 0), i=i) for i in range(30)]
    items = [(reg.rewards(r.trajectory.domain), r) for r in rewards]
    items += [(reg.weights, weights(run_id, v)) for v in range(3)]
    items += [(reg.eval("arith"), evaluation(run_id, v)) for v in range(2)]
    items += [(reg.dlq("verifier"), letter(run_id, i)) for i in range(2)]
    await publish_many(js, items)
    await publish(js, reg.rewards("arith"), rewards[0])  # a duplicate publish: deduplicated by the stream
    await js.publish(reg.rewards("arith"), b"\xc1not msgpack")  # undecodable: acked and counted
    await publish(js, reg.rewards("arith"), reward("someone-else", i=99))  # another run's: acked, not recorded

    first = await _record_once(js, reg, store)
    assert (first["rewards"], first["weights"], first["eval"], first["dlq"]) == (30, 3, 2, 2)
    assert first["undecodable"] == 1 and first["foreign"] == 1
    counts = {m.__name__: store.count(m, run_id) for m in (RewardRow, WeightVersionRow, EvalResultRow, DeadLetterRow)}
    assert counts == {"RewardRow": 30, "WeightVersionRow": 3, "EvalResultRow": 2, "DeadLetterRow": 2}
    assert store.count(RunRow, run_id) == 1
    assert {r.msg_id for r in store.rows(RewardRow, run_id)} == {r.msg_id for r in rewards}
    for feed in FEEDS:  # every message acked after the commit: nothing pending
        info = await settled_consumer(js, reg.stream(feed.family), feed.durable)
        assert info.num_pending == 0 and info.num_ack_pending == 0, feed.durable

    # a redelivery of everything: recreate the durables, so the whole streams replay
    for feed in FEEDS:
        await js.delete_consumer(reg.stream(feed.family), feed.durable)
    second = await _record_once(js, reg, store)
    assert second["rewards_seen"] == 30 and second["weights_seen"] == 3
    assert (second["rewards"], second["weights"], second["eval"], second["dlq"]) == (0, 0, 0, 0)
    assert {
        m.__name__: store.count(m, run_id) for m in (RewardRow, WeightVersionRow, EvalResultRow, DeadLetterRow)
    } == counts
