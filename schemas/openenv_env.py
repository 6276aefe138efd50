"""OpenEnv environments as rlbus sees them: the spec a task carries and the record an episode leaves.

An OpenEnv environment is a server (the `openenv` package's app factory) that speaks a
WebSocket protocol: `reset` / `step` / `state` / `close`, each message answered with an
observation (`observation`, `reward`, `done`) or an error. MCP environments also answer the
actions `list_tools` and `call_tool` (tools/list and tools/call, routed through `step`, so a
tool call is rewarded like any step). rlbus owns the loop: the domain (`producers.domains.openenv`)
publishes tasks whose public `verifier_params["openenv"]` is an `EnvSpec`; the rollout side
(`rollout_workers.openenv_session`) holds one session per episode and writes what the
environment answered as an `EpisodeRecord` into the trajectory's `RECORD_ARTIFACT`; the
`openenv` verifier (`verifier_workers.verifiers.openenv`) scores that record.

This module is shared by the three (the layer both import); it imports nothing but pydantic.

Guarantees:
- `EnvSpec.from_params` accepts exactly the documented fields: exactly one of `url` (http,
  https, ws or wss) and `docker_image`; `mode = "mcp"` needs the task's `tool_format = "json"`
  (checked by the domain). Anything else is a ValueError that names the field and the fix.
- `is_openenv(task)` is true exactly when the task carries such a spec (whatever verifier
  scores it), so the rollout side runs it in its environment.
- `EpisodeRecord` is written only by the rollout worker, never from the policy's text; its
  rewards are finite numbers or None (a step that gave no reward).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SPEC_KEY = "openenv"
"""The key of a task's `verifier_params` that holds its `EnvSpec`."""
RECORD_ARTIFACT = "openenv"
"""The trajectory artifact the rollout worker writes the episode's `EpisodeRecord` to (JSON)."""
TEXT_STEP = "step"
"""The tool name recorded for a text-mode action (the model's turn, sent as the action)."""


class EnvSpec(BaseModel):
    """Where an episode's environment is and how the policy acts in it (public: no secrets)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    url: str = ""
    """The environment server's base URL (`http://host:8000`; ws/wss accepted)."""
    docker_image: str = ""
    """An image serving the environment on port 8000: the rollout side starts one container per
    episode (the package's `LocalDockerProvider`) and removes it when the episode ends."""
    mode: Literal["text", "mcp"] = "text"
    """`text`: each model turn is the action `{action_field: turn text}`; `mcp`: the tools from
    tools/list are declared to the model and its json tool calls are tools/call steps."""
    action_field: str = "message"
    """Text mode: the action field that receives the model's turn."""
    observation_field: str = ""
    """The observation field shown to the model ("": the whole observation as JSON)."""
    reset: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the episode's `reset` (e.g. `{"seed": 7}`): every sample of a task
    starts from the same state when the environment honours them."""
    observe_reset: bool = True
    """Append `reset()`'s observation to the prompt as a user turn."""
    tools: tuple[str, ...] = ()
    """MCP mode: the tools offered (empty: every tool tools/list names)."""
    connect_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds to open the WebSocket."""
    step_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds to wait for any answer (reset, step, state)."""
    ready_timeout_s: float = Field(default=60.0, gt=0)
    """`docker_image`: seconds for the container's /health to answer."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"url {v!r} must start with http://, https://, ws:// or wss://")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _one_place(self):
        if bool(self.url) == bool(self.docker_image):
            raise ValueError('give exactly one of url = "http://host:port" and docker_image = "image:tag"')
        if self.mode == "text" and not self.action_field:
            raise ValueError("text mode needs action_field: the action field that receives the model's turn")
        return self

    @classmethod
    def from_params(cls, params: dict[str, Any], where: str = "openenv") -> EnvSpec:
        """The spec of `params` (ValueError naming `where` and the first bad field)."""
        try:
            return cls.model_validate(params)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "spec"
            raise ValueError(f"{where}: {field}: {first['msg']}") from None

    @property
    def http_url(self) -> str:
        """The base URL as http(s), for the server's HTTP routes (`/schema`, `/health`)."""
        return self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)


def env_spec(task) -> EnvSpec:
    """The `EnvSpec` a task carries (ValueError when it has none or a bad one)."""
    raw = task.verifier_params.get(SPEC_KEY)
    if not isinstance(raw, dict):
        raise ValueError(f"task {task.task_id} carries no verifier_params[{SPEC_KEY!r}] environment spec")
    return EnvSpec.from_params(raw, f"task {task.task_id}: verifier_params.{SPEC_KEY}")


def is_openenv(task) -> bool:
    """Whether `task` runs in an OpenEnv environment (its `verifier_params` carry an `EnvSpec`)."""
    return isinstance(task.verifier_params.get(SPEC_KEY), dict)


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ValueError(f"reward {v!r} is not a finite number")
    return v


class StepRecord(BaseModel):
    """One action the environment answered."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tool: str
    """`step` (text mode) or the MCP tool called."""
    reward: float | None = None
    """`observation.reward` (None: the environment gave none)."""
    done: bool = False
    """`observation.done`."""

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, v: float | None) -> float | None:
        return _finite(v)


class EpisodeRecord(BaseModel):
    """What one episode's environment session answered, in order (the `openenv` verifier's input)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    task_id: str
    sample_index: int
    episode_id: str | None = None
    """The environment's own `state().episode_id` after reset."""
    reset_reward: float | None = None
    """`reset()`'s `observation.reward` (not part of the episode's return)."""
    steps: list[StepRecord] = Field(default_factory=list)
    done: bool = False
    """The environment said the episode is over."""

    @field_validator("reset_reward")
    @classmethod
    def _finite_reset(cls, v: float | None) -> float | None:
        return _finite(v)

    def to_bytes(self) -> bytes:
        """The artifact's bytes (JSON)."""
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> EpisodeRecord:
        """The record of an artifact (pydantic ValidationError when it is not one)."""
        return cls.model_validate_json(raw)
