"""The one registry of every subject, stream, consumer, bucket and key of a run.

Guarantees:
- Handlers never build subject strings: every name comes from `Registry`.
- Run ids and domain names are validated tokens (`[A-Za-z0-9_-]+`), so no name can
  contain NATS wildcards or separators.
- `Registry.streams()` and `Registry.consumers()` give explicit settings for every
  stream and consumer; `bus.conn.ensure_topology` applies them idempotently.
- Work streams (TASKS, TRAJ) are WorkQueue + discard=new with hard caps set far above
  the sampler's in-flight bound, so a normal publish is never refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from bus.roles import NAMES

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ROLES: tuple[str, ...] = NAMES
"""Every role's name, in pipeline order (declared once, in `bus.roles.ROLES`)."""
DAY = 24 * 3600.0


def check_token(kind: str, value: str) -> str:
    """Return `value` if it is a safe subject token, else raise ValueError saying what to do."""
    if not _TOKEN.match(value or ""):
        raise ValueError(f"{kind} {value!r} must match [A-Za-z0-9_-]{{1,64}} (it becomes part of NATS subjects)")
    return value


PRIORITY_CLASSES: tuple[str, ...] = ("eval", "train")
"""Priority classes of tasks at admission, highest first (`rollout_workers.admission`): `eval`
(pipeline evaluation rounds) ahead of `train`. A GRPO group is one task, generated in one batch, so
no sample waits on admission while its siblings are verified, and no finisher class exists (see
docs/architecture.md, Priority at admission)."""


def check_priority(value: str) -> str:
    """Return `value` if it is a priority class, else raise ValueError naming them."""
    if value not in PRIORITY_CLASSES:
        raise ValueError(f"priority class {value!r} is not one of {', '.join(PRIORITY_CLASSES)}")
    return value


@dataclass(frozen=True)
class Limits:
    """Hard ceilings of the run's streams (far above normal in-flight work)."""

    tasks_max_msgs: int = 100_000
    traj_max_msgs: int = 1_000_000
    # nats-server reserves max_bytes of file storage per stream up front, so the work
    # streams' byte caps stay modest (128 MiB each, ~100k trajectories) and the logs
    # (REWARDS, DLQ, LEDGER) are bounded by age, not bytes: a Limits stream with a byte
    # cap would discard old rewards the learner may not have read yet.
    work_max_bytes: int = 128 * 1024**2
    rewards_max_age_s: float = 30 * DAY
    dlq_max_age_s: float = 90 * DAY
    weights_keep: int = 64
    # payload object stores (bus.payloads): byte caps, so a flood of objects stops at the cap
    # (a refused put) instead of filling the store's disk, which would stop the whole run
    workspaces_max_bytes: int = 256 * 1024**2
    artifacts_max_bytes: int = 128 * 1024**2


REPLICAS_ENV = "RLBUS_STREAM_REPLICAS"


