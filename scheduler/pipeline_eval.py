"""Evaluation through the pipeline: `purpose=eval` tasks through rollout and verifier workers.

With `scheduler.eval.mode = "pipeline"`, each evaluation round publishes every problem of
the run's pinned eval sets (`scheduler.evaluation.EvalSuite`) as a greedy `Task` with
`purpose="eval"` on the task subjects of its priority class: `eval` when `rollout.priority.enabled`
(the default), so the same rollout workers take them ahead of training tasks while training goes
on beside them (at least `rollout.priority.min_share` of admissions; `rollout_workers.admission`),
else `train`, first come first served. Nothing waits for a round but the scheduler's
evaluation loop: the sampler keeps publishing and the learner keeps stepping (its in-flight bound
counts training tasks only). Rollout workers generate them (multi-turn
tool episodes included) with whatever weights they serve, verifier workers score them
with the training verifiers, and the rewards land on REWARDS, where the learner acks
them without training (it trains only `purpose="train"`), the curriculum ignores them,
and this module collects them.

Guarantees:
- A round's tasks have msg_ids `ev<round>.<domain>.<i>-r<run>`: redelivered or
  republished, JetStream and the reward ids de-duplicate them; a reward counts once.
- A round covers every set of the suite, or the named ones (`evaluate(only=...)`). Every
  item of a set (`producers.eval_set.EvalItem`, whatever its domain) is published as its own
  task made greedy: `purpose=eval`, one sample, temperature 0, its verifier, params, budgets,
  tools and pool as the set has them; hidden gold is put in the run's hidden bucket (under
  the task's `hidden_ref`), and the public payloads a task names by reference (a large
  repository: `EvalItem.payloads`) in the run's payload bucket with the task's ref rebound
  to this run (`bus.payloads.rebind`: the sets are drawn as run `eval`), before the first
  round that publishes them.
- The score of a domain is the fraction of its problems whose reward has its success
  component == 1 (`SUCCESS_COMPONENTS`: `correct`, else `resolved`, the repo verifier's
  task completion, so a repo domain's score is its completion rate whatever its reward
  weights; the scalar when a verifier reports neither), over the whole set: a problem whose
  reward did not arrive within the timeout counts as wrong and is reported (`missing`).
  Each score is recorded (`EvalResult` -> `eval_results`) next to the run's cost so far
  (tokens, CPU seconds, sandbox seconds: `scheduler.store`).
- The version a round reports is the policy version most of its trajectories were
  generated with (weights may change during a round); the range is logged.
- Per domain, the round also scores the groups of its items by `GROUP_PARAMS` (public task
  params such as a needle's `position_bucket` or a document's `length`): `groups`, published
  with each domain's `EvalResult` and shown in summary.json's `eval`.
- A round is abandoned, and reports nothing, as soon as the caller's `stop` event is set:
  at shutdown the rollout and verifier workers are stopped first, so a round in flight
  (for instance one whose tasks a killed worker held until `ack_wait`) could never finish,
  and waiting for it would keep the scheduler from its final evaluation.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from bus.checks import put_checks
from bus.hidden import put_hidden
from bus.payloads import put_payloads, rebind
from bus.publish import publish_many
from bus.subjects import Registry, check_priority
from schemas import DecodeError, Reward, Task, decode

log = structlog.get_logger()


def eval_tasks(suite, run_id: str, round_id: int, only: list[str] | None = None) -> list[Task]:
    """One greedy `purpose=eval` task per item of every eval set of the suite (or of the
    sets named in `only`): the item's own task with this round's ids."""
    out = []
    for name, s in suite.sets.items():
        if only is not None and name not in only:
            continue
        for i, item in enumerate(s.items):
            ids = dict(
                run_id=run_id,
                msg_id=f"ev{round_id}.{name}.{i}-r{run_id}",
                task_id=f"eval-{name}-{i}",
                domain=name,
                purpose="eval",
                group_size=1,
                temperature=0.0,
            )
            if item.task.workspace_ref is not None:  # drawn as run `eval`: its repository is stored in this run
                ids["workspace_ref"] = rebind(item.task.workspace_ref, Registry(run_id))
            out.append(item.task.model_copy(update=ids))
    return out


GROUP_PARAMS = ("position_bucket", "length")
"""Public task params (`Task.verifier_params`) a round also reports scores by, per domain
(`PipelineEval.groups`): long-context domains record the needle's position bucket and the
document's length there (`producers.domains.recall`, `findoc`)."""
JOINT_GROUPS = (("length", "position_bucket"),)
"""Param pairs also scored jointly, as param `"length|position_bucket"` with values `"<length>|<bucket>"`
(the recall heatmap of `rlbus report`), for tasks that carry both."""


def group_scores(tasks: list[Task], got: dict[str, Reward]) -> dict[str, dict[str, dict[str, float]]]:
    """{domain: {param: {value: fraction correct}}} over the round's tasks that carry a
    `GROUP_PARAMS` param, and the `JOINT_GROUPS` pairs they carry both of (a task whose reward
    is missing counts as wrong, as in the domain score)."""
    total: dict[tuple[str, str, str], int] = Counter()
    right: dict[tuple[str, str, str], int] = Counter()
    for t in tasks:
        r = got.get(t.msg_id)
        params = t.verifier_params
        keys = [(p, str(params[p])) for p in GROUP_PARAMS if p in params]
        keys += [
            ("|".join(j), "|".join(str(params[p]) for p in j)) for j in JOINT_GROUPS if all(p in params for p in j)
        ]
        for p, value in keys:
            total[(t.domain, p, value)] += 1
            right[(t.domain, p, value)] += r is not None and is_correct(r)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (domain, p, value), n in sorted(total.items()):
        out.setdefault(domain, {}).setdefault(p, {})[value] = right[(domain, p, value)] / n
    return out


