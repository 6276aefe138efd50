"""Pooling rewards into groups (pure logic, no I/O).

Guarantees:
- A sample is identified by (group_id, sample_index); a second reward for the same
  sample (a redelivery or a re-verification) is reported as a duplicate, never pooled
  twice.
- `pop_ready(now)` returns complete groups first, then groups past their deadline
  with >= 2 samples; groups past their deadline with < 2 samples come back as
  `expired` so the caller can record them as filtered with a reason.
- Samples older than `max_staleness` versions (relative to `current_version`) are
  filtered per sample with reason `stale`.
- `partition` decides a step window without side effects: every popped task gets exactly
  one fate (trained, or filtered with its reason) and every popped sample's message is in
  the ack set exactly once; the groups passed in are left unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from schemas import Reward, TaskFate

EXPIRED_REASON = "partial group with < 2 samples after deadline"
STALE_REASON = "stale"  # fewer than 2 samples left once stale ones are dropped
ZERO_VARIANCE_REASON = "zero reward variance"


@dataclass
class PooledSample:
    """One reward waiting for its group, with its raw bus message for the ack."""

    reward: Any  # schemas.Reward
    raw: Any  # nats Msg (acked after the step)

    @property
    def key(self) -> tuple[str, int]:
        """(group_id, sample_index)."""
        t = self.reward.trajectory
        return t.group_id, t.sample_index


@dataclass
class Group:
    """Samples of one task."""

    group_id: str
    task_msg_id: str
    size: int
    first_seen: float
    samples: dict[int, PooledSample] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """All expected samples arrived."""
        return len(self.samples) >= self.size

    @property
    def informative(self) -> bool:
        """Its rewards differ (a group whose rewards are all equal has zero advantages)."""
        return len({s.reward.reward for s in self.samples.values()}) > 1


class GroupPool:
    """Rewards waiting to be trained, grouped by task."""

    def __init__(self, deadline_s: float):
        self.deadline_s = deadline_s
        self.groups: dict[str, Group] = {}

    def add(self, sample: PooledSample, now: float) -> bool:
        """Pool a sample; False if that (group, index) is already pooled (a duplicate)."""
        t = sample.reward.trajectory
        group = self.groups.get(t.group_id)
        if group is None:
            group = self.groups[t.group_id] = Group(t.group_id, t.task_msg_id, t.group_size, now)
        if t.sample_index in group.samples:
            return False
        group.samples[t.sample_index] = sample
        return True

    def _ready(self, now: float) -> list[Group]:
        """Complete groups, then late ones with at least 2 samples."""
        complete = [g for g in self.groups.values() if g.complete]
        return complete + [
            g
            for g in self.groups.values()
            if not g.complete and now - g.first_seen >= self.deadline_s and len(g.samples) >= 2
        ]

    def pop_ready(self, now: float, limit: int, informative_only: bool = False) -> tuple[list[Group], list[Group]]:
        """(ready groups, at most `limit`; expired groups with < 2 samples).

        With `informative_only` the limit counts only groups whose rewards differ, and
        every ready group whose rewards are all equal is returned too (to be filtered):
        DAPO's dynamic sampling fills a batch with `limit` informative groups."""
        late = [g for g in self.groups.values() if not g.complete and now - g.first_seen >= self.deadline_s]
        ready = self._ready(now)
        if informative_only:
            ready = [g for g in ready if g.informative][:limit] + [g for g in ready if not g.informative]
        else:
            ready = ready[:limit]
        expired = [g for g in late if len(g.samples) < 2]
        for g in ready + expired:
            del self.groups[g.group_id]
        return ready, expired

    def count_ready(self, now: float, informative_only: bool = False) -> int:
        """Groups that `pop_ready` would return (only those whose rewards differ, with
        `informative_only`)."""
        return sum(1 for g in self._ready(now) if not informative_only or g.informative)

    def pending(self) -> list[Group]:
        """Groups still waiting (for accounting at stop)."""
        return list(self.groups.values())


def split_stale(group: Group, current_version: int, max_staleness: int) -> list[PooledSample]:
    """Remove and return the group's samples older than `max_staleness` versions, counted from
    the oldest version that made any of a sample's tokens (`Trajectory.oldest_version`: an
    episode that took new weights mid-turn or between turns is as old as its oldest token)."""
    stale = [
        i for i, s in group.samples.items() if current_version - s.reward.trajectory.oldest_version > max_staleness
    ]
    return [group.samples.pop(i) for i in stale]


@dataclass(frozen=True)
class Partition:
    """What one step window does with the groups it popped (see `partition`)."""

    train: list[Group]
    """Groups to train, stale samples removed (copies; the popped groups are untouched)."""
    fates: list[TaskFate]
    """One per popped task: `filtered` with its reason, or `trained` with its reward msg_ids
    (recorded only after the step that trains them)."""
    to_ack: list[Any]
    """Raw bus messages of every popped sample, acked after the step (filtered ones included)."""
    skipped: list[Reward]
    """Rewards of the all-equal groups dropped by `skip_zero_variance` (for `skipped_keep_scale`)."""
    stale_samples: int
    """Samples dropped for being more than `max_staleness` versions old."""


def partition(
    ready: list[Group], expired: list[Group], version: int, *, max_staleness: int, skip_zero_variance: bool
) -> Partition:
    """Split a window's popped groups (`GroupPool.pop_ready`) at policy `version` into
    what trains, what is filtered (and why) and what to ack."""
    fates = [TaskFate(task_msg_id=g.task_msg_id, fate="filtered", reason=EXPIRED_REASON) for g in expired]
    to_ack = [s.raw for g in expired for s in g.samples.values()]
    train: list[Group] = []
    skipped: list[Reward] = []
    stale_samples = 0
    for popped in ready:
        g = replace(popped, samples=dict(popped.samples))
        stale = split_stale(g, version, max_staleness)
        stale_samples += len(stale)
        to_ack += [s.raw for s in stale]
        rewards = [s.reward.reward for s in g.samples.values()]
        if len(g.samples) < 2:
            fates.append(TaskFate(task_msg_id=g.task_msg_id, fate="filtered", reason=STALE_REASON))
        elif skip_zero_variance and max(rewards) == min(rewards):
            fates.append(TaskFate(task_msg_id=g.task_msg_id, fate="filtered", reason=ZERO_VARIANCE_REASON))
            skipped += [s.reward for s in g.samples.values()]
        else:
            train.append(g)
            continue
        to_ack += [s.raw for s in g.samples.values()]
    fates += [
        TaskFate(
            task_msg_id=g.task_msg_id, fate="trained", reward_msg_ids=[s.reward.msg_id for s in g.samples.values()]
        )
        for g in train
    ]
    to_ack += [s.raw for g in train for s in g.samples.values()]
    return Partition(train, fates, to_ack, skipped, stale_samples)
