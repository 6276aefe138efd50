"""bus.cache.LoadOnce: one load per key however many ask at once; failures not cached."""

from __future__ import annotations

import asyncio

import pytest

from bus.cache import LoadOnce


def test_concurrent_misses_share_one_load():
    calls: list[str] = []

    async def load(key: str) -> str:
        calls.append(key)
        await asyncio.sleep(0.01)
        return key.upper()

    async def main():
        cache = LoadOnce(load, max_entries=10)
        got = await asyncio.gather(*(cache.get("a") for _ in range(8)), cache.get("b"))
        assert got == ["A"] * 8 + ["B"]
        assert await cache.get("a") == "A"  # a hit: no new load
        return cache

    cache = asyncio.run(main())
    assert sorted(calls) == ["a", "b"] and cache.loads == 2


def test_failed_load_reaches_every_waiter_and_is_not_cached():
    attempts = 0

    async def load(key: str) -> int:
        nonlocal attempts
        attempts += 1
        await asyncio.sleep(0.01)
        if attempts == 1:
            raise LookupError(f"{key} missing")
        return 7

    async def main():
        cache = LoadOnce(load, max_entries=10)
        got = await asyncio.gather(cache.get("k"), cache.get("k"), return_exceptions=True)
        assert [type(g) for g in got] == [LookupError, LookupError]
        assert "k" not in cache
        assert await cache.get("k") == 7  # loaded again

    asyncio.run(main())
    assert attempts == 2


def test_cancelled_waiter_does_not_cancel_the_shared_load():
    async def load(key: str) -> str:
        await asyncio.sleep(0.05)
        return key

    async def main():
        cache = LoadOnce(load, max_entries=10)
        first = asyncio.create_task(cache.get("x"))
        second = asyncio.create_task(cache.get("x"))
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second == "x"
        with pytest.raises(asyncio.CancelledError):
            await first
        assert cache.loads == 1

    asyncio.run(main())


def test_oldest_entry_dropped_past_max_entries():
    async def load(key: int) -> int:
        return key * 2

    async def main():
        cache = LoadOnce(load, max_entries=2)
        for k in (1, 2, 3):
            await cache.get(k)
        assert 1 not in cache and 2 in cache and 3 in cache and len(cache) == 2

    asyncio.run(main())


async def test_checks_pipelined_put_then_one_read_per_task(js, run_id):
    """put_checks stores every new check (pipelined) and skips unchanged ones; the verifier's
    CheckCache reads a task's check once for all its concurrent trajectories."""
    from bus.checks import CheckCache, TaskCheck, check_key, put_checks
    from bus.conn import ensure_topology
    from bus.hidden import HiddenDataMissing
    from bus.subjects import Registry
    from tests.messages import make_task

    reg = Registry(run_id)
    await ensure_topology(js, reg)
    tasks = [make_task(run_id, task_id=f"t{i}") for i in range(20)]
    written: dict[str, bytes] = {}
    assert await put_checks(js, reg, tasks, written) == 20
    assert await put_checks(js, reg, tasks, written) == 0  # unchanged: nothing rewritten
    kv = await js.key_value(reg.hidden_bucket)
    for t in tasks:
        stored = TaskCheck.unpack((await kv.get(check_key(t.domain, t.task_id))).value)
        assert stored == TaskCheck.of(t)

    cache = CheckCache(js, reg)
    got = await asyncio.gather(*(cache.get(t.domain, t.task_id) for t in tasks for _ in range(8)))
    assert got == [TaskCheck.of(t) for t in tasks for _ in range(8)]
    assert cache._checks.loads == 20  # one bucket read per task, not per trajectory
    with pytest.raises(HiddenDataMissing, match="no check for task 'never'"):
        await cache.get(tasks[0].domain, "never")