SUCCESS_COMPONENTS = ("correct", "resolved")
"""The component that says a problem was solved, first found wins; else the scalar reward."""


def is_correct(r: Reward) -> bool:
    """Whether the reward's success component (else its scalar) is 1."""
    key = next((k for k in SUCCESS_COMPONENTS if k in r.components), None)
    return float(r.components[key] if key else r.reward) >= 1.0


@dataclass
class Round:
    """Rewards collected for one evaluation round."""

    round_id: int
    expected: dict[str, int]
    got: dict[str, Reward] = field(default_factory=dict)  # task msg_id -> reward
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, r: Reward) -> None:
        key = r.trajectory.task_msg_id
        if key not in self.got:
            self.got[key] = r
            if len(self.got) >= sum(self.expected.values()):
                self.done.set()


class PipelineEval:
    """Publishes eval rounds and collects their rewards from REWARDS (an ordered consumer)."""

    def __init__(self, js, reg, suite, timeout_s: float = 600.0, priority: str = "eval") -> None:
        self.js, self.reg, self.suite, self.timeout_s = js, reg, suite, timeout_s
        self.priority = check_priority(priority)  # the class its tasks are published in (`bus.subjects`)
        self.rounds: dict[int, Round] = {}
        self.next_round = int(time.time())  # unique across scheduler restarts
        self._sub = None
        self.last: dict = {}  # the last round: tasks published, rewards received
        self.groups: dict = {}  # the last completed round's `group_scores`
        self.hidden_stored: set[str] = set()
        self.payloads_stored: set[str] = set()
        self.checks_stored: dict[str, bytes] = {}

    async def start(self) -> None:
        from nats.js.api import DeliverPolicy

        self._sub = await self.js.subscribe(
            self.reg.all("rewards"), cb=self._on_reward, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_reward(self, raw) -> None:
        if not (raw.headers or {}).get("Nats-Msg-Id", "").startswith("rw-ev"):
            return  # a training reward: skip it without decoding
        try:
            r = decode(raw.data, Reward)
        except DecodeError:
            return
        t = r.trajectory
        if t.purpose != "eval" or not t.task_msg_id.startswith("ev"):
            return
        try:
            round_id = int(t.task_msg_id[2:].split(".", 1)[0])
        except ValueError:
            return
        if round_id in self.rounds:
            self.rounds[round_id].add(r)

    async def _store_hidden(self, names) -> None:
        """Put the hidden gold of the sets' items among `names`, and the public payloads their
        tasks name by reference (a large repository: `EvalItem.payloads`), once per process."""
        for name in names:
            for item in self.suite.sets[name].items:
                ref = item.task.hidden_ref
                if item.hidden is not None and ref and ref not in self.hidden_stored:
                    await put_hidden(self.js, self.reg, ref, item.hidden)
                    self.hidden_stored.add(ref)
                await put_payloads(self.js, self.reg, item.payloads, self.payloads_stored)

    async def evaluate(
        self, stop: asyncio.Event | None = None, only: list[str] | None = None
    ) -> tuple[dict[str, tuple[float, int, str]], int | None] | None:
        """One round over the suite (or the sets in `only`): {domain: (score, n, sha256)} and the
        policy version most trajectories used; None when `stop` was set before the round
        completed (the round is abandoned)."""
        names = [n for n in self.suite.sets if only is None or n in only]
        round_id, self.next_round = self.next_round, self.next_round + 1
        tasks = eval_tasks(self.suite, self.reg.run_id, round_id, names)
        rnd = self.rounds[round_id] = Round(round_id, dict(Counter(t.domain for t in tasks)))
        t0 = time.monotonic()
        await self._store_hidden(names)
        await put_checks(self.js, self.reg, tasks, self.checks_stored)  # what the verifier scores by
        await publish_many(self.js, [(self.reg.tasks(t.domain, t.pool, self.priority), t) for t in tasks])
        waits = [asyncio.ensure_future(rnd.done.wait())] + ([asyncio.ensure_future(stop.wait())] if stop else [])
        try:
            await asyncio.wait(waits, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            del self.rounds[round_id]
        self.last = {
            "round": round_id,
            "tasks": len(tasks),
            "rewards": len(rnd.got),
            "priority": self.priority,
            "seconds": round(time.monotonic() - t0, 3),
        }
        if stop is not None and stop.is_set() and not rnd.done.is_set():
            log.warning(
                "scheduler.eval_round_abandoned",
                round=round_id,
                tasks=len(tasks),
                rewards=len(rnd.got),
                seconds=round(time.monotonic() - t0, 1),
                why="stopping before the round completed",
            )
            return None
        versions = Counter(r.trajectory.policy_version for r in rnd.got.values())
        got, right = Counter(), Counter()  # per domain: rewards received, correct ones
        for r in rnd.got.values():
            got[r.trajectory.domain] += 1
            right[r.trajectory.domain] += is_correct(r)
        self.groups = group_scores(tasks, rnd.got)
        scores = {}
        for name in names:
            s = self.suite.sets[name]
            n = len(s)
            scores[name] = (right[name] / max(1, n), n, s.sha256)
            if got[name] < n:
                log.warning(
                    "scheduler.eval_missing",
                    domain=name,
                    missing=n - got[name],
                    round=round_id,
                    why=f"no reward within {self.timeout_s:.0f}s; counted as wrong",
                )
        version = versions.most_common(1)[0][0] if versions else None
        log.info(
            "scheduler.eval_round",
            round=round_id,
            seconds=round(time.monotonic() - t0, 1),
            versions=sorted(versions),
            tasks=len(tasks),
            rewards=len(rnd.got),
        )
        return scores, version
