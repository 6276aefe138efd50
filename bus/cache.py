"""A per-process cache of values read from the bus, loaded once however many ask at once.

Why: a verifier fetches a batch holding all `group_size` trajectories of a task and verifies
them concurrently. A plain "look up, else load and store" cache misses for every one of
them (none has stored the value yet when the others look), so each trajectory cost its own
KV round trip. Profiled in bench/results/profiles/ (issue 31, item 5).

Guarantees:
- Concurrent `get`s of a missing key share ONE call of the loader (single flight); a key
  already loaded costs a dict lookup.
- A load that raises is not cached: every caller waiting on it gets that exception, and the
  next `get` loads again (a transient miss is retried by the caller's own policy).
- A caller cancelled while waiting does not cancel the shared load for the others.
- At most `max_entries` values are held; past that the oldest one is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LoadOnce(Generic[K, V]):
    """Values of `load(key)`, cached; concurrent misses of one key load it once."""

    def __init__(self, load: Callable[[K], Awaitable[V]], max_entries: int) -> None:
        self.load, self.max_entries = load, max(1, max_entries)
        self._data: dict[K, V] = {}
        self._loading: dict[K, asyncio.Task] = {}
        self.loads = 0
        """Loader calls so far (misses that went to the bus)."""

    def __contains__(self, key: K) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    async def get(self, key: K) -> V:
        """The value of `key`: cached, or loaded once for every caller waiting on it."""
        try:
            return self._data[key]
        except KeyError:
            pass
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._fill(key))
            task.add_done_callback(_retrieve)
            self._loading[key] = task
        return await asyncio.shield(task)

    async def _fill(self, key: K) -> V:
        self.loads += 1
        try:
            value = await self.load(key)
        finally:
            self._loading.pop(key, None)
        if len(self._data) >= self.max_entries:
            self._data.pop(next(iter(self._data)))
        self._data[key] = value
        return value


def _retrieve(task: asyncio.Task) -> None:
    """Mark a shared load's exception as seen (every waiter may have been cancelled)."""
    if not task.cancelled():
        task.exception()