def stream_replicas() -> int:
    """Replicas of every stream and bucket of a run: $RLBUS_STREAM_REPLICAS (1..5), default 1
    (3 on a 3-node JetStream cluster). Read when streams are built, never at import."""
    import os

    raw = os.environ.get(REPLICAS_ENV, "").strip() or "1"
    n = int(raw)
    if not 1 <= n <= 5:
        raise ValueError(f"{REPLICAS_ENV}={raw!r}: JetStream replicas must be 1..5 (3 for a 3-node cluster)")
    return n


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer: which stream, which subjects, and its explicit settings."""

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float
    max_deliver: int
    backoff_s: tuple[float, ...]
    max_ack_pending: int
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL

    def config(self) -> ConsumerConfig:
        """The nats-py ConsumerConfig with every setting explicit."""
        return ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=self.deliver_policy,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            backoff=list(self.backoff_s) or None,
            max_ack_pending=self.max_ack_pending,
            max_waiting=512,
        )


@dataclass(frozen=True)
class Registry:
    """All names of one run. Build it once per process from the run id."""

    run_id: str
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        check_token("run_id", self.run_id)

    # -- subjects ---------------------------------------------------------------
    def tasks(self, domain: str, pool: str = "short", priority: str = "train") -> str:
        """Subject a domain's tasks of a duration pool and priority class are published on:
        `tasks.<run>.<domain>` for the default `short` pool, `tasks.<run>.<domain>.<pool>` for
        another (both class `train`), `tasks.<run>.<domain>.<pool>.<class>` for a higher class
        (`PRIORITY_CLASSES`; the pool always named). Token counts differ, so no two overlap."""
        base = f"tasks.{self.run_id}.{check_token('domain', domain)}"
        if check_priority(priority) != "train":
            return f"{base}.{check_token('pool', pool)}.{priority}"
        return base if pool == "short" else f"{base}.{check_token('pool', pool)}"

    def traj(self, domain: str) -> str:
        """Subject a domain's trajectories are published on."""
        return f"traj.{self.run_id}.{check_token('domain', domain)}"

    def rewards(self, domain: str) -> str:
        """Subject a domain's rewards are published on."""
        return f"rewards.{self.run_id}.{check_token('domain', domain)}"

    def eval(self, domain: str) -> str:
        """Subject a domain's evaluation results are published on."""
        return f"eval.{self.run_id}.{check_token('domain', domain)}"

    def dlq(self, stage: str) -> str:
        """Subject a stage's dead letters are published on."""
        return f"dlq.{self.run_id}.{check_token('stage', stage)}"

    def ledger(self, stage: str) -> str:
        """Subject a stage's task-fate records are published on."""
        return f"ledger.{self.run_id}.{check_token('stage', stage)}"

    @property
    def weights(self) -> str:
        """Subject of WeightVersion announcements."""
        return f"weights.{self.run_id}"

    @property
    def weights_prefetch(self) -> str:
        """Core-NATS subject of WeightPrefetch hints (not in any stream: a hint lost costs
        only latency, the WeightVersion on `weights` is authoritative)."""
        return f"weights.{self.run_id}.prefetch"

    def metrics(self, role: str = "*", worker_id: str = "*") -> str:
        """Core-NATS telemetry subject (wildcards by default)."""
        return f"metrics.{self.run_id}.{role}.{worker_id}"

    def all(self, prefix: str) -> str:
        """Wildcard over every domain/stage of a subject family (`tasks`, `traj`, ...)."""
        return f"{prefix}.{self.run_id}.>"

    # -- streams, buckets -------------------------------------------------------
    def stream(self, family: str) -> str:
        """Stream name of a family: TASKS, TRAJ, REWARDS, WEIGHTS, EVAL, DLQ, LEDGER."""
        return f"{family.upper()}_{self.run_id}"

    @property
    def kv_bucket(self) -> str:
        """KV bucket of the run's control plane (weights.latest, learner.progress, ...)."""
        return f"run-{self.run_id}"

    @property
    def object_bucket(self) -> str:
        """Object store bucket of weight blobs."""
        return f"weights-{self.run_id}"

    @property
    def workspace_bucket(self) -> str:
        """Object store bucket of the public repositories of tasks too large for a message
        (`bus.payloads`), named by content: written only by the task publishers (sampler,
        scheduler), read by rollout and verifier. Never hidden data, never weights."""
        return f"workspaces-{self.run_id}"

    @property
    def artifact_bucket(self) -> str:
        """Object store bucket of trajectory artifacts too large for a message (a diff:
        `bus.payloads`), named by content: written by rollout, read by the verifier. Weight
        retention works on `object_bucket` only."""
        return f"artifacts-{self.run_id}"

    def payload_buckets(self) -> dict[str, tuple[str, int]]:
        """Payload kind -> (bucket, max_bytes): `workspace` and `artifact`."""
        return {
            "workspace": (self.workspace_bucket, self.limits.workspaces_max_bytes),
            "artifact": (self.artifact_bucket, self.limits.artifacts_max_bytes),
        }

    @property
    def kv_stream(self) -> str:
        """The stream behind the run's KV bucket (a key's history is read from it)."""
        return f"KV_{self.kv_bucket}"

    def kv_key_subject(self, key: str) -> str:
        """Subject the run's KV bucket stores `key` under (`$KV.run-<run>.<key>`): a consumer
        filtered on it reads the key's history, one message per put."""
        return f"$KV.{self.kv_bucket}.{key}"

    @property
    def hidden_bucket(self) -> str:
        """KV bucket of verifier-only task data (gold answers, tests): never read by the policy side."""
        return f"hidden-{self.run_id}"

    def streams(self) -> list[StreamConfig]:
        """Explicit configs of every stream of the run."""
        lim = self.limits

        def sc(family, subjects, retention, discard, **kw):
            return StreamConfig(
                name=self.stream(family),
                subjects=subjects,
                retention=retention,
                discard=discard,
                storage=StorageType.FILE,
                num_replicas=stream_replicas(),
                duplicate_window=120.0,
                **kw,
            )

        work, limits = RetentionPolicy.WORK_QUEUE, RetentionPolicy.LIMITS
        new, old = DiscardPolicy.NEW, DiscardPolicy.OLD
        return [
            sc("TASKS", [self.all("tasks")], work, new, max_msgs=lim.tasks_max_msgs, max_bytes=lim.work_max_bytes),
            sc("TRAJ", [self.all("traj")], work, new, max_msgs=lim.traj_max_msgs, max_bytes=lim.work_max_bytes),
            sc("REWARDS", [self.all("rewards")], limits, old, max_age=lim.rewards_max_age_s),
            sc("WEIGHTS", [self.weights], limits, old, max_msgs=lim.weights_keep),
            sc("EVAL", [self.all("eval")], limits, old, max_age=lim.rewards_max_age_s),
            sc("DLQ", [self.all("dlq")], limits, old, max_age=lim.dlq_max_age_s),
            sc("LEDGER", [self.all("ledger")], limits, old, max_age=lim.rewards_max_age_s),
        ]

    # -- consumers --------------------------------------------------------------
    def rollout_consumer(
        self, ack_wait_s: float = 60.0, max_ack_pending: int = 256, pool: str = "short", priority: str = "train"
    ) -> ConsumerSpec:
        """The shared durable every rollout worker of a duration pool pulls tasks of a priority class
        from (class `train`: `rollout` for the `short` pool, `rollout-<pool>` otherwise; a higher
        class: `rollout-<pool>-<class>`; each pool its own ack_wait)."""
        if check_priority(priority) != "train":
            durable = f"rollout-{check_token('pool', pool)}-{priority}"
            subject = f"tasks.{self.run_id}.*.{pool}.{priority}"
        elif pool == "short":
            durable, subject = "rollout", f"tasks.{self.run_id}.*"
        else:
            durable, subject = f"rollout-{check_token('pool', pool)}", f"tasks.{self.run_id}.*.{pool}"
        return ConsumerSpec(
            self.stream("TASKS"),
            durable,
            subject,
            ack_wait_s,
            5,
            (ack_wait_s, 2 * ack_wait_s, 4 * ack_wait_s),
            max_ack_pending,
        )

    def verifier_consumer(self, ack_wait_s: float = 30.0, max_ack_pending: int = 4096) -> ConsumerSpec:
        """The shared durable every verifier worker pulls trajectories from."""
        return ConsumerSpec(
            self.stream("TRAJ"),
            "verifier",
            self.all("traj"),
            ack_wait_s,
            5,
            (ack_wait_s, 2 * ack_wait_s, 4 * ack_wait_s),
            max_ack_pending,
        )

    def learner_consumer(self, ack_wait_s: float = 300.0, max_ack_pending: int = 20000) -> ConsumerSpec:
        """The learner's durable on the REWARDS log (acks after the step that used them)."""
        return ConsumerSpec(self.stream("REWARDS"), "learner", self.all("rewards"), ack_wait_s, 20, (), max_ack_pending)

    TRACKER_FEEDS = ("weights", "rewards", "eval", "kv")

    def tracker_consumer(self, feed: str, kv_key: str = "", ack_wait_s: float = 120.0) -> ConsumerSpec:
        """The tracker's own durable on one feed, shared with no other reader: `tracker-weights`
        (WEIGHTS), `tracker-rewards` (REWARDS), `tracker-eval` (EVAL), or `tracker-kv-<key>` (the
        history of one key of the run's KV bucket). Unlimited deliveries: the tracker acks after
        writing, and a slow or failing backend must never turn into dead letters."""
        if feed == "kv":
            stream, durable, subject = (
                self.kv_stream,
                f"tracker-kv-{check_token('kv key', kv_key)}",
                self.kv_key_subject(kv_key),
            )
        elif feed in ("weights", "rewards", "eval"):
            stream, durable = self.stream(feed), f"tracker-{feed}"
            subject = self.weights if feed == "weights" else self.all(feed)
        else:
            raise ValueError(f"tracker feed {feed!r} is not one of {', '.join(self.TRACKER_FEEDS)}")
        return ConsumerSpec(stream, durable, subject, ack_wait_s, -1, (), 8192)

    # -- sandbox service (core request/reply; a pool is shared by every run) ----
    SANDBOX_OPS = ("exec", "read", "write", "reset", "ping", "close")

    def sandbox_open(self, pool: str) -> str:
        """Subject clients request a new sandbox session on (a queue group answers)."""
        return f"sandbox.{check_token('pool', pool)}.open"

    def sandbox_queue(self, pool: str) -> str:
        """Queue group every sandbox worker of a pool joins for `open`."""
        return f"sandbox-{check_token('pool', pool)}"

    def sandbox_session_op(self, pool: str, worker_id: str, op: str) -> str:
        """Subject of one op on a session held by `worker_id` (ops: SANDBOX_OPS)."""
        if op not in self.SANDBOX_OPS:
            raise ValueError(f"sandbox op {op!r} is not one of {', '.join(self.SANDBOX_OPS)}")
        return f"sandbox.{check_token('pool', pool)}.s.{check_token('worker_id', worker_id)}.{op}"

    def sandbox_session_ops(self, pool: str, worker_id: str) -> str:
        """Wildcard a sandbox worker subscribes to for the sessions it holds."""
        return f"sandbox.{check_token('pool', pool)}.s.{check_token('worker_id', worker_id)}.*"

    @property
    def toolrec_bucket(self) -> str:
        """KV bucket of tool-execution records (key: exec_id), written by the sandbox side."""
        return f"toolrec-{self.run_id}"
