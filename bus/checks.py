"""Each task's check, bound on the controlled side: which verifier scores it, with which
parameters, reward weights and hidden reference.

A trajectory is built by a rollout worker, a policy-side role: the `verifier`,
`verifier_params`, `reward_weights` and `hidden_ref` it carries are copies that the policy
side could have changed (`verifier = "constant"` scores 1.0). So the verifier never believes
them: it takes the check from the run's hidden bucket, where only the task's publisher wrote
it.

Guarantees:
- Whoever publishes a task (the sampler, the scheduler's pipeline eval rounds) stores its
  `TaskCheck` with `put_checks` BEFORE the task is published, in the run's hidden KV bucket
  (`Registry.hidden_bucket`) under `check_key(domain, task_id)`. By `bus.auth` that bucket is
  written only by the sampler and the scheduler and read only by verifiers: the policy side
  can neither read nor plant a check.
- A check is keyed by the task's domain and task id (a dead letter's replay keeps both), and
  holds only controlled-side values: the task as its publisher built it. The same key always
  holds the latest check its publisher wrote (a publisher rewrites it only when it differs).
- `bind(traj, check)` gives the trajectory as its task's check says (the policy side's copies
  replaced) and the names of the fields the trajectory carried differently (`forged`), which
  the verifier records; the trajectory's own copies are never used to score it.
- `CheckCache.get` raises `bus.hidden.HiddenDataMissing` when the bucket holds no check for
  the trajectory's task: an infrastructure error for the verifier (retried, then
  dead-lettered), never a reward computed from the trajectory's own fields.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from bus.cache import LoadOnce
from bus.hidden import HiddenDataMissing, hidden_ref_for
from bus.subjects import Registry
from schemas import Task, Trajectory

CHECK_PREFIX = "check"
FIELDS = ("verifier", "verifier_params", "reward_weights", "hidden_ref")
"""The trajectory fields a check decides."""


@dataclass(frozen=True)
class TaskCheck:
    """How one task is scored, as its publisher built it."""

    verifier: str
    verifier_params: dict[str, Any] = field(default_factory=dict)
    reward_weights: dict[str, float] = field(default_factory=dict)
    hidden_ref: str | None = None

    @classmethod
    def of(cls, task: Task) -> TaskCheck:
        """The check of `task` (its own fields: call it on the controlled side only)."""
        return cls(task.verifier, dict(task.verifier_params), dict(task.reward_weights), task.hidden_ref)

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> TaskCheck:
        """The check stored in `raw` (ValueError when it is not one)."""
        data = msgpack.unpackb(raw, raw=False)
        if not isinstance(data, dict) or not isinstance(data.get("verifier"), str):
            raise ValueError("not a task check")
        return cls(
            data["verifier"],
            dict(data.get("verifier_params") or {}),
            dict(data.get("reward_weights") or {}),
            data.get("hidden_ref"),
        )


def check_key(domain: str, task_id: str) -> str:
    """The hidden-bucket key of the check of `domain`'s task `task_id` (KV-safe whatever the id holds)."""
    return f"{CHECK_PREFIX}.{hidden_ref_for(domain, task_id)}"


async def put_checks(js: JetStreamContext, reg: Registry, tasks: list[Task], written: dict[str, bytes]) -> int:
    """Store the check of every task whose key does not already hold it (`written`: key -> packed
    check, what this process stored so far; updated for each stored one). Returns how many were
    written. The puts are pipelined (one flush, their acks awaited together); it returns only when
    every one is stored, and raises if any failed (those are written again by the next call)."""
    todo: dict[str, bytes] = {}
    for task in tasks:
        key, packed = check_key(task.domain, task.task_id), TaskCheck.of(task).pack()
        if written.get(key) != packed:
            todo[key] = packed
    if not todo:
        return 0
    kv = await js.key_value(reg.hidden_bucket)

    async def put(key: str, packed: bytes) -> None:
        await kv.put(key, packed)
        written[key] = packed

    results = await asyncio.gather(*(put(k, v) for k, v in todo.items()), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return len(todo)


def forged_fields(traj: Trajectory, check: TaskCheck) -> list[str]:
    """The check fields the trajectory carries differently from its task's check."""
    return [f for f in FIELDS if getattr(traj, f) != getattr(check, f)]


def bind(traj: Trajectory, check: TaskCheck) -> tuple[Trajectory, list[str]]:
    """(the trajectory as its task's check says, the fields it carried differently)."""
    forged = forged_fields(traj, check)
    if not forged:
        return traj, []
    out = Trajectory.model_validate({**traj.model_dump(), **{f: getattr(check, f) for f in FIELDS}})
    return out, forged


class CheckCache:
    """Per-process cache of checks read from the hidden bucket (a key's check changes only when
    its publisher's config does; `max_entries` bounds the memory). The `group_size` trajectories
    of a task, verified at once, read its check from the bucket once (`bus.cache.LoadOnce`),
    through one bucket handle."""

    def __init__(self, js: JetStreamContext, reg: Registry, max_entries: int = 65536) -> None:
        self.js, self.reg, self.max_entries = js, reg, max_entries
        self._kv: KeyValue | None = None
        self._checks: LoadOnce[tuple[str, str], TaskCheck] = LoadOnce(self._load, max_entries)

    async def get(self, domain: str, task_id: str) -> TaskCheck:
        """The check of `domain`'s task `task_id` (HiddenDataMissing when none was stored)."""
        return await self._checks.get((domain, task_id))

    async def _load(self, ident: tuple[str, str]) -> TaskCheck:
        domain, task_id = ident
        key = check_key(domain, task_id)
        if self._kv is None:
            self._kv = await self.js.key_value(self.reg.hidden_bucket)
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            entry = None
        if entry is None or not entry.value:
            raise HiddenDataMissing(
                f"no check for task {task_id!r} of domain {domain!r} in bucket "
                f"{self.reg.hidden_bucket!r} (key {key!r}): tasks must be published by the "
                "run's sampler or scheduler, which store it first (bus.checks.put_checks)"
            )
        try:
            return TaskCheck.unpack(entry.value)
        except Exception as exc:  # msgpack raises several types; a bad record is infra
            raise HiddenDataMissing(f"check {key!r} in bucket {self.reg.hidden_bucket!r} is unreadable: {exc}") from exc
