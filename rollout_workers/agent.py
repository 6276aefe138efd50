"""Multi-turn agent episodes: generate, run tool calls in the episode's sandbox, repeat.

One call runs every sample of a batch of tasks together, turn by turn:

1. generate the next model turn for every live episode in ONE batched engine call
   (turn 1 shares each task's prompt across its G samples);
2. parse each turn for a tool call in the task's `tool_format` (`schemas.tool_protocol`:
   `<py>...</py>`, or `<tool_call>{json}</tool_call>` with the tools declared in the
   prompt's system turn); the turn's tokens are cut just after the closing tag, with
   their behaviour log-probs;
3. run the calls concurrently, each in its own episode's sandbox (opened on the
   episode's first call, closed when the episode ends), and append the recorded
   observation as a tool turn; a json call that is malformed, names an unknown tool or
   fails its schema runs nothing: its tool turn is the structured error observation and
   its `ToolCall` carries the `error` kind (never a crash, never a silent 0);
4. repeat until a turn without a call (the final answer), `submit()`, `max_turns`, or the
   context budget (`context_budget` tokens, default `MAX_CONTEXT_TOKENS`, never past the
   engine's `max_context`): an episode whose next turn would not fit ends with `length`.

Repository tasks (`Task.workspace`, the `repo` tools of `schemas.tool_protocol`): the
sandbox starts with the repository in its work dir (a task that names it by `workspace_ref`
must be resolved first, `rollout_workers.repo_payloads`; else `run_episodes` raises
ValueError), each tool is one recorded execution (`rollout_workers.repo_tools`), `submit()`
ends the episode (`stop`), and at the end, however it ended (`length` included), the
repository's state is exported as a unified diff against the original into
`artifacts["diff"]` (UTF-8; empty when no sandbox was opened) before the sandbox closes. A
state that cannot be read back raises `SandboxUnavailable` for the batch. (A diff too large
to travel inline is moved to the payload store afterwards, by the rollout worker.)

OpenEnv tasks (an `EnvSpec` in `verifier_params["openenv"]`, `schemas.openenv_env`): each
episode holds one environment session instead of a sandbox, opened before its first turn
(the prompt may carry `reset()`'s observation, and MCP tools are declared from tools/list);
every turn is an action (`rollout_workers.openenv_session`), `done` ends the episode, and the
rewards the environment gave leave as `artifacts["openenv"]`.

Guarantees:
- A trajectory holds every turn's tokens in order; only model tokens are `trainable`
  (the learner's loss mask), prompt and tool tokens are context.
- Each model turn carries the policy version that generated it: `before_turn` may
  hot-load new weights between turns. With `inflight` (`rollout.inflight`,
  `rollout_workers.inflight`) a turn is generated in chunks and new weights may also load
  between its chunks; the turn then records its version runs `[(version, n_tokens), ...]`
  (cut with its tokens after a tool call), its `policy_version` is its last run's, and its
  behaviour log-probs stay per token. Eval tasks (`purpose = "eval"`) never take new weights
  mid-turn: their turns are one engine call each, as without `inflight`.
- Every tool call is listed with its execution result and exec_id (the integrity
  record when the sandbox side records), and files named in
  `verifier_params["export"]` are read from the sandbox as artifacts before it closes.
- Token in, token out: contexts are passed to the engine as token ids, never re-tokenized
  text. Turn 1's context is the task's prompt as `schemas.chat` renders it for the engine's
  tokenizer (its chat template when it has one); a model turn's ids are exactly the
  sampled ids (cut after the call); a tool turn is the observation as the template
  renders a tool message (`schemas.chat.tool_turn`), encoded alone and appended. Nothing
  already in the context is encoded again, so a trajectory's ids are exactly what the
  engine was given and sampled.
- A sandbox that cannot be opened (one refused for lack of isolation included:
  `SandboxRefused`) or dies raises `SandboxUnavailable` (the rollout worker retries the
  task, then dead-letters it; never a reward); a command that fails, hangs or floods is an observation.
- Every sandbox opened is closed, whatever happens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from rollout_workers.harbor_tools import CONTAINER_ARTIFACT, STATE_ARTIFACT, HarborEpisodeBox, is_harbor
from rollout_workers.inflight import Inflight, for_tasks, generate_turn, turn_versions
from schemas import BlobRef, Task, ToolCall, Trajectory, Turn, pack_f32, pack_i32
from schemas.chat import prompt_input, prompt_text, tokenizer_of, tool_turn
from schemas.openenv_env import RECORD_ARTIFACT, is_openenv
from schemas.tool_protocol import (
    TOOL_NAMES,
    Call,
    declared_tools,
    error_observation,
    is_repo_call,
    parse_call,
    tool_command,
    tool_turn_text,
)

log = structlog.get_logger()

MAX_CONTEXT_TOKENS = 4096
"""Default context budget of an episode (prompt + every turn), in tokens (`rollout.max_context_tokens`)."""
DIFF_ARTIFACT = "diff"


class SandboxUnavailable(RuntimeError):
    """The episode's sandbox could not be opened or stopped answering (retry the task)."""


