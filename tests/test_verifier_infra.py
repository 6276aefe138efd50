"""Infrastructure failures are not rewards: the verifier worker, in-process on the real
session nats-server, retries a crashing verifier, a verifier reporting an infra error
and a trajectory whose hidden data is missing with growing backoff, dead-letters each on
the consumer's last delivery with the reason, and never publishes a Reward for them,
while the good trajectories of the same batches are scored (off the event loop)."""

from __future__ import annotations

import threading

import pytest

from bus.conn import ensure_topology
from bus.publish import publish_many
from bus.pull import Reject, Retry
from bus.session import WorkerContext
from bus.streams import iter_stream
from bus.subjects import Registry
from schemas import DeadLetter, Reward, Trajectory, Turn, decode
from schemas.config import RunConfig, VerifierSection
from tests.conftest import settled_consumer
from tests.messages import store_checks
from verifier_workers import registry
from verifier_workers.errors import VerifierInfraError
from verifier_workers.verifiers.arith import verify_arith
from verifier_workers.worker import RetryPolicy, run

pytestmark = pytest.mark.usefixtures("drop_run")


def test_retry_policy_backoff_grows_then_dead_letters():
    p = RetryPolicy(max_deliver=5, base_s=1.0, max_s=6.0)
    assert [p.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 6.0, 6.0]
    exc = VerifierInfraError("sandbox pool down")
    for n in range(1, 5):
        with pytest.raises(Retry) as retry:
            p.fail(n, exc)
        assert retry.value.delay == p.delay(n) and "sandbox pool down" in retry.value.reason
    # a consumer with backoff adds (backoff[n-1] - ack_wait) to a nak delay; the policy subtracts it
    q = RetryPolicy(max_deliver=5, base_s=1.0, max_s=100.0, ack_wait_s=10.0, backoff_s=(10.0, 20.0, 40.0))
    assert [q.server_extra(n) for n in range(1, 6)] == [0.0, 10.0, 30.0, 30.0, 30.0]
    assert [q.nak_delay(n) for n in range(1, 5)] == [1.0, 0.01, 0.01, 0.01]
    assert q.nak_delay(6) == 2.0  # 32 s wanted, the server adds 30
    with pytest.raises(Reject) as reject:
        p.fail(5, exc)
    last = reject.value
    assert last.error_type == "infra_error"
    assert "VerifierInfraError: sandbox pool down" in last.reason and "5 deliveries" in last.reason


def make_traj(run_id: str, i: int, verifier: str, hidden_ref: str | None = None) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        msg_id=f"tr-{verifier}-{i}",
        task_id=f"t{i}",
        task_msg_id=f"task-{i}",
        domain="arith",
        group_id=f"g{i}",
        group_size=1,
        sample_index=0,
        turns=[Turn(role="assistant", text="5")],
        verifier=verifier,
        verifier_params={"expression": "2+3"},
        hidden_ref=hidden_ref,
        policy_version=0,
        final_text="5",
    )


@pytest.fixture
def test_verifiers():
    threads: list[str] = []

    def crash(traj, hidden=None):
        raise ZeroDivisionError("verifier bug mid-run")

    def infra(traj, hidden=None):
        raise VerifierInfraError("sandbox service unreachable")

    def good(traj, hidden=None):
        threads.append(threading.current_thread().name)
        return verify_arith(traj)

    names = {"t_crash": crash, "t_infra": infra, "t_good": good}
    for name, fn in names.items():
        registry.register(name, fn, replace=True)
    yield threads
    for name in names:
        registry.unregister(name)


@pytest.mark.e2e
async def test_infra_failures_retry_then_dead_letter_never_zero(js, run_id, tmp_path, test_verifiers):
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    good = [make_traj(run_id, i, "t_good") for i in range(3)]
    bad = {
        "t_crash": make_traj(run_id, 10, "t_crash"),
        "t_infra": make_traj(run_id, 11, "t_infra"),
        "hidden": make_traj(run_id, 12, "t_good", hidden_ref="arith.missing.000000000000"),
    }
    await store_checks(js, reg, [*good, *bad.values()])
    await publish_many(js, [(reg.traj("arith"), t) for t in [*good, *bad.values()]])

    # test-sized retry delays
    cfg = RunConfig(
        verifier=VerifierSection(ack_wait_s=1.0, batch=16, retry_base_s=0.05, retry_max_s=0.2, concurrency=2)
    )
    counters = await run(
        cfg, WorkerContext(run_id=run_id, nats_url=js._nc.connected_url.geturl(), run_path=tmp_path, until_idle=6.0)
    )

    rewards = [decode(d, Reward) async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("arith"))]
    assert sorted(r.trajectory.msg_id for r in rewards) == sorted(t.msg_id for t in good)
    assert all(r.reward == 1.0 and r.status == "ok" for r in rewards)
    assert all(name != threading.main_thread().name for name in test_verifiers), "verifiers ran on the loop thread"

    letters = [decode(d, DeadLetter) async for _, d in iter_stream(js, reg.stream("DLQ"), reg.dlq("verifier"))]
    by_traj = {decode(dl.original_data, Trajectory).msg_id: dl for dl in letters}
    assert set(by_traj) == {t.msg_id for t in bad.values()}
    max_deliver = reg.verifier_consumer().max_deliver
    for dl in by_traj.values():
        assert dl.error_type == "infra_error" and dl.delivery_count == max_deliver and dl.stage == "verifier"
        assert dl.reason.startswith("infra_error: ") and f"after {max_deliver} deliveries" in dl.reason
    assert "ZeroDivisionError: verifier bug mid-run" in by_traj[bad["t_crash"].msg_id].reason
    assert "sandbox service unreachable" in by_traj[bad["t_infra"].msg_id].reason
    assert "HiddenDataMissing" in by_traj[bad["hidden"].msg_id].reason

    assert counters["infra_errors"] == len(bad) * max_deliver and counters["retry"] == len(bad) * (max_deliver - 1)
    info = await settled_consumer(js, reg.stream("TRAJ"), "verifier")
    assert info.num_pending == 0 and info.num_ack_pending == 0


