"""Every message that crosses the bus, and its MessagePack encoding.

The episode's messages (`Task`, `Trajectory`, `Reward`) live in `schemas.episode`, the envelope
they share (`Message`) in `schemas.envelope`; this module holds the other kinds (weights,
dead letters, telemetry, evaluation, the task ledger), the kind table and the codec.

Guarantees:
- Each message is ONE top-level MessagePack map holding the envelope fields
  `kind`, `schema_version`, `run_id`, `msg_id`, `created_at` plus its own fields, so any
  standard MessagePack client in any language can read it.
- `decode(data)` returns a validated model or raises `DecodeError`, whose `field` names
  the offending field (or `<payload>`) and whose `reason` says why. It never returns a
  half-valid object.
- A `schema_version` other than `SCHEMA_VERSION` is a `DecodeError`.
- `KINDS` maps every message kind to its class; a `kind` not in it is a `DecodeError`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.envelope import SCHEMA_VERSION, DecodeError, Message
from schemas.episode import Reward, Task, Trajectory


class WeightVersion(Message):
    """A published policy version."""

    KIND: ClassVar[str] = "weight_version"
    version: int = Field(ge=0)
    """Monotonic version number (0 = starting checkpoint)."""
    step: int = Field(ge=0)
    """Learner step that produced it."""
    uri: str
    """Where the blob is: `nats-object://<bucket>/<name>`, `file://...`."""
    sha256: str
    """Hex sha256 of the blob; loaders must check it."""
    bytes: int = Field(ge=0)
    """Blob size."""
    format: Literal["safetensors"] = "safetensors"
    """Blob format."""
    dtype: str = "float32"
    """Parameter dtype."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Learner metrics at publication."""


class WeightPrefetch(Message):
    """A hint, before its `WeightVersion`: the blob of `version` is complete at `uri`.

    Sent on core NATS (not stored) by a learner with a `file://` store the moment the
    file is renamed into place, while its sha256 is still being computed. A speculative
    rollout worker may load and serve it at once, but publishes nothing generated with
    it until the `WeightVersion` of the same version and uri arrives and the file's
    sha256 matches. Losing a prefetch costs only latency: the `WeightVersion` alone
    is enough."""

    KIND: ClassVar[str] = "weight_prefetch"
    version: int = Field(ge=0)
    """The version number its `WeightVersion` will carry."""
    step: int = Field(ge=0)
    """Learner step that produced it."""
    uri: str
    """Where the complete blob is (`file://...`)."""
    bytes: int = Field(ge=0)
    """Blob size."""


class DeadLetter(Message):
    """A message a stage could not process, with the reason and the original bytes."""

    KIND: ClassVar[str] = "dead_letter"
    stage: str
    """Role that rejected it."""
    reason: str
    """Why (human readable)."""
    error_type: str = "rejected"
    """`decode_error`, `foreign_run`, `rejected`, `max_deliveries`."""
    original_subject: str
    """Subject the message arrived on."""
    original_data: bytes
    """The original payload, byte for byte."""
    original_headers: dict[str, str] = Field(default_factory=dict)
    """The original headers."""
    original_msg_id: str | None = None
    """The original Nats-Msg-Id, if any."""
    delivery_count: int = 1
    """JetStream delivery count when rejected."""
    task_msg_id: str | None = None
    """The task message this traces back to, when it could be read."""


class Metric(Message):
    """Telemetry from one worker (core NATS, not persisted)."""

    KIND: ClassVar[str] = "metric"
    role: str
    """Worker role."""
    worker_id: str
    """Process-unique worker id."""
    values: dict[str, float] = Field(default_factory=dict)
    """Counters and gauges."""
    host: str = ""
    """Host the worker runs on (a Metric doubles as the worker's heartbeat)."""
    pid: int = 0
    """Process id of the worker on that host."""


class EvalResult(Message):
    """Greedy evaluation of one weight version on one domain's fixed held-out set."""

    KIND: ClassVar[str] = "eval_result"
    version: int
    """Evaluated weight version."""
    step: int
    """Learner step of that version."""
    domain: str
    """Domain evaluated."""
    score: float = Field(ge=0.0, le=1.0)
    """Fraction correct."""
    n: int
    """Problems evaluated."""
    eval_set_sha256: str
    """Content hash of the eval set."""
    purpose: Literal["train", "heldout"] = "train"
    """`heldout`: a zero-shot domain (`sampler.domains.<d>.heldout`), never trained on; `train`: a trained domain."""
    groups: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Fraction correct per group of the set's items, by the public task params the pipeline groups
    by (`scheduler.pipeline_eval.GROUP_PARAMS`: a recall needle's `position_bucket`, a long-context
    task's `length`): {param: {value: score}}; empty when the items carry none or scoring was local."""


class TaskFate(BaseModel):
    """What became of one task message."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    task_msg_id: str
    """The task message id."""
    fate: Literal["published", "trained", "filtered", "pending"]
    """Event: published by the sampler, trained/filtered by the learner, or still held at stop."""
    reason: str = ""
    """For `filtered`: why."""
    reward_msg_ids: list[str] = Field(default_factory=list)
    """For `trained`: the reward messages that went into the step."""


class TaskFates(Message):
    """A batch of task ledger events from one stage (the per-msg_id accounting record)."""

    KIND: ClassVar[str] = "task_fates"
    stage: str
    """Role that recorded them."""
    step: int = -1
    """Learner step, when relevant."""
    fates: list[TaskFate]
    """The events."""
    rollback_after_seq: int | None = None
    """Set by a learner that restored a checkpoint: its own ledger records stored after this
    LEDGER sequence describe training the restored model never saw, and are superseded."""


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (Task, Trajectory, Reward, WeightVersion, WeightPrefetch, DeadLetter, Metric, EvalResult, TaskFates)
}


def encode(msg: Message) -> bytes:
    """MessagePack bytes of a message: one map with `kind` and the envelope fields."""
    if isinstance(msg, Reward) and msg.trajectory._wire is not None:
        # a decoded (frozen) trajectory is embedded as the map it arrived as: no re-dump
        body = msg.model_dump(mode="python", exclude={"trajectory"})
        body["trajectory"] = msg.trajectory._wire
    else:
        body = msg.model_dump(mode="python")
    body["kind"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes, expect: type[Message] | None = None) -> Message:
    """Validate bytes into a message; raise `DecodeError` naming the bad field."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise DecodeError("<payload>", f"not MessagePack: {type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise DecodeError("<payload>", f"expected a map, got {type(body).__name__}")
    version = body.get("schema_version")
    if version != SCHEMA_VERSION:
        raise DecodeError("schema_version", f"got {version!r}, this worker speaks {SCHEMA_VERSION}")
    kind = body.pop("kind", None)
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DecodeError("kind", f"unknown message kind {kind!r}")
    if expect is not None and cls is not expect:
        raise DecodeError("kind", f"expected {expect.KIND!r}, got {kind!r}")
    try:
        msg = cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<payload>"
        raise DecodeError(field, err["msg"]) from None
    if isinstance(msg, Trajectory):
        msg._wire = body
    return msg
