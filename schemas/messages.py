"""Every message that crosses the bus, and its MessagePack encoding.

Guarantees:
- Each message is ONE top-level MessagePack map holding the envelope fields
  `kind`, `schema_version`, `run_id`, `msg_id`, `created_at` plus its own fields, so any
  standard MessagePack client in any language can read it.
- `decode(data)` returns a validated model or raises `DecodeError`, whose `field` names
  the offending field (or `<payload>`) and whose `reason` says why. It never returns a
  half-valid object.
- Token ids and log-probs travel as packed little-endian arrays (`int32` / `float32`
  bytes), never as lists of Python ints.
- A `schema_version` other than `SCHEMA_VERSION` is a `DecodeError`.
- `Trajectory.from_task` builds every trajectory: msg_id `<task msg_id>-<sample index>`, group_id its task's.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import msgpack
import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from schemas.payload_ref import BlobRef

SCHEMA_VERSION = 1

Purpose = Literal["train", "eval"]
VerifierStatus = Literal["ok", "infra_error", "tamper", "invalid", "answer_limit"]
"""`answer_limit`: the answer ran into the answer pool's limits (`verifier_workers.answer_pool`), reward 0."""


def new_msg_id() -> str:
    """A fresh, globally unique message id (used as `Nats-Msg-Id`)."""
    return uuid.uuid4().hex


def pack_i32(values: Any) -> bytes:
    """Pack a sequence or array of ints as little-endian int32 bytes."""
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    """Inverse of `pack_i32` (a read-only int32 array)."""
    return np.frombuffer(data, dtype="<i4")


def pack_f32(values: Any) -> bytes:
    """Pack a sequence or array of floats as little-endian float32 bytes."""
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(data: bytes) -> np.ndarray:
    """Inverse of `pack_f32` (a read-only float32 array)."""
    return np.frombuffer(data, dtype="<f4")


class DecodeError(ValueError):
    """Bytes that are not a valid message: `field` is what is wrong, `reason` why."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def _packed(multiple: int):
    def check(v: bytes) -> bytes:
        if len(v) % multiple:
            raise ValueError(f"packed array length {len(v)} is not a multiple of {multiple}")
        return v

    return AfterValidator(check)


PackedI32 = Annotated[bytes, _packed(4)]
PackedF32 = Annotated[bytes, _packed(4)]
RewardWeights = dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False)]]
"""Component name -> finite weight (ints allowed, bools and strings not)."""


class Message(BaseModel):
    """Envelope shared by every message."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    KIND: ClassVar[str] = ""

    schema_version: int = SCHEMA_VERSION
    """Wire schema version; decode rejects any other."""
    run_id: str
    """The run this message belongs to."""
    msg_id: str = Field(default_factory=new_msg_id)
    """Unique id, sent as Nats-Msg-Id for JetStream de-duplication."""
    created_at: float = Field(default_factory=time.time)
    """Unix time the message was created."""
    _wire: dict | None = PrivateAttr(default=None)
    # for a decoded Trajectory (frozen): the validated map it was decoded from, so a
    # Reward can embed it without dumping it again; None for messages built in code


