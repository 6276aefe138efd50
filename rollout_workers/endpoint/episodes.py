"""Episodes a harness drives through the endpoint: one bearer key each, and what their calls record.

Guarantees:
- `EpisodeTable.open(task, sample_index)` mints a fresh key (`secrets.token_urlsafe(32)`); the
  table keeps only its sha256, so a key is looked up without comparing secrets byte by byte.
  More than `max_episodes` open at once raises `TooManyEpisodes` (HTTP 429). An unknown or
  missing key raises `Unauthorized` (401); a key whose episode ended raises `EpisodeEnded` (409).
  A key reaches exactly one episode: two episodes' calls never share a record.
- Every call records, token in, token out: the first call's rendered prompt ids are the
  `prompt` turn; each later call's re-rendered history is compared with the ids recorded so
  far. When it starts with them, its new tail is appended as context. When it does not
  (retokenization drift, a harness that edited its history), the recorded ids are kept, the
  new messages alone are rendered after them (`schemas.chat` framing), and `drift` counts it.
  The engine always generates from exactly the recorded context.
- The generated ids of the choice the harness continued with (matched by the message it sends
  back; else the first) become a trainable `assistant` turn with one behaviour log-prob per
  id and the weight version that generated it.
- Limits end the episode, which is still verified: past `episode_timeout_s` (`timeout`), or when
  the token budget or the context limit leaves no room for one more token (`length`).
  `max_tokens` is capped to what both leave.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from schemas import Task, Trajectory, Turn, pack_f32, pack_i32

CALLS_ARTIFACT = "endpoint_calls"
"""Trajectory artifact: one JSON record per call (token counts, version, drift, timings)."""


class EndpointRefusal(Exception):
    """A request the endpoint refuses; `status` is its HTTP status, `code` the OpenAI error code."""

    status, code = 400, "invalid_request_error"


class Unauthorized(EndpointRefusal):
    status, code = 401, "invalid_api_key"


class EpisodeEnded(EndpointRefusal):
    status, code = 409, "episode_ended"


class TooManyEpisodes(EndpointRefusal):
    status, code = 429, "too_many_episodes"


class ContextExhausted(EndpointRefusal):
    """The episode has no room left (context limit or token budget): it ended with `length`."""

    status, code = 400, "context_length_exceeded"


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Pending:
    """The choices of the last call, until the next call (or the end) says which one was kept."""

    samples: list
    messages: list[dict]
    version: int


@dataclass
class EndpointEpisode:
    """The record of one harness-driven episode (see the module guarantees)."""

    task: Task
    sample_index: int
    deadline: float
    token_budget: int
    context_limit: int
    turns: list[Turn] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    drift: int = 0
    tokens: int = 0
    generate_seconds: float = 0.0
    calls: list[dict] = field(default_factory=list)
    pending: Pending | None = None
    finish_reason: str = ""
    """"" while open; then why it ended (`stop`, `length`, `timeout`, `error`)."""
    sent: list[dict] = field(default_factory=list)
    """The messages of the last chat call (what the next call's new messages are told from)."""
    call_tokens: int | None = None
    """Most tokens one call may generate (the agent kind: the domain's `max_tokens`); None: no cap."""
    infra_error: str = ""
    """Why the engine failed a call of this episode ("" when none did): not the policy's doing."""

    @property
    def ended(self) -> bool:
        return bool(self.finish_reason)

    def room(self, max_tokens: int) -> int:
        """Tokens the next call may generate, or 0 (then the episode ends with `length`)."""
        return max(0, min(max_tokens, self.token_budget - self.tokens, self.context_limit - len(self.context)))

    def settle(self, sent: list[dict] | None, tokenizer) -> None:
        """Commit the pending choice the harness continued with (its assistant message in `sent`)."""
        if self.pending is None:
            return
        pick = 0
        if sent is not None:
            for i, msg in enumerate(self.pending.messages):
                if _same_message(msg, sent):
                    pick = i
                    break
        s = self.pending.samples[pick]
        ids = [int(x) for x in s.token_ids]
        self.turns.append(
            Turn(
                role="assistant",
                text=tokenizer.decode(ids),
                token_ids=pack_i32(np.asarray(ids, dtype=np.int32)),
                logprobs=pack_f32(np.asarray(s.logprobs, dtype=np.float32)),
                trainable=True,
                policy_version=self.pending.version,
            )
        )
        self.context += ids
        self.tokens += len(ids)
        self.pending = None

    def extend(self, rendered: list[int], delta: list[int], tokenizer) -> bool:
        """Add a call's history: `rendered` (the whole re-rendered history) when it starts with
        the recorded ids, else `delta` (its new messages alone, after them). True on drift."""
        if not self.turns:
            self.turns.append(Turn(role="prompt", text=tokenizer.decode(rendered), token_ids=pack_i32(rendered)))
            self.context = list(rendered)
            return False
        drifted = rendered[: len(self.context)] != self.context
        extra = delta if drifted else rendered[len(self.context) :]
        self.drift += drifted
        if extra:
            self.turns.append(Turn(role="tool", text=tokenizer.decode(extra), token_ids=pack_i32(extra)))
            self.context += list(extra)
        return drifted

    def trajectory(self) -> Trajectory:
        """The Trajectory of the episode so far (pending choice 0 counted when not settled)."""
        return Trajectory.from_task(
            self.task,
            self.sample_index,
            self.turns,
            finish_reason=self.finish_reason or "stop",
            generate_seconds=self.generate_seconds,
            artifacts={CALLS_ARTIFACT: json.dumps(self.calls).encode()},
        ).model_copy(update={"drift": self.drift})


def _same_message(ours: dict, sent: list[dict]) -> bool:
    """Whether the harness's last assistant message in `sent` is the reply `ours`."""
    last = next((m for m in reversed(sent) if m.get("role") == "assistant"), None)
    if last is None:
        return False
    return (last.get("content") or "") == (ours.get("content") or "") and _calls(last) == _calls(ours)


def _calls(message: dict) -> list[tuple[str, object]]:
    """(name, arguments as an object) of a message's tool calls, whether arguments travel as JSON text or not."""
    out = []
    for c in message.get("tool_calls") or []:
        args = c["function"]["arguments"]
        out.append((c["function"]["name"], json.loads(args) if isinstance(args, str) else args))
    return out


class EpisodeTable:
    """The open episodes of one endpoint, by key (see the module guarantees). Thread-safe."""

    def __init__(self, max_episodes: int, timeout_s: float, token_budget: int, context_limit: int):
        self.max_episodes, self.timeout_s = max_episodes, timeout_s
        self.token_budget, self.context_limit = token_budget, context_limit
        self._open: dict[str, EndpointEpisode] = {}
        self._ended: dict[str, str] = {}  # key hash -> why (a late call is told, not 401)
        self._lock = threading.Lock()

    def open(self, task: Task, sample_index: int = 0) -> tuple[str, EndpointEpisode]:
        """(key, episode): a new episode of `task`; TooManyEpisodes past `max_episodes`."""
        with self._lock:
            if len(self._open) >= self.max_episodes:
                raise TooManyEpisodes(f"{len(self._open)} episodes open (rollout.endpoint.max_episodes)")
            key = "rlbus-ep-" + secrets.token_urlsafe(32)
            ep = EndpointEpisode(
                task, sample_index, time.monotonic() + self.timeout_s, self.token_budget, self.context_limit
            )
            self._open[key_hash(key)] = ep
            return key, ep

    def get(self, key: str | None) -> EndpointEpisode:
        """The open episode of `key`; Unauthorized, or EpisodeEnded (its timeout included)."""
        if not key:
            raise Unauthorized("missing bearer key: send Authorization: Bearer <the episode's OPENAI_API_KEY>")
        h = key_hash(key)
        with self._lock:
            ep = self._open.get(h)
            if ep is None:
                if h in self._ended:
                    raise EpisodeEnded(f"the episode ended ({self._ended[h]})")
                raise Unauthorized("unknown key: each episode has its own key")
            if time.monotonic() > ep.deadline and not ep.ended:
                ep.finish_reason = "timeout"
            if ep.ended:
                raise EpisodeEnded(f"the episode ended ({ep.finish_reason})")
            return ep

    def episode(self, key: str) -> EndpointEpisode | None:
        """The open episode of `key`, ended or not (its owner's view; None when closed)."""
        with self._lock:
            return self._open.get(key_hash(key))

    def close(self, key: str, tokenizer, reason: str = "stop") -> Trajectory:
        """End the episode of `key` (its pending choice settled) and give its Trajectory."""
        h = key_hash(key)
        with self._lock:
            ep = self._open.pop(h)
            ep.settle(None, tokenizer)
            ep.finish_reason = ep.finish_reason or reason
            self._ended[h] = ep.finish_reason
            return ep.trajectory()

    def __len__(self) -> int:
        return len(self._open)
