"""One OpenEnv environment session per episode, used by the agent loop (`rollout_workers.agent`).

A task that carries an `EnvSpec` (`schemas.openenv_env`: `verifier_params["openenv"]`) runs in
its environment server instead of a sandbox, through the `openenv` package's own WebSocket
client (`GenericEnvClient`: `reset` / `step` / `state` / `close`); rlbus owns the loop.

Guarantees:
- One session per episode, opened before the episode's first turn (its prompt needs it):
  one WebSocket, for which the server makes one environment; it is reset with the task's
  `reset` kwargs, and `state()` names the environment's episode. With `docker_image` the
  episode first starts its own container (the package's `LocalDockerProvider`). `close()`
  sends `close`, closes the socket and removes that container; it never raises.
- The episode's prompt is the task's prompt, then (`observe_reset`) `reset()`'s observation
  as a user turn. MCP mode (`mode = "mcp"`): tools/list (`list_tools`) gives the tools, declared
  to the chat template as function specs (`tools=`); `EnvSpec.tools` narrows them.
- Each model turn acts (`act`): in text mode the turn's text (stripped) is the action
  `{action_field: text}`; in MCP mode its first `<tool_call>{"name", "arguments"}</tool_call>`
  is a tools/call (`call_tool` step), checked first against the tool's listed input schema (a
  malformed call, an unknown tool or bad arguments runs nothing: the loop's structured error
  observation, as for json calls); an MCP turn without a call ends the episode. The turn that
  reaches `max_turns` still acts, then the episode ends.
- Every step's `observation.reward` and `observation.done` are recorded, in order, in an
  `EpisodeRecord` (`record()`: the trajectory's `openenv` artifact, the `openenv` verifier's
  input); `done` ends the episode. The observation shown to the model is its `observation_field`
  (or the whole observation as JSON; a tool call's text content), clipped head + tail to the
  loop's caps, with anything that looks like a sandbox observation tag (`<obs`) escaped, so it
  can never pass for a recorded execution.
- Infrastructure, never an outcome (raised as the loop's `SandboxUnavailable`: the worker
  retries the task, then dead-letters it; never a reward of 0): a session that cannot open, a
  dropped connection, no answer within `step_timeout_s`, any error answer of the server
  (`EXECUTION_ERROR`, `SESSION_ERROR`, `CAPACITY_REACHED`, ...), a reward that is not a finite
  number, an MCP environment that lists no tools, a text-mode `action_field` the environment's
  action schema (`/schema`) does not have. The one exception: the environment refusing a text
  action as invalid for its schema (`VALIDATION_ERROR` on a text step) is the policy's doing;
  the model sees `{"error": "bad_action", ...}` and the step records no reward.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from typing import Any

import structlog

from rollout_workers.agent import SandboxUnavailable
from sandbox_workers.async_sandbox import Observation
from sandbox_workers.base import ExecResult
from schemas import ChatMessage, Task, Turn, pack_i32
from schemas.chat import prompt_input, prompt_text, tokenizer_of
from schemas.openenv_env import TEXT_STEP, EnvSpec, EpisodeRecord, StepRecord, env_spec, is_openenv
from schemas.tool_protocol import Call, declared_tools, parse_call

log = structlog.get_logger()

_TAG_LIKE = re.compile(r"<(\s*/?\s*obs)", re.IGNORECASE)
_CODE = re.compile(r"\(code: ([A-Z_]+)\)\s*$")
DEFAULT_OBS_CHARS = 4000
_checked_actions: set[tuple[str, str]] = set()


class EnvUnavailable(SandboxUnavailable):
    """The environment could not be reached or answered with an error (retry the task)."""


def _safe(text: str) -> str:
    return _TAG_LIKE.sub(r"&lt;\1", text)


def _clip(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    head, tail = limit // 2, limit - limit // 2
    return f"{text[:head]}…[{len(text) - head - tail} chars cut]…{text[-tail:]}", True


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _reward(value: Any) -> float | None:
    """An observation's reward as a float (None: none given); anything else is a server fault."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
        return float(value)
    raise EnvUnavailable(f"the environment answered a reward that is not a finite number: {value!r}")


def server_code(exc: BaseException) -> str:
    """The error code of the package client's `Server error: ... (code: CODE)`, else ""."""
    m = _CODE.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return m.group(1) if m else ""