class ChatMessage(BaseModel):
    """One chat message of a prompt."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    role: Literal["system", "user", "assistant", "tool"]
    """Who speaks."""
    content: str
    """What is said."""


def render_prompt(prompt: list[ChatMessage]) -> str:
    """The text a chat prompt is generated from (no chat template): the contents in order. The only copy."""
    return "".join(m.content for m in prompt)


class Task(Message):
    """A unit of work for the policy: one prompt, answered `group_size` times."""

    KIND: ClassVar[str] = "task"
    task_id: str
    """Stable id of the problem (a group's samples share it)."""
    domain: str
    """Domain name (`arith`, ...)."""
    difficulty: int = 1
    """Domain-specific difficulty level."""
    purpose: Purpose = "train"
    """`train` feeds the learner; `eval` is scored only."""
    group_size: int = Field(ge=1, le=1024)
    """Number of samples G drawn for this prompt."""
    prompt: list[ChatMessage]
    """The conversation so far (chat messages)."""
    tools: list[str] = Field(default_factory=list)
    """Tool names the policy may call."""
    max_turns: int = Field(default=1, ge=1)
    """Maximum model turns in the episode."""
    tool_format: Literal["tags", "json"] = "tags"
    """How the policy calls `tools` (`schemas.tool_protocol`); absent on the wire = `tags`."""
    max_tokens: int = Field(default=16, ge=1)
    """Maximum generated tokens per turn."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    verifier: str
    """Registered verifier name."""
    verifier_params: dict[str, Any] = Field(default_factory=dict)
    """Public parameters for the verifier (never gold answers or tests)."""
    reward_weights: RewardWeights = Field(default_factory=dict)
    """Weights of the verifier's named components in the scalar reward (the domain's
    `reward_weights`; empty: the verifier's default). Absent on the wire = empty."""
    hidden_ref: str | None = None
    """Where hidden gold/tests live; only verifiers resolve it."""
    pool: str = "short"
    """Expected-duration class: rollout workers pull each pool through its own consumer
    (own ack_wait, in_progress cadence and time budget), so long episodes never starve short ones."""
    workspace: dict[str, str] = Field(default_factory=dict)
    """Public files the episode's sandbox starts with (path -> UTF-8 text: a repo task's
    repository); at the end the rollout side exports their diff as the `diff` artifact.
    Never hidden content. Absent on the wire = none."""
    workspace_ref: BlobRef | None = None
    """The same public repository as a payload object (`bus.payloads.pack_files`: a msgpack map
    path -> text) when it is too large to travel inline (the domain's `max_workspace_bytes`);
    `workspace` is then empty on the wire and the rollout side fills it from the object
    (sha256-checked) before the episode's sandbox opens. Absent on the wire = none."""


class Turn(BaseModel):
    """One turn of an episode (immutable)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
    role: Literal["prompt", "assistant", "tool"]
    """`prompt` = context fed in, `assistant` = model-generated, `tool` = environment output."""
    text: str
    """Decoded text of the turn."""
    token_ids: PackedI32 = b""
    """Packed int32 token ids."""
    logprobs: PackedF32 = b""
    """Packed float32 behaviour log-probs, one per token (assistant turns)."""
    trainable: bool = False
    """True for model tokens the loss applies to; False for prompt/tool tokens."""
    policy_version: int = -1
    """Weight version that produced this turn (-1 for non-model turns)."""


class ToolCall(BaseModel):
    """One tool call of an episode and what its execution returned (immutable)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
    turn: int
    """Index in `Trajectory.turns` of the assistant turn that made the call."""
    tool: str
    """Tool name (`python`, `run_tests`, ...)."""
    code: str
    """The call's argument as the model wrote it (e.g. the program text)."""
    exec_id: str = ""
    """Id of the recorded execution on the sandbox side (tool-result integrity)."""
    exit_code: int = 0
    """Exit code of the execution (-1 for a refused call: see `error`)."""
    timed_out: bool = False
    """The execution hit its time limit."""
    oom: bool = False
    """The execution ran out of memory."""
    truncated: bool = False
    """Output was capped."""
    duration_ms: float = 0.0
    """Wall time of the execution."""
    error: str = ""
    """Why the call was refused without running (`schemas.tool_protocol.ERROR_KINDS`:
    `malformed_json`, `unknown_tool`, `bad_arguments`), "" for a call that ran. A refused
    call has no exec_id and exit_code -1; the model got a structured error observation."""


FinishReason = Literal["stop", "length", "max_turns", "error"]
"""Why an episode ended: the model stopped, hit max_tokens, hit max_turns, or failed."""


class Trajectory(Message):
    """One sampled episode for one task (immutable once built)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
    KIND: ClassVar[str] = "trajectory"

    def __eq__(self, other: object) -> bool:
        """Equal when the fields are (the cached wire map does not count)."""
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    task_id: str
    """The task's `task_id`."""
    task_msg_id: str
    """The task message's `msg_id` (for per-message accounting)."""
    domain: str
    """Domain name."""
    difficulty: int = 1
    """Difficulty of the task."""
    purpose: Purpose = "train"
    """Copied from the task."""
    group_id: str
    """Samples of one task share it."""
    group_size: int
    """Expected samples in the group."""
    sample_index: int
    """0..group_size-1."""
    turns: list[Turn]
    """The episode, in order."""
    verifier: str
    """Verifier name, copied from the task."""
    verifier_params: dict[str, Any] = Field(default_factory=dict)
    """Public verifier parameters, copied from the task."""
    reward_weights: RewardWeights = Field(default_factory=dict)
    """Copied from the task (empty: the verifier's default weights)."""
    hidden_ref: str | None = None
    """Copied from the task."""
    pool: str = "short"
    """Copied from the task (its duration pool)."""
    tool_format: Literal["tags", "json"] = "tags"
    """Copied from the task (how its tool calls and observations are written)."""
    finish_reason: FinishReason = "stop"
    """Why the episode ended."""
    final_text: str = ""
    """The answer the verifier scores (last assistant text, or an artifact)."""
    policy_version: int
    """Weight version of the last assistant turn."""
    generate_seconds: float = 0.0
    """Wall time spent generating (shared batch time / samples)."""
    tokens: int = 0
    """Generated tokens in this episode."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Every tool call of the episode with its execution result, in order."""
    artifacts: dict[str, bytes] = Field(default_factory=dict)
    """Final files exported from the episode's sandbox (path -> bytes), for verifiers such as `files`."""
    artifact_refs: dict[str, BlobRef] = Field(default_factory=dict)
    """Artifacts too large to travel inline (over `rollout.artifact_inline_bytes`: a repo episode's
    diff), by reference; a name is here or in `artifacts`, never both. The verifier worker puts
    them into `artifacts` (sha256-checked) before its verifier runs. Absent on the wire = none."""

    @model_validator(mode="after")
    def _artifact_once(self):
        both = sorted(set(self.artifacts) & set(self.artifact_refs))
        if both:
            raise ValueError(f"artifacts {both} are both inline and by reference")
        return self

    @classmethod
    def from_task(
        cls,
        task: Task,
        sample_index: int,
        turns: list[Turn],
        *,
        finish_reason: FinishReason = "stop",
        generate_seconds: float = 0.0,
        tool_calls: list[ToolCall] | None = None,
        artifacts: dict[str, bytes] | None = None,
        artifact_refs: dict[str, BlobRef] | None = None,
    ) -> Trajectory:
        """Sample `sample_index` of `task`, fields copied; final_text, version (-1: none), tokens from the answers."""
        model = [t for t in turns if t.role == "assistant"] or [Turn(role="assistant", text="")]
        return cls(
            run_id=task.run_id,
            msg_id=f"{task.msg_id}-{sample_index}",
            task_id=task.task_id,
            task_msg_id=task.msg_id,
            domain=task.domain,
            difficulty=task.difficulty,
            purpose=task.purpose,
            group_id=task.msg_id,
            group_size=task.group_size,
            sample_index=sample_index,
            turns=turns,
            verifier=task.verifier,
            verifier_params=task.verifier_params,
            reward_weights=task.reward_weights,
            hidden_ref=task.hidden_ref,
            pool=task.pool,
            tool_format=task.tool_format,
            finish_reason=finish_reason,
            final_text=model[-1].text,
            policy_version=model[-1].policy_version,
            generate_seconds=generate_seconds,
            tokens=sum(len(t.token_ids) // 4 for t in model),
            tool_calls=tool_calls or [],
            artifacts=artifacts or {},
            artifact_refs=artifact_refs or {},
        )


class Reward(Message):
    """A scored trajectory."""

    KIND: ClassVar[str] = "reward"
    trajectory: Trajectory
    """The scored trajectory (embedded, so the learner needs nothing else)."""
    reward: float
    """Scalar reward after composition."""
    components: dict[str, float] = Field(default_factory=dict)
    """Named reward components."""
    status: VerifierStatus = "ok"
    """Verifier outcome."""
    details: str = ""
    """Short verifier log (truncated)."""
    verify_seconds: float = 0.0
    """Time spent verifying."""
    sandbox_seconds: float = 0.0
    """Wall time the verifier spent in sandboxes (container hand-out, writes and runs; 0 for a
    verifier that runs none). The episode's own sandbox time is in `trajectory.tool_calls`."""


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
