"""Priority at admission: which class of tasks a rollout worker's pool loop takes next.

nats-py has no API for JetStream priority groups, so each duration pool is pulled through one
durable consumer per priority class (`bus.subjects.PRIORITY_CLASSES`, highest first: `eval`,
then `train`). `PrioritySubscription` stands in for a single pull subscription in
`bus.pull.run_pull_loop` (it has the same `fetch(batch, timeout=)`), and fills each batch by
the plan of an `Admission`.

Guarantees:
- Order: a batch is filled from the highest class that has work first, then the next, and so
  on (`eval` tasks go ahead of `train` tasks), except for the slots reserved below.
- No starvation: every class below the highest is owed `min_share` of each batch's admitted
  slots (a deficit counter, `Admission.credit`); whole owed slots are reserved for it, lowest
  class first, before the higher classes are fetched. So while a lower class always has work, its
  share of admissions is at least `min_share` minus one slot over any run of admissions
  (`tests/test_admission.py`). A class that had no work carries a bounded debt (at most one
  batch's share plus one slot), never an unbounded burst. `min_share = 0` is strict priority.
- Nothing is lost: every message fetched from any class is returned in the batch (highest class
  first) and acked, nak-ed or dead-lettered by the pull loop like any other.
- Cheap when a class is idle: a class is probed only when its consumer reports pending messages
  (checked at most every `check_s`), or holds delivered-but-unacked ones (a nak-ed retry comes due
  among them: probed at most every `retry_probe_s`). When nothing was taken, one fetch on the
  lowest class waits for work, for at most `block_s`, so a higher-class task published meanwhile
  waits at most about that long.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

import nats.errors
from nats.aio.msg import Msg


class Admission:
    """The plan of each batch: how many slots each class may fill, in fetch order."""

    def __init__(self, classes: Sequence[str], min_share: float) -> None:
        if not classes:
            raise ValueError("admission needs at least one priority class")
        if not 0.0 <= min_share <= 0.5:
            raise ValueError(f"rollout.priority.min_share = {min_share}: must be within [0, 0.5]")
        self.classes = tuple(classes)
        self.min_share = min_share
        self.credit = {c: 0.0 for c in self.classes[1:]}  # slots owed to each lower class
        self.admitted = {c: 0 for c in self.classes}

    def plan(self, room: int) -> list[tuple[str, int]]:
        """[(class, most slots)] in fetch order: the owed slots of the lower classes (lowest
        first), then every class highest first for what room is left."""
        out: list[tuple[str, int]] = []
        left = room
        for c in reversed(self.classes[1:]):
            owed = min(left, math.floor(self.credit[c] + 1e-9))  # 1e-9: ten owed tenths are one slot
            if owed > 0:
                out.append((c, owed))
                left -= owed
        return out + [(c, room) for c in self.classes]

    def took(self, counts: dict[str, int]) -> None:
        """Record one batch's admissions per class: each lower class is owed `min_share` of
        them, less what it got (the debt bounded by one batch's share plus one slot)."""
        total = sum(counts.values())
        for c in self.classes:
            self.admitted[c] += counts.get(c, 0)
        if not total:
            return
        for c in self.credit:
            owed = self.credit[c] + self.min_share * total - counts.get(c, 0)
            self.credit[c] = min(max(0.0, owed), 1.0 + self.min_share * total)


async def _fetch(sub: Any, want: int, timeout: float) -> list[Msg]:
    try:
        return await sub.fetch(want, timeout=timeout)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []


class PrioritySubscription:
    """One pool's consumers, one per class, fetched as one subscription by `Admission`'s plan."""

    def __init__(
        self,
        subs: dict[str, Any],
        admission: Admission,
        *,
        probe_s: float = 0.2,
        check_s: float = 0.25,
        retry_probe_s: float = 1.0,
        block_s: float = 0.5,
        counters: dict[str, float] | None = None,
    ) -> None:
        if set(subs) != set(admission.classes):
            raise ValueError(f"subscriptions {sorted(subs)} do not match classes {admission.classes}")
        self.subs, self.admission = subs, admission
        self.probe_s, self.check_s, self.retry_probe_s, self.block_s = probe_s, check_s, retry_probe_s, block_s
        self.counters = counters if counters is not None else {}
        self._checked: dict[str, tuple[float, bool]] = {}  # class -> (when, may have work)
        self._probed: dict[str, float] = {}  # class -> last probe while only unacked ones were held

    async def _may_have_work(self, cls: str, waits: bool) -> bool:
        """Whether fetching `cls` may return something (always, when the fetch would wait for work)."""
        if waits:
            return True
        now = time.monotonic()
        when, answer = self._checked.get(cls, (-math.inf, True))
        if now - when < self.check_s:
            return answer
        info = await self.subs[cls].consumer_info()
        answer = info.num_pending > 0
        if not answer and info.num_ack_pending > 0 and now - self._probed.get(cls, -math.inf) >= self.retry_probe_s:
            self._probed[cls], answer = now, True  # a nak-ed retry may have come due
        self._checked[cls] = (now, answer)
        return answer

    async def fetch(self, batch: int, timeout: float = 1.0) -> list[Msg]:
        """Up to `batch` messages by the admission plan (highest class first); raises
        nats.errors.TimeoutError when no class had any within the wait."""
        got: dict[str, list[Msg]] = {c: [] for c in self.admission.classes}
        room, plan = batch, self.admission.plan(batch)
        for i, (cls, most) in enumerate(plan):
            want = min(most, room)
            # the last step is the lowest class: with nothing taken yet it waits for work (bounded, so
            # a higher class's task published meanwhile is seen soon); every other step only probes,
            # and only a class whose consumer may hold work (an empty probe would cost `probe_s`)
            waits = i == len(plan) - 1 and room == batch
            if want <= 0 or not await self._may_have_work(cls, waits):
                continue
            wait = min(timeout, self.block_s) if waits else self.probe_s
            msgs = await _fetch(self.subs[cls], want, wait)
            got[cls] += msgs
            room -= len(msgs)
            if msgs:
                self._checked.pop(cls, None)  # it had work: ask again next time
        counts = {c: len(m) for c, m in got.items()}
        self.admission.took(counts)
        for c, n in counts.items():
            if n:
                self.counters[f"admitted_{c}"] = self.counters.get(f"admitted_{c}", 0) + n
        out = [m for c in self.admission.classes for m in got[c]]
        if not out:
            raise nats.errors.TimeoutError
        return out