def _hint(exc: BaseException, what: str = "") -> str:
    """Why a failure may have happened, when its kind says: a full server (it answers
    CAPACITY_REACHED, or closes a new session before the first answer can be read)."""
    closed_at_once = what == "reset" and type(exc).__name__.startswith("ConnectionClosed")
    if server_code(exc) == "CAPACITY_REACHED" or closed_at_once:
        return (
            f" ({'the server has no free session' if not closed_at_once else 'a full server does this'}: "
            "each episode holds one session, so it must accept rollout.batch_tasks x group_size sessions per "
            "rollout worker; raise its max_concurrent_envs)"
        )
    return ""


class OpenEnvEpisode:
    """The environment session of one episode (module guarantees)."""

    def __init__(self, task: Task, sample_index: int, spec: EnvSpec) -> None:
        self.task, self.sample_index, self.spec = task, sample_index, spec
        self.client = None
        self.provider = None
        self.base_url = spec.http_url
        self.messages: list[ChatMessage] = list(task.prompt)
        self.tool_specs: list[dict] | None = None
        self.schemas: dict[str, dict] = {}
        self.steps: list[StepRecord] = []
        self.episode_id: str | None = None
        self.reset_reward: float | None = None
        self.done = False

    @property
    def where(self) -> str:
        return f"openenv {self.spec.docker_image or self.spec.url} (task {self.task.task_id})"

    @classmethod
    async def open(cls, task: Task, sample_index: int) -> OpenEnvEpisode:
        """Open, reset and (MCP) list the tools of the episode's session; closed again on failure."""
        ep = cls(task, sample_index, env_spec(task))
        try:
            await ep._start()
        except BaseException:
            await ep.close()
            raise
        return ep

    async def _start(self) -> None:
        from openenv.core.generic_client import GenericEnvClient

        spec = self.spec
        if spec.docker_image:
            await self._start_container()
        if spec.mode == "text":
            await self._check_action()
        self.client = GenericEnvClient(
            self.base_url, connect_timeout_s=spec.connect_timeout_s, message_timeout_s=spec.step_timeout_s
        )
        first = await self._ask("reset", self.client.reset(**spec.reset))
        if first.done:
            raise EnvUnavailable(f"{self.where}: reset() answered done: the environment cannot start an episode")
        self.reset_reward = _reward(first.reward)
        state = await self._ask("state", self.client.state())
        self.episode_id = None if state.get("episode_id") is None else str(state["episode_id"])
        if spec.observe_reset:
            self.messages.append(ChatMessage(role="user", content=_safe(self._text(first.observation))))
        if spec.mode == "mcp":
            await self._list_tools()

    async def _start_container(self) -> None:
        try:
            self.provider = await asyncio.to_thread(_provider())
            self.base_url = await asyncio.to_thread(self.provider.start_container, self.spec.docker_image)
            await asyncio.to_thread(self.provider.wait_for_ready, self.base_url, self.spec.ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise EnvUnavailable(f"{self.where}: the environment's container did not start: {exc}") from exc

    async def _check_action(self) -> None:
        """Refuse a text-mode `action_field` the environment's action schema lacks (a silent 0 otherwise)."""
        key = (self.spec.docker_image or self.spec.url, self.spec.action_field)
        if key in _checked_actions:
            return
        import httpx

        try:
            async with httpx.AsyncClient(timeout=self.spec.connect_timeout_s) as http:
                r = await http.get(f"{self.base_url}/schema")
                r.raise_for_status()
                action = r.json().get("action") or {}
        except (httpx.HTTPError, ValueError) as exc:
            raise EnvUnavailable(f"{self.where}: GET /schema failed: {type(exc).__name__}: {exc}") from exc
        fields, required = set(action.get("properties") or {}), set(action.get("required") or [])
        if self.spec.action_field not in fields:
            raise EnvUnavailable(
                f"{self.where}: action_field {self.spec.action_field!r} is not a field of the environment's "
                f"action {sorted(fields)}: set params.action_field to the one that takes the model's text"
            )
        if required - {self.spec.action_field}:
            raise EnvUnavailable(
                f"{self.where}: the environment's action also requires {sorted(required - {self.spec.action_field})}, "
                f"but a text action fills only {self.spec.action_field!r}: use mode = 'mcp' or another environment"
            )
        _checked_actions.add(key)

    async def _ask(self, what: str, pending):
        """The answer of one request; every failure is the environment's (EnvUnavailable)."""
        try:
            return await pending
        except EnvUnavailable:
            raise
        except Exception as exc:  # the environment's edge: a dropped socket, a timeout, an error answer
            raise EnvUnavailable(f"{self.where}: {what} failed: {type(exc).__name__}: {exc}{_hint(exc, what)}") from exc

    async def _list_tools(self) -> None:
        import jsonschema

        res = await self._ask("tools/list", self.client.step({"type": "list_tools"}))
        listed = res.observation.get("tools") if isinstance(res.observation, dict) else None
        if not isinstance(listed, list) or not listed:
            raise EnvUnavailable(
                f"{self.where}: list_tools answered no tools: not an MCP environment? (set params.mode = 'text')"
            )
        names = [str(t.get("name")) for t in listed]
        unknown = sorted(set(self.spec.tools) - set(names))
        if unknown:
            raise EnvUnavailable(
                f"{self.where}: params.tools names {unknown}, which the environment does not list {names}"
            )
        specs = []
        for t in listed:
            if self.spec.tools and t["name"] not in self.spec.tools:
                continue
            schema = t.get("input_schema") or t.get("inputSchema") or {"type": "object"}
            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise EnvUnavailable(
                    f"{self.where}: tool {t['name']!r} lists an invalid input schema: {exc.message}"
                ) from None
            self.schemas[t["name"]] = schema
            fn = {"name": t["name"], "description": str(t.get("description") or ""), "parameters": schema}
            specs.append({"type": "function", "function": fn})
        self.tool_specs = specs

    def prompt(self) -> tuple[list[ChatMessage], list[dict] | None]:
        """(messages, tool specs) of the episode's first turn."""
        return self.messages, self.tool_specs

    def act(self, ep, text: str, has_call: bool, finish_reason: str) -> Call | None:
        """The action of the model turn `text` of episode `ep`, or None when the episode ends
        without one (MCP: no call); the turn that reaches `max_turns` still acts, then it ends."""
        if self.spec.mode == "text":
            action = text.strip()
            call = Call(TEXT_STEP, action, text, len(text), args={self.spec.action_field: action})
        else:
            call = self._tool_call(text) if has_call else None
            if call is None:
                ep.done, ep.finish_reason = True, finish_reason
                return None
        if ep.model_turns >= ep.task.max_turns:
            ep.done, ep.finish_reason = True, "max_turns"
        return call

    def _tool_call(self, text: str) -> Call | None:
        """The turn's first json call, checked against the listed tools (a refused one has `error`)."""
        import jsonschema

        found = parse_call(text, "json", [])  # its name is checked here, against the session's tools
        if found is None or found.error == "malformed_json":
            return found
        raw, end = found.raw, found.end
        obj = json.loads(raw)
        name, args = obj["name"], obj.get("arguments")
        if name not in self.schemas:
            return Call(
                name, "", raw, end, "unknown_tool", f"no tool named {name!r}; available: {sorted(self.schemas)}"
            )
        if not isinstance(args, dict):
            return Call(name, "", raw, end, "bad_arguments", 'missing "arguments" (an object)')
        problems = sorted(
            jsonschema.Draft202012Validator(self.schemas[name]).iter_errors(args), key=lambda e: list(e.absolute_path)
        )
        if problems:
            where = "arguments" + "".join(f"[{p!r}]" for p in problems[0].absolute_path)
            return Call(name, "", raw, end, "bad_arguments", f"{where}: {problems[0].message}")
        return Call(name, _json(args), raw, end, args=dict(args))

    async def run(self, call: Call, timeout: float | None, caps: tuple[int, int] | None) -> Observation:
        """Step the environment with `call` (not a refused one); the observation for the model.
        `timeout` is the loop's sandbox timeout, unused: each answer has `step_timeout_s`."""
        t0 = time.monotonic()
        if call.tool == TEXT_STEP:
            payload: dict = {self.spec.action_field: call.code}
        else:
            payload = {"type": "call_tool", "tool_name": call.tool, "arguments": call.args}
        try:
            res = await self.client.step(payload)
        except RuntimeError as exc:
            if call.tool == TEXT_STEP and server_code(exc) == "VALIDATION_ERROR":  # the policy's action, refused
                return self._observe(_json({"error": "bad_action", "message": str(exc)}), 1, t0, caps)
            raise EnvUnavailable(f"{self.where}: step failed: {exc}{_hint(exc)}") from exc
        except Exception as exc:  # a dropped socket or no answer: the environment's, never the policy's
            raise EnvUnavailable(f"{self.where}: step failed: {type(exc).__name__}: {exc}") from exc
        self.steps.append(StepRecord(tool=call.tool, reward=_reward(res.reward), done=bool(res.done)))
        self.done = self.done or bool(res.done)
        obs = res.observation if isinstance(res.observation, dict) else {"observation": res.observation}
        if call.tool == TEXT_STEP:
            return self._observe(self._text(obs), 0, t0, caps)
        text, failed = _tool_text(obs)
        return self._observe(text, 1 if failed else 0, t0, caps)

    def _text(self, obs: dict) -> str:
        field = self.spec.observation_field
        if field and field in obs:
            value = obs[field]
            return value if isinstance(value, str) else _json(value)
        return _json(obs)

    def _observe(self, text: str, exit_code: int, t0: float, caps: tuple[int, int] | None) -> Observation:
        text, cut = _clip(text, caps[0] if caps else DEFAULT_OBS_CHARS)
        text = _safe(text)
        ms = (time.monotonic() - t0) * 1000
        return Observation(ExecResult(exit_code=exit_code, stdout=text, stderr="", truncated=cut, duration_ms=ms), text)

    def record(self) -> bytes:
        """The episode's `EpisodeRecord` (the trajectory's `openenv` artifact)."""
        rec = EpisodeRecord(
            task_id=self.task.task_id,
            sample_index=self.sample_index,
            episode_id=self.episode_id,
            reset_reward=self.reset_reward,
            steps=list(self.steps),
            done=self.done,
        )
        return rec.to_bytes()

    async def close(self) -> None:
        """Send `close`, close the socket, remove the episode's container (best effort, never raises)."""
        client, self.client = self.client, None
        provider, self.provider = self.provider, None
        if client is not None:
            await client.disconnect()  # the package's: sends `close`, swallows a socket already gone
        if provider is not None:
            try:
                await asyncio.to_thread(provider.stop_container)
            except Exception as exc:  # noqa: BLE001 - cleanup must not mask the episode's outcome
                log.warning("openenv.container_stop_failed", image=self.spec.docker_image, error=str(exc)[:300])


def _provider():
    """The package's `LocalDockerProvider`, its container names made unique: it names them
    `<image>-<milliseconds>`, which collide when a group's episodes start together."""
    from openenv.core.containers.runtime import LocalDockerProvider

    class Provider(LocalDockerProvider):
        def _generate_container_name(self, image: str) -> str:
            return f"{super()._generate_container_name(image)}-{uuid.uuid4().hex[:8]}"

    return Provider


def _tool_text(obs: dict) -> tuple[str, bool]:
    """(text, failed) of a `call_tool` observation: its error, else its result's text content."""
    err = obs.get("error")
    if err:
        info = err if isinstance(err, dict) else {"message": str(err)}
        body = {"error": str(info.get("error_type") or "tool_error"), "tool": obs.get("tool_name"), **info}
        body.pop("error_type", None)
        return _json(body), True
    result = obs.get("result")
    if isinstance(result, dict):
        texts = [
            c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"
        ]
        if texts:
            return "\n".join(texts), bool(result.get("is_error"))
        if "data" in result:
            return _json(result["data"]), bool(result.get("is_error"))
    return (result if isinstance(result, str) else _json(result)), False


async def first_turn(
    engine, episodes: list, slots: asyncio.Semaphore, max_tokens: int, temperature: float, inflight=None
):
    """Open the session of every openenv episode of a batch (at most `slots` opening at once), then
    generate every episode's first turn from its own prompt (other tasks' episodes: the task's
    prompt); each episode's prompt turn and context are set. (samples, generate seconds per episode).
    `inflight`: the turn in chunks with new weights between them (`rollout_workers.inflight`).
    A session that fails raises SandboxUnavailable (the caller closes those that opened)."""

    async def open_one(ep) -> None:
        async with slots:
            ep.sandbox = await OpenEnvEpisode.open(ep.task, ep.sample_index)

    opened = await asyncio.gather(*(open_one(ep) for ep in episodes if is_openenv(ep.task)), return_exceptions=True)
    failed = [x for x in opened if isinstance(x, BaseException)]
    if failed:
        exc = failed[0]
        if isinstance(exc, SandboxUnavailable):
            raise exc
        raise SandboxUnavailable(f"openenv session failed: {type(exc).__name__}: {exc}") from exc
    tok = tokenizer_of(engine)
    views = [
        ep.sandbox.prompt()
        if is_openenv(ep.task)
        else (ep.task.prompt, declared_tools(ep.task.tool_format, ep.task.tools))
        for ep in episodes
    ]
    t0 = time.perf_counter()
    inputs = [prompt_input(tok, messages, tools) for messages, tools in views]
    from rollout_workers.inflight import generate_turn

    groups = await generate_turn(engine, inputs, 1, max_tokens, temperature, inflight)
    each = (time.perf_counter() - t0) / max(1, len(episodes))
    for ep, (messages, tools), group in zip(episodes, views, groups, strict=True):
        s = group[0]
        ep.context = [int(x) for x in s.prompt_ids]
        ep.turns = [Turn(role="prompt", text=prompt_text(tok, messages, tools), token_ids=pack_i32(s.prompt_ids))]
    return [g[0] for g in groups], each
