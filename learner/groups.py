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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        return complete + [g for g in self.groups.values()
                           if not g.complete and now - g.first_seen >= self.deadline_s and len(g.samples) >= 2]

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
    """Remove and return the group's samples older than `max_staleness` versions."""
    stale = [i for i, s in group.samples.items()
             if current_version - s.reward.trajectory.policy_version > max_staleness]
    return [group.samples.pop(i) for i in stale]