@dataclass
class Episode:
    """One sample of one task, as it unfolds."""

    task: Task
    sample_index: int
    turns: list[Turn]
    context: list[int]
    tool_calls: list[ToolCall] = field(default_factory=list)
    sandbox: object | None = None
    done: bool = False
    finish_reason: str = "stop"
    final_text: str = ""
    tokens: int = 0
    generate_seconds: float = 0.0
    artifacts: dict[str, bytes] = field(default_factory=dict)
    artifact_refs: dict[str, BlobRef] = field(default_factory=dict)
    """Artifacts moved to the payload store (`rollout_workers.repo_payloads.offload_artifacts`)."""
    export_error: str = ""
    """Why the final repository state could not be exported ("" when it was, or none was due)."""

    @property
    def model_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)

    def trajectory(self) -> Trajectory:
        """The Trajectory of the finished episode (`Trajectory.from_task`: ids derived from the task's)."""
        return Trajectory.from_task(
            self.task,
            self.sample_index,
            self.turns,
            finish_reason=self.finish_reason,
            generate_seconds=self.generate_seconds,
            tool_calls=self.tool_calls,
            artifacts=self.artifacts,
            artifact_refs=self.artifact_refs,
        )


def cut_at_call(
    engine, sample, tool_format: str = "tags", tools: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray, str, bool]:
    """(ids, logprobs, text, has_call): the turn cut just after its first complete tool call."""
    tools = list(tools or [])
    call = parse_call(sample.text, tool_format, tools)
    if call is None:
        return sample.token_ids, sample.logprobs, sample.text, False
    ids = sample.token_ids
    if call.end == len(sample.text):
        return ids, sample.logprobs, sample.text, True  # the engine stopped at the close (vLLM's `stop`)
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds the whole call (a prefix's text grows with it)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if parse_call(engine.decode(ids[:mid]), tool_format, tools) else (mid + 1, hi)
    text = engine.decode(ids[:lo])
    if parse_call(text, tool_format, tools) is not None:
        return ids[:lo], sample.logprobs[:lo], text, True
    return ids, sample.logprobs, sample.text, True


def new_episodes(engine, tasks: list[Task], groups) -> list[Episode]:
    """Episodes of turn 1 from the engine's samples (one list of G samples per task)."""
    out = []
    for task, samples in zip(tasks, groups, strict=True):
        for i, s in enumerate(samples):
            out.append(
                Episode(
                    task=task,
                    sample_index=i,
                    context=[int(x) for x in s.prompt_ids],
                    turns=[
                        Turn(
                            role="prompt",
                            text=prompt_text(
                                tokenizer_of(engine), task.prompt, declared_tools(task.tool_format, task.tools)
                            ),
                            token_ids=pack_i32(s.prompt_ids),
                        )
                    ],
                )
            )
    return out


def add_model_turn(
    engine, ep: Episode, sample, version: int, seconds: float, limit: int = MAX_CONTEXT_TOKENS
) -> Call | None:
    """Append a generated turn; returns its tool call (`schemas.tool_protocol.Call`, maybe a
    refused one), or None when the episode ended (`submit()` included: it runs nothing, the
    episode ends with `stop`). `limit`: the context budget in tokens."""
    ids, logprobs, text, has_call = cut_at_call(engine, sample, ep.task.tool_format, ep.task.tools)
    ep.turns.append(
        Turn(
            role="assistant",
            text=text,
            token_ids=pack_i32(ids),
            logprobs=pack_f32(logprobs),
            trainable=True,
            **turn_versions(sample, version, len(ids)),
        )
    )
    ep.context.extend(int(x) for x in ids)
    ep.tokens += len(ids)
    ep.generate_seconds += seconds
    ep.final_text = text
    if is_openenv(ep.task):  # every turn acts in the episode's environment (rollout_workers.openenv_session)
        return ep.sandbox.act(ep, text, has_call, sample.finish_reason)
    wants_tool = has_call and bool(TOOL_NAMES & set(ep.task.tools))
    if not wants_tool:
        ep.done, ep.finish_reason = True, sample.finish_reason
        return None
    call = parse_call(text, ep.task.tool_format, ep.task.tools)
    if call is not None and call.tool == "submit" and not call.error:
        ep.tool_calls.append(ToolCall(turn=len(ep.turns) - 1, tool="submit", code=call.code or "{}"))
        ep.done, ep.finish_reason = True, "stop"
        return None
    if ep.model_turns >= ep.task.max_turns:
        ep.done, ep.finish_reason = True, "max_turns"
        return None
    if len(ep.context) + ep.task.max_tokens >= limit:
        ep.done, ep.finish_reason = True, "length"
        return None
    return call


def add_tool_turn(engine, ep: Episode, observation: str) -> None:
    """Append the tool turn of `observation`, as the tokenizer's template renders a tool message."""
    tok = tokenizer_of(engine)
    if tok is None:
        text = tool_turn_text(observation)
        ids = engine.encode(text)
    else:
        text, ids = tool_turn(tok, tool_turn_text(observation))
    ep.turns.append(Turn(role="tool", text=text, token_ids=pack_i32(ids)))
    ep.context.extend(int(x) for x in ids)


async def _open(ep: Episode, open_sandbox) -> None:
    """Open the episode's sandbox (with the task's repository in it, when it has one; a Harbor
    task's own container, `rollout_workers.harbor_tools`)."""
    if is_harbor(ep.task):
        ep.sandbox = await HarborEpisodeBox.open(ep.task, ep.sample_index, getattr(open_sandbox, "recorder", None))
        return
    ep.sandbox = await (open_sandbox(repo=True) if ep.task.workspace else open_sandbox())
    if ep.task.workspace:
        from rollout_workers.repo_tools import setup_workspace

        await setup_workspace(ep.sandbox, ep.task.workspace)


async def run_call(
    engine,
    ep: Episode,
    call: Call,
    open_sandbox,
    slots: asyncio.Semaphore,
    timeout: float | None,
    caps: tuple[int, int] | None = None,
) -> None:
    """Run one tool call in the episode's sandbox and append the observation turn (a refused
    call runs nothing: its turn is the structured error observation); `caps`: observation
    clip (stdout, stderr chars) of repository tools."""
    if call.error:
        ep.tool_calls.append(
            ToolCall(
                turn=len(ep.turns) - 1, tool=call.tool or "unparsed", code=call.raw, exit_code=-1, error=call.error
            )
        )
        add_tool_turn(engine, ep, error_observation(call))
        return
    program = call.code
    async with slots:
        try:
            if ep.sandbox is None:
                await _open(ep, open_sandbox)
            if is_harbor(ep.task) or is_openenv(ep.task):
                tool, obs = call.tool, await ep.sandbox.run(call, timeout, caps)
            elif is_repo_call(call):
                from rollout_workers.repo_tools import run_repo_tool

                tool, obs = call.tool, await run_repo_tool(ep.sandbox, call, timeout, caps)
            else:
                tool, path, argv = tool_command([call.tool])
                await ep.sandbox.write_file(path, program.encode())
                obs = await ep.sandbox.observe(argv, timeout)
        except Exception as exc:  # the sandbox edge: infrastructure, never a policy outcome
            raise SandboxUnavailable(f"sandbox failed for task {ep.task.task_id}: {type(exc).__name__}: {exc}") from exc
    r = obs.result
    ep.tool_calls.append(
        ToolCall(
            turn=len(ep.turns) - 1,
            tool=tool,
            code=program,
            exec_id=obs.exec_id or "",
            exit_code=r.exit_code,
            timed_out=r.timed_out,
            oom=r.oom,
            truncated=r.truncated,
            duration_ms=r.duration_ms,
        )
    )
    add_tool_turn(engine, ep, obs.text)


def harbor_limits(ep: Episode) -> None:
    """End a Harbor episode past its `[agent].timeout_sec` (`timeout`) or `storage_mb` (`error`)."""
    sb = ep.sandbox
    if sb.storage_exceeded:
        ep.done, ep.finish_reason = True, "error"
    elif time.monotonic() - sb.started > float(ep.task.verifier_params.get("agent_timeout_s") or 1e9):
        ep.done, ep.finish_reason = True, "timeout"


async def _drop_container(ep: Episode) -> None:
    """Remove the Harbor container of an episode whose batch failed (nothing will verify it)."""
    cid = ep.artifacts.pop(CONTAINER_ARTIFACT, None)
    if cid:
        from sandbox_workers.harbor_box import remove_container

        await asyncio.to_thread(remove_container, cid.decode())


async def finish(ep: Episode) -> None:
    """Export the requested artifacts (a repo task's diff) and close the episode's sandbox (always)."""
    sb, ep.sandbox = ep.sandbox, None
    if sb is None:
        if ep.task.workspace:
            ep.artifacts[DIFF_ARTIFACT] = b""  # nothing was opened: nothing changed
        return
    if is_openenv(ep.task):  # what the environment answered: the `openenv` verifier's input
        ep.artifacts[RECORD_ARTIFACT] = sb.record()
        await sb.close()
        return
    if isinstance(sb, HarborEpisodeBox):
        cid, state = await sb.handover()  # the verifier removes the container
        ep.artifacts[CONTAINER_ARTIFACT], ep.artifacts[STATE_ARTIFACT] = cid.encode(), state.encode()
        return
    try:
        if ep.task.workspace:
            from rollout_workers.repo_tools import export_diff

            try:
                diff, _ = await export_diff(sb, ep.task.workspace)
                ep.artifacts[DIFF_ARTIFACT] = diff.encode()
            except Exception as exc:  # noqa: BLE001 - the sandbox edge: the batch is retried (run_episodes raises)
                ep.export_error = f"{type(exc).__name__}: {exc}"
        for path in ep.task.verifier_params.get("export", []) or []:
            try:
                ep.artifacts[str(path)] = await sb.read_file(str(path))
            except (FileNotFoundError, ValueError, IsADirectoryError):
                pass  # a missing export is the policy's outcome; the verifier scores it
    finally:
        await sb.close()


def _check_resolved(tasks: list[Task]) -> None:
    """ValueError for a task whose repository is still only a reference."""
    unresolved = [x.task_id for x in tasks if x.workspace_ref is not None and not x.workspace]
    if unresolved:
        raise ValueError(
            f"tasks {unresolved} name their repository by reference: resolve it first "
            "(rollout_workers.repo_payloads.resolve_workspaces)"
        )


async def run_episodes(
    engine,
    tasks: list[Task],
    *,
    version: Callable[[], int],
    open_sandbox: Callable[[], Awaitable[object]],
    before_turn: Callable[[], Awaitable] | None = None,
    slots: int = 8,
    tool_timeout: float | None = None,
    deadline: float | None = None,
    context_budget: int | None = None,
    obs_caps: tuple[int, int] | None = None,
    inflight: Inflight | None = None,
) -> list[Episode]:
    """Every sample of `tasks` (which share group size, max_tokens and temperature) to the end;
    past `deadline` (time.monotonic) no new turn starts: live episodes end with `length`.
    `context_budget`: most tokens of an episode's context (default MAX_CONTEXT_TOKENS), never
    more than the engine's `max_context`; `obs_caps`: repository tools' observation clip;
    `inflight`: turns in chunks, new weights between them (none for a batch holding eval tasks)."""
    _check_resolved(tasks)
    t = tasks[0]
    n, max_tokens, temperature = t.group_size, t.max_tokens, t.temperature
    sem = asyncio.Semaphore(slots)
    budget = context_budget or MAX_CONTEXT_TOKENS
    limit = min(budget, getattr(engine, "max_context", None) or budget)
    inflight = for_tasks(inflight, tasks)
    episodes: list[Episode] = []
    completed = False
    try:
        if before_turn:
            await before_turn()
        if any(map(is_openenv, tasks)):  # one environment session per episode, open before its first turn
            from rollout_workers.openenv_session import first_turn

            episodes = [Episode(task=x, sample_index=i, turns=[], context=[]) for x in tasks for i in range(n)]
            samples, each = await first_turn(engine, episodes, sem, max_tokens, temperature, inflight)
        else:
            t0 = time.perf_counter()
            tok = tokenizer_of(engine)
            prompts = [prompt_input(tok, x.prompt, declared_tools(x.tool_format, x.tools)) for x in tasks]
            groups = await generate_turn(engine, prompts, n, max_tokens, temperature, inflight)
            episodes = new_episodes(engine, tasks, groups)
            each = (time.perf_counter() - t0) / max(1, len(episodes))
            samples = [s for g in groups for s in g]
        live = episodes
        while live:
            v = version()
            calls = [(ep, add_model_turn(engine, ep, s, v, each, budget)) for ep, s in zip(live, samples, strict=True)]
            calls = [(ep, prog) for ep, prog in calls if prog is not None]
            await asyncio.gather(
                *(run_call(engine, ep, prog, open_sandbox, sem, tool_timeout, obs_caps) for ep, prog in calls)
            )
            live = [ep for ep, _ in calls]
            for ep in live:  # the next turn must fit the engine's context: else the episode ends here
                if is_openenv(ep.task) and ep.sandbox.done:  # the environment ended the episode
                    ep.done, ep.finish_reason = True, "stop"
                elif len(ep.context) + max_tokens > limit:
                    ep.done, ep.finish_reason = True, "length"
                elif isinstance(ep.sandbox, HarborEpisodeBox):
                    harbor_limits(ep)
            live = [ep for ep in live if not ep.done]
            if live and deadline is not None and time.monotonic() >= deadline:
                for ep in live:
                    ep.done, ep.finish_reason = True, "length"
                live = []
            if not live:
                break
            if before_turn:
                await before_turn()
            t0 = time.perf_counter()
            nxt = await generate_turn(engine, [ep.context for ep in live], 1, max_tokens, temperature, inflight)
            each = (time.perf_counter() - t0) / len(live)
            samples = [g[0] for g in nxt]
        completed = True
    finally:
        await asyncio.gather(*(finish(ep) for ep in episodes), return_exceptions=True)
        if not completed:
            await asyncio.gather(*(_drop_container(ep) for ep in episodes), return_exceptions=True)
    failed = [ep for ep in episodes if ep.export_error]
    if failed:
        raise SandboxUnavailable(
            f"final repository state of task {failed[0].task.task_id} could not be exported: {failed[0].export_error}"
        )
    return episodes