def test_inline_policy_warmup_threshold_and_fallback():
    from verifier_workers.worker import InlinePolicy

    p = InlinePolicy(below_s=0.001, warmup=3, alpha=0.5)
    assert not p.inline("v")
    for _ in range(2):
        p.observe("v", 0.0001)
    assert not p.inline("v"), "inline before warmup calls were measured"
    p.observe("v", 0.0001)
    assert p.inline("v")
    p.observe("v", 0.01)  # one slow call: mean 0.00505 > 0.001 -> back to threads
    assert not p.inline("v") and p.mean["v"] == pytest.approx(0.00505)
    assert not p.inline("other")


async def test_cheap_verifier_goes_inline_slow_one_stays_in_threads(js, run_id, tmp_path):
    import time

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    seen: dict[str, list[str]] = {"t_fast": [], "t_slow": []}

    def fast(traj, hidden=None):
        seen["t_fast"].append(threading.current_thread().name)
        return verify_arith(traj)

    def slow(traj, hidden=None):
        seen["t_slow"].append(threading.current_thread().name)
        time.sleep(0.002)  # 2 ms: above INLINE_BELOW_S
        return verify_arith(traj)

    registry.register("t_fast", fast, replace=True)
    registry.register("t_slow", slow, replace=True)
    try:
        trajs = [make_traj(run_id, i, "t_fast") for i in range(120)] + [
            make_traj(run_id, 200 + i, "t_slow") for i in range(60)
        ]
        await store_checks(js, reg, trajs)
        await publish_many(js, [(reg.traj("arith"), t) for t in trajs])
        cfg = RunConfig(verifier=VerifierSection(batch=8, concurrency=2))
        counters = await run(
            cfg, WorkerContext(run_id=run_id, nats_url=js._nc.connected_url.geturl(), run_path=tmp_path, until_idle=2.0)
        )
    finally:
        registry.unregister("t_fast")
        registry.unregister("t_slow")
    rewards = [decode(d, Reward) async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("arith"))]
    assert len(rewards) == 180 and all(r.reward == 1.0 for r in rewards)
    main = threading.main_thread().name
    fast_inline = sum(name == main for name in seen["t_fast"])
    assert seen["t_fast"][:32].count(main) == 0, "inline before the warm-up was measured"
    assert fast_inline >= 60, f"a microsecond verifier stayed in threads ({fast_inline} of 120 inline)"
    assert main not in seen["t_slow"], "a 2 ms verifier ran on the loop thread"
    assert counters["verified_inline"] == fast_inline


async def test_unusable_input_is_dead_lettered_at_once_never_retried(js, run_id, tmp_path, test_verifiers):
    """The handler raises Reject for an unknown verifier: one delivery, error_type `rejected`, no Reward."""
    reg = Registry(run_id)
    await ensure_topology(js, reg)
    good, unknown = make_traj(run_id, 0, "t_good"), make_traj(run_id, 1, "no_such_verifier")
    await store_checks(js, reg, (good, unknown))
    await publish_many(js, [(reg.traj("arith"), t) for t in (good, unknown)])
    cfg = RunConfig(verifier=VerifierSection(ack_wait_s=1.0, batch=4, concurrency=1))
    counters = await run(
        cfg, WorkerContext(run_id=run_id, nats_url=js._nc.connected_url.geturl(), run_path=tmp_path, until_idle=1.5)
    )
    rewards = [decode(d, Reward) async for _, d in iter_stream(js, reg.stream("REWARDS"), reg.rewards("arith"))]
    assert [r.trajectory.msg_id for r in rewards] == [good.msg_id]
    letters = [decode(d, DeadLetter) async for _, d in iter_stream(js, reg.stream("DLQ"), reg.dlq("verifier"))]
    assert [decode(dl.original_data, Trajectory).msg_id for dl in letters] == [unknown.msg_id]
    assert letters[0].error_type == "rejected" and letters[0].delivery_count == 1
    assert letters[0].reason.startswith("verifier input: ") and "no_such_verifier" in letters[0].reason
    assert counters.get("infra_errors", 0) == 0 and counters.get("retry", 0) == 0 and counters["reject"] == 1
