"""Per-message accounting of a run: what became of every task the sampler published.

Guarantees:
- Starts from the sampler's ledger records (one per published task msg_id) and assigns
  each task exactly one fate from positive evidence, in this order: `trained` (a
  learner ledger record), `filtered` (a learner record with its reason),
  `dead_lettered` (a DLQ entry tracing back to it), `in_flight` (its task, a
  trajectory or an un-acked reward is still stored, or the learner reported it
  pending at stop). A task with none of these is `lost`; lost is never a remainder.
- `trained_twice` counts reward msg_ids that appear in more than one `trained` record.
- A learner that restored a checkpoint leaves a rollback marker (`rollback_after_seq`):
  the learner records stored between that sequence and the marker describe training
  the restored model never saw, so they are superseded (ignored); the replay after the
  marker records those tasks again.
- Reads streams by sequence (`bus.streams.iter_stream`): it consumes nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from nats.js.errors import NotFoundError

from bus.streams import iter_stream
from bus.subjects import Registry
from schemas import DeadLetter, DecodeError, Reward, Task, TaskFates, Trajectory, decode


@dataclass
class Accounting:
    """Fates of the run's tasks."""

    published: set[str] = field(default_factory=set)
    fate: dict[str, str] = field(default_factory=dict)
    filtered_reasons: Counter = field(default_factory=Counter)
    trained_twice: int = 0
    dead_letters: int = 0
    rollbacks: int = 0

    @property
    def lost(self) -> list[str]:
        """Published tasks with no evidence of any fate."""
        return sorted(t for t in self.published if t not in self.fate)

    def counts(self) -> dict[str, int]:
        """Tasks per fate, plus lost."""
        c = Counter(self.fate[t] for t in self.published if t in self.fate)
        return {k: c.get(k, 0) for k in ("trained", "filtered", "dead_lettered", "in_flight")} | {
            "lost": len(self.lost)
        }


async def _decoded(js, stream: str, subject: str, kind, start_seq: int = 0):
    async for seq, data in iter_stream(js, stream, subject, start_seq):
        try:
            yield seq, decode(data, kind)
        except DecodeError:
            continue


async def account(js, reg: Registry) -> Accounting:
    """Build the accounting of a stopped (or running) run from its streams."""
    acc = Accounting()
    trained, filtered, pending = set(), {}, set()
    reward_uses: Counter = Counter()
    records = [(seq, rec) async for seq, rec in _decoded(js, reg.stream("LEDGER"), reg.all("ledger"), TaskFates)]
    rollbacks = [(rec.rollback_after_seq, seq) for seq, rec in records if rec.rollback_after_seq is not None]
    acc.rollbacks = len(rollbacks)
    for seq, rec in records:
        if rec.stage == "learner" and any(after < seq < marker for after, marker in rollbacks):
            continue  # superseded by a checkpoint restore
        for f in rec.fates:
            if f.fate == "published":
                acc.published.add(f.task_msg_id)
            elif f.fate == "trained":
                trained.add(f.task_msg_id)
                reward_uses.update(f.reward_msg_ids)
            elif f.fate == "filtered":
                filtered.setdefault(f.task_msg_id, f.reason)
            elif f.fate == "pending":
                pending.add(f.task_msg_id)
    acc.trained_twice = sum(1 for n in reward_uses.values() if n > 1)

    dead = set()
    async for _, data in iter_stream(js, reg.stream("DLQ"), reg.all("dlq")):
        acc.dead_letters += 1
        try:
            letter = decode(data, DeadLetter)
        except DecodeError:
            continue
        if letter.task_msg_id:
            dead.add(letter.task_msg_id)

    in_flight = set(pending)
    async for _, t in _decoded(js, reg.stream("TASKS"), reg.all("tasks"), Task):
        in_flight.add(t.msg_id)
    async for _, tr in _decoded(js, reg.stream("TRAJ"), reg.all("traj"), Trajectory):
        in_flight.add(tr.task_msg_id)
    floor = 0
    try:
        info = await js.consumer_info(reg.stream("REWARDS"), "learner")
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
    except NotFoundError:  # no learner consumer: nothing was acked; other errors propagate (no wrong account)
        floor = 0
    used = set(reward_uses)
    async for _, r in _decoded(js, reg.stream("REWARDS"), reg.all("rewards"), Reward, floor + 1):
        if r.msg_id not in used:
            in_flight.add(r.trajectory.task_msg_id)

    for t in acc.published:
        if t in trained:
            acc.fate[t] = "trained"
        elif t in filtered:
            acc.fate[t] = "filtered"
            acc.filtered_reasons[filtered[t]] += 1
        elif t in dead:
            acc.fate[t] = "dead_lettered"
        elif t in in_flight:
            acc.fate[t] = "in_flight"
    return acc
