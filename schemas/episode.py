"""The messages of one episode: the `Task` a policy answers, the `Trajectory` it sampled, the
`Reward` a verifier gave it, and their parts (chat messages, turns, tool calls).

Guarantees:
- `Trajectory.from_task` builds every trajectory: msg_id `<task msg_id>-<sample index>`,
  group_id its task's, the task's fields copied.
- A `Trajectory` is immutable once built; an artifact travels inline (`artifacts`) or by
  reference (`artifact_refs`), never both.
- `render_prompt` is the only rendering of a chat prompt to the text it is generated from.
- Reward weights are finite numbers (ints allowed, bools and strings not).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.envelope import Message, PackedF32, PackedI32
from schemas.payload_ref import BlobRef

Purpose = Literal["train", "eval"]
VerifierStatus = Literal[
    "ok",
    "infra_error",
    "tamper",
    "invalid",
    "answer_limit",
    "timeout",
    "no_reward_file",
    "bad_reward_file",
    "storage_exceeded",
    "harness_error",
]
"""`answer_limit`: the answer ran into the answer pool's limits (`verifier_workers.answer_pool`), reward 0.
`harness_error`: an agent harness crashed after the policy acted (`schemas.agent_task`), reward 0."""

RewardWeights = dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False)]]
"""Component name -> finite weight (ints allowed, bools and strings not)."""


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
    """Weight version that produced this turn (-1 for non-model turns); with `version_runs`, its last run's."""
    version_runs: list[tuple[int, int]] = Field(default_factory=list)
    """An assistant turn generated with weight updates in flight (`rollout.inflight`): the
    versions that made its tokens, `[(version, n_tokens), ...]` in token order, covering exactly
    its `token_ids`. Empty (absent on the wire): every token is from `policy_version`."""

    @model_validator(mode="after")
    def _runs_cover_tokens(self):
        if self.version_runs:
            n = len(self.token_ids) // 4
            if any(v < 0 or k < 1 for v, k in self.version_runs):
                raise ValueError(f"version_runs {self.version_runs}: versions must be >= 0, lengths >= 1")
            if sum(k for _, k in self.version_runs) != n:
                raise ValueError(
                    f"version_runs {self.version_runs} cover {sum(k for _, k in self.version_runs)} tokens, the turn has {n}"
                )
            if self.policy_version != self.version_runs[-1][0]:
                raise ValueError(
                    f"policy_version {self.policy_version} is not the last run's version {self.version_runs[-1][0]}"
                )
        return self

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that made a token of this turn (-1 for non-model turns)."""
        return min(v for v, _ in self.version_runs) if self.version_runs else self.policy_version


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


FinishReason = Literal["stop", "length", "max_turns", "error", "timeout"]
"""Why an episode ended: the model stopped, hit max_tokens, hit max_turns, failed, or ran past
its wall-time limit (a Harbor task's `[agent].timeout_sec`)."""


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
    drift: int = 0
    """Harness-owned episodes (`rollout_workers.endpoint`): calls whose re-rendered history did not
    start with the ids recorded so far (retokenization, an edited history). The recorded ids were
    kept (token in, token out); this counts how often the harness's view differed."""
    artifact_refs: dict[str, BlobRef] = Field(default_factory=dict)
    """Artifacts too large to travel inline (over `rollout.artifact_inline_bytes`: a repo episode's
    diff), by reference; a name is here or in `artifacts`, never both. The verifier worker puts
    them into `artifacts` (sha256-checked) before its verifier runs. Absent on the wire = none."""

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that made any model token of the episode (every assistant
        turn's every version run; -1 when none recorded one): what staleness counts from."""
        versions = [t.oldest_version for t in self.turns if t.role == "assistant" and t.oldest_version >= 0]
        return min(versions) if versions else self.policy_version

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
