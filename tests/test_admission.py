"""Priority at admission (`rollout_workers.admission`): eval tasks ahead of training tasks, and
training never starved below `rollout.priority.min_share`, in the plan alone and through real
JetStream consumers."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from bus.conn import ensure_topology, pull_subscription
from bus.publish import publish_many
from bus.subjects import PRIORITY_CLASSES, Registry
from rollout_workers.admission import Admission, PrioritySubscription
from schemas import ChatMessage, Task
from schemas.config import load_config


def _fill(adm: Admission, batch: int, work: dict[str, int | float]) -> dict[str, int]:
    """One batch admitted by the plan from classes holding `work` tasks each (inf: never empty)."""
    counts = {c: 0 for c in adm.classes}
    room = batch
    for cls, most in adm.plan(batch):
        n = int(min(most, room, work[cls]))
        counts[cls] += n
        work[cls] -= n
        room -= n
    adm.took(counts)
    return counts


def test_eval_goes_first_and_strict_priority_starves_nothing_else():
    adm = Admission(PRIORITY_CLASSES, 0.0)
    assert PRIORITY_CLASSES == ("eval", "train") and adm.plan(8) == [("eval", 8), ("train", 8)]
    work = {"eval": 20, "train": float("inf")}
    got = [_fill(adm, 8, work) for _ in range(4)]
    assert [g["eval"] for g in got] == [8, 8, 4, 0] and [g["train"] for g in got] == [0, 0, 4, 8]


@pytest.mark.parametrize("min_share", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_min_share_bounds_starvation_at_every_point(min_share, batch):
    """Both classes always have work: after every batch the training share of all admissions so
    far is at least min_share, less one slot and one batch's share (the deficit's bound)."""
    adm = Admission(PRIORITY_CLASSES, min_share)
    work = {"eval": float("inf"), "train": float("inf")}
    total = train = 0
    for _ in range(400):
        counts = _fill(adm, batch, work)
        total, train = total + batch, train + counts["train"]
        assert sum(counts.values()) == batch
        assert train >= min_share * total - (1 + min_share * batch) - 1e-6, (total, train)
    assert train / total == pytest.approx(min_share, abs=1.5 / batch / 40 + 0.01)
    assert adm.admitted == {"eval": total - train, "train": train}


def test_an_idle_class_carries_a_bounded_debt_not_a_burst():
    adm = Admission(PRIORITY_CLASSES, 0.25)
    work = {"eval": float("inf"), "train": 0}
    for _ in range(100):
        _fill(adm, 8, work)
    assert adm.credit["train"] <= 1 + 0.25 * 8
    work["train"] = float("inf")
    assert _fill(adm, 8, work)["train"] <= 3  # owed: at most one batch's share plus one slot
    assert _fill(adm, 8, work)["train"] == 2  # then its share, 2 of 8


def test_bad_min_share_is_refused_with_the_setting_named():
    with pytest.raises(ValueError, match="rollout.priority.min_share"):
        Admission(PRIORITY_CLASSES, 0.6)
    with pytest.raises(ValueError, match="min_share"):
        load_config(None, ["rollout.priority.min_share=0.7"])
    assert load_config(None, []).rollout.priority.enabled  # the default: on


def test_priority_subjects_and_consumers_never_overlap():
    reg = Registry("r1")
    assert reg.tasks("arith") == "tasks.r1.arith" and reg.tasks("arith", "long") == "tasks.r1.arith.long"
    assert reg.tasks("arith", priority="eval") == "tasks.r1.arith.short.eval"
    assert reg.tasks("arith", "long", "eval") == "tasks.r1.arith.long.eval"
    specs = [reg.rollout_consumer(pool=p, priority=c) for p in ("short", "long") for c in PRIORITY_CLASSES]
    assert [s.durable for s in specs] == ["rollout-short-eval", "rollout", "rollout-long-eval", "rollout-long"]
    assert len({s.filter_subject for s in specs}) == 4
    with pytest.raises(ValueError, match="priority class"):
        reg.tasks("arith", priority="urgent")


def _task(run_id: str, i: int, purpose: str) -> Task:
    return Task(
        run_id=run_id,
        msg_id=f"{purpose}-{i}",
        task_id=f"{purpose}-{i}",
        domain="arith",
        purpose=purpose,
        group_size=1,
        prompt=[ChatMessage(role="user", content="1+1")],
        verifier="exact",
    )


@pytest.mark.usefixtures("drop_run")
async def test_consumers_per_class_admit_eval_first_and_keep_the_floor(js, run_id):
    """Real consumers: training tasks published before eval ones still wait behind them, except
    for the training floor; everything published is fetched exactly once."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    await publish_many(js, [(reg.tasks("arith"), _task(run_id, i, "train")) for i in range(6)])
    await publish_many(js, [(reg.tasks("arith", priority="eval"), _task(run_id, i, "eval")) for i in range(6)])
    subs = {c: await pull_subscription(js, reg.rollout_consumer(5, priority=c)) for c in PRIORITY_CLASSES}
    counters: dict[str, float] = {}
    sub = PrioritySubscription(subs, Admission(PRIORITY_CLASSES, 0.25), counters=counters)
    batches = []
    for _ in range(3):
        msgs = await sub.fetch(4, timeout=1.0)
        batches.append([m.headers["Nats-Msg-Id"].split("-")[0] for m in msgs])
        for m in msgs:
            await m.ack()
    # first batch: all eval; then one training slot is owed per batch of 4 (min_share 0.25)
    assert batches[0] == ["eval"] * 4 and batches[1] == ["eval", "eval", "train", "train"], batches
    assert sum(b.count("train") for b in batches) == 6 and sum(b.count("eval") for b in batches) == 6
    assert counters == {"admitted_eval": 6, "admitted_train": 6}
    with pytest.raises(nats.errors.TimeoutError):  # all taken: an idle fetch, as from one consumer
        await sub.fetch(4, timeout=0.2)


@pytest.mark.usefixtures("drop_run")
async def test_a_task_nakd_at_once_is_served_before_newer_ones_of_its_class(js, run_id):
    """Why no finisher class: a group is one task, and a late one nak-ed at once comes back ahead of
    the newer tasks of its consumer. (One nak-ed with a delay, as `Retry(delay)` does, too once due on
    its first delivery; later ones wait for the consumer's backoff: see docs/architecture.md.)"""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    await publish_many(js, [(reg.tasks("arith"), _task(run_id, i, "train")) for i in range(30)])
    sub = await pull_subscription(js, reg.rollout_consumer(2))
    (first,) = await sub.fetch(1, timeout=1.0)
    assert first.headers["Nats-Msg-Id"] == "train-0"
    await first.nak()
    await asyncio.sleep(0.3)  # the server applies a nak asynchronously
    (again,) = await sub.fetch(1, timeout=1.0)
    assert again.headers["Nats-Msg-Id"] == "train-0" and again.metadata.num_delivered == 2


@pytest.mark.usefixtures("drop_run")
async def test_priority_off_is_one_consumer_first_come_first_served(js, run_id):
    from types import SimpleNamespace

    from rollout_workers.worker import pool_subscription

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    off = SimpleNamespace(enabled=False, min_share=0.25)
    sub = await pool_subscription(js, reg, "short", 5, off, {})
    assert not isinstance(sub, PrioritySubscription) and (await sub.consumer_info()).name == "rollout"
    on = await pool_subscription(js, reg, "short", 5, SimpleNamespace(enabled=True, min_share=0.25), {})
    assert isinstance(on, PrioritySubscription) and set(on.subs) == set(PRIORITY_CLASSES)
