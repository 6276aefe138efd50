"""The rollout worker process: tasks in, one Trajectory per sample out.

Guarantees:
- Takes no task before a weight version is loaded; loads newer versions between
  batches (sha256-checked), and tags every trajectory and turn with the version that
  generated it.
- Trajectory msg_ids derive from (task msg_id, sample index) (`Trajectory.from_task` builds
  every trajectory), so a redelivered task's re-rollout is de-duplicated by JetStream and by
  the learner.
- For each task, publishes exactly `group_size` trajectories (all of a batch in one
  pipelined publish) and only then acks the task; a crash before the ack means the
  task is redelivered to another worker.
- Each duration pool (`rollout.pools`: `short`, `long`, ...) is pulled by its own loop
  through its own durable consumer, with its own ack_wait, in_progress cadence, batch
  size and time budget, so long episodes never starve short ones. With `rollout.priority.enabled`
  (the default) a pool's loop pulls one durable consumer per priority class
  (`rollout_workers.admission`): pipeline-eval tasks go ahead of training tasks, and training
  keeps at least `rollout.priority.min_share` of admissions while it has work.
- Refused tool calls (`ToolCall.error`: malformed JSON, unknown tool, bad arguments) are
  counted per domain and kind as `tool_errors.<domain>.<kind>`.
- Tasks that offer tools, and OpenEnv tasks (`schemas.openenv_env.is_openenv`: one environment
  session per episode), run as multi-turn agent episodes (`rollout_workers.agent`); tools run in
  sandboxes from the `sandbox` config section: local (`backend`), or sessions of the
  sandbox service when `sandbox.remote`; a repository task's sandbox is from
  `sandbox.repo_image` either way (a remote one asks the service for that image, which the
  service refuses unless it is one it was configured with). When the sandbox itself fails,
  the batch's tool tasks are retried (nak with delay), never published as low-reward
  trajectories.
- With `rollout.endpoint.enabled`, the worker serves the OpenAI-compatible endpoint
  (`rollout_workers.endpoint`) on its engine and its current weights, from start to stop;
  its engine calls hold the weight watcher's load lock, so a call's version is exact.
- Tasks of `kind = "agent"` domains run as harness-owned episodes (`rollout_workers.agent_harness`):
  the worker serves the endpoint (also on a Unix socket for the sandboxes) whether or not
  `rollout.endpoint.enabled`; their infrastructure errors retry the batch like a failed sandbox.
- Payloads by reference (`rollout_workers.repo_payloads`): a task's `workspace_ref` is
  fetched and checked before its sandbox opens, an artifact over
  `rollout.artifact_inline_bytes` is stored in the payload bucket and published as a ref;
  a payload that cannot be fetched or stored retries the batch like a failed sandbox.
- No trajectory generated with a weight version leaves the worker before that version's
  sha256 check passed. The watcher is speculative (`WeightWatcher(speculative=True)`): a
  `file://` version serves as soon as it is read, and its sha256 is checked in the
  background. `roll_out_batch` marks the weight history before its batch and, after
  generating and before publishing, awaits the check of every version the engine held
  meanwhile (`verified_since`). If one failed, the engine is already back on the previous
  weights and that version is rejected; the batch is not published, its tasks are
  retried (nak, redelivered and regenerated with good weights), counted in
  `batches_discarded_unverified`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections import defaultdict
from types import SimpleNamespace

import structlog

from bus.conn import pull_subscription
from bus.payloads import PayloadCache
from bus.publish import publish_many
from bus.pull import Delivery, Retry, run_pull_loop
from bus.session import Session, WorkerContext, worker_session
from bus.subjects import PRIORITY_CLASSES
from rollout_workers.admission import Admission, PrioritySubscription
from rollout_workers.agent import SandboxUnavailable, run_episodes
from rollout_workers.agent_harness import agent_domains, run_agent_tasks, socket_dir
from rollout_workers.engines import close_engine, make_engine
from rollout_workers.engines.sample import Sample
from rollout_workers.inflight import Inflight, for_tasks, generate_turn, turn_versions
from rollout_workers.repo_payloads import offload_artifacts, resolve_workspaces
from rollout_workers.weights_watch import WeightWatcher
from schemas import Task, Trajectory, Turn, pack_f32, pack_i32
from schemas.chat import prompt_input, prompt_text, tokenizer_of
from schemas.config import PoolConfig, RunConfig
from schemas.openenv_env import is_openenv

log = structlog.get_logger()


def single_turn_trajectories(
    task: Task, samples: list[Sample], version: int, seconds_each: float, tokenizer=None
) -> list[Trajectory]:
    """One Trajectory (prompt turn, answer turn) per engine sample of `task`, generated with
    weights `version`; built by `Trajectory.from_task` (ids derived from the task's). The
    prompt turn's text is what `schemas.chat` rendered for `tokenizer`; its ids, the engine's."""
    prompt = prompt_text(tokenizer, task.prompt)
    return [
        Trajectory.from_task(
            task,
            i,
            [
                Turn(role="prompt", text=prompt, token_ids=pack_i32(s.prompt_ids)),
                Turn(
                    role="assistant",
                    text=s.text,
                    token_ids=pack_i32(s.token_ids),
                    logprobs=pack_f32(s.logprobs),
                    trainable=True,
                    **turn_versions(s, version),  # in-flight updates: its version runs
                ),
            ],
            finish_reason=s.finish_reason,
            generate_seconds=seconds_each,
        )
        for i, s in enumerate(samples)
    ]


def count_tool_errors(counters: dict[str, float], episodes) -> None:
    """Add each refused tool call (malformed JSON, unknown tool, bad arguments) of `episodes`
    to the counter `tool_errors.<domain>.<kind>`."""
    for ep in episodes:
        for call in ep.tool_calls:
            if call.error:
                key = f"tool_errors.{ep.task.domain}.{call.error}"
                counters[key] = counters.get(key, 0) + 1


async def sandbox_opener(cfg: RunConfig, ctx: WorkerContext, s: Session):
    """A coroutine function opening one episode sandbox (local or remote; `repo=True`: from
    `sandbox.repo_image`, for repository tasks).

    A local sandbox records its executions with the run's tool-result secret, so
    verifiers can check every observation (see `sandbox_workers.integrity`)."""
    from sandbox_workers.async_sandbox import open_async_sandbox

    recorder = None
    if not cfg.sandbox.remote:
        from sandbox_workers.integrity import LocalRecorder

        recorder = LocalRecorder.for_run(s.js, s.reg, ctx.run_path)

    async def open_one(repo: bool = False):
        """One sandbox; `repo`: for a repository task (image `sandbox.repo_image`, asked of the
        service when remote)."""
        return await open_async_sandbox(
            cfg.sandbox, s.nc, s.reg.run_id, recorder=recorder, image=cfg.sandbox.repo_image if repo else None
        )

    open_one.recorder = recorder  # Harbor episodes open their own containers and record with it too
    return open_one


async def roll_out_batch(
    batch: list[Delivery],
    *,
    js,
    reg,
    engine,
    watcher: WeightWatcher,
    counters: dict[str, float],
    budget_s: float,
    run_tool_tasks=None,
    run_agent_tasks=None,
    agent_domains: frozenset[str] | set[str] = frozenset(),
    inflight: Inflight | None = None,
) -> None:
    """Generate a batch's trajectories and publish them once every weight version they may
    come from is verified (else raise Retry for the whole batch: nothing is published).
    Returning acks the batch (`bus.pull.run_pull_loop`)."""
    deadline = time.monotonic() + budget_s
    started = time.perf_counter()
    mark = watcher.mark()  # before loading: the weights held now, and everything loaded from here on
    await watcher.maybe_load(engine)
    by_shape: dict[tuple, list[Task]] = defaultdict(list)
    for d in batch:
        t = d.msg
        way = "agent" if t.domain in agent_domains else bool(t.tools) or is_openenv(t)
        by_shape[(way, t.group_size, t.max_tokens, t.temperature)].append(t)
    items = []
    for (tools, n, max_tokens, temperature), tasks in by_shape.items():
        if tools == "agent":  # harness-owned episodes (rollout_workers.agent_harness)
            try:
                items += [(reg.traj(t.domain), t) for t in await run_agent_tasks(tasks)]
            except SandboxUnavailable as exc:
                log.warning("rollout.agent_unavailable", error=str(exc))
                raise Retry(delay=5.0, reason=str(exc)) from exc
            continue
        if tools:
            try:
                items += await run_tool_tasks(tasks, deadline)
            except SandboxUnavailable as exc:
                log.warning("rollout.sandbox_unavailable", error=str(exc))
                raise Retry(delay=5.0, reason=str(exc)) from exc
            continue
        t0 = time.perf_counter()
        tok = tokenizer_of(engine)  # chat template when it has one (schemas.chat), plain text otherwise
        groups = await generate_turn(  # in chunks, new weights between them, with rollout.inflight
            engine, [prompt_input(tok, t.prompt) for t in tasks], n, max_tokens, temperature, for_tasks(inflight, tasks)
        )
        each = (time.perf_counter() - t0) / max(1, n * len(tasks))
        for task, samples in zip(tasks, groups, strict=True):
            for traj in single_turn_trajectories(task, samples, watcher.version, each, tok):
                items.append((reg.traj(task.domain), traj))
    if not await watcher.verified_since(mark):  # the publish gate (see the module guarantees)
        counters["batches_discarded_unverified"] = counters.get("batches_discarded_unverified", 0) + 1
        log.warning(
            "rollout.batch_discarded",
            reason="weights failed sha256 verification",
            tasks=len(batch),
            trajectories=len(items),
            serving_version=watcher.version,
        )
        raise Retry(delay=1.0, reason="generated with weights that failed sha256 verification")
    await publish_many(js, items)
    counters["tasks"] = counters.get("tasks", 0) + len(batch)
    counters["trajectories"] = counters.get("trajectories", 0) + len(items)
    counters["tokens"] = counters.get("tokens", 0) + sum(t.tokens for _, t in items)
    # seconds spent rolling out published batches (weight loads and tool calls included): tokens / busy_s is
    # the worker's rollout throughput (summary.json `rollout.tokens_per_s`)
    counters["busy_s"] = counters.get("busy_s", 0.0) + (time.perf_counter() - started)


async def pool_subscription(js, reg, pool: str, ack_wait: float, priority, counters: dict[str, float]):
    """The subscription a pool's loop fetches from: with `rollout.priority.enabled`, one consumer per
    priority class behind a `PrioritySubscription` (eval tasks first, training never starved below
    `min_share`); else the pool's one training consumer, first come first served."""
    if not priority.enabled:
        return await pull_subscription(js, reg.rollout_consumer(ack_wait, pool=pool))
    subs = {
        c: await pull_subscription(js, reg.rollout_consumer(ack_wait, pool=pool, priority=c)) for c in PRIORITY_CLASSES
    }
    return PrioritySubscription(subs, Admission(PRIORITY_CLASSES, priority.min_share), counters=counters)


async def run(cfg: RunConfig, ctx: WorkerContext) -> dict[str, float]:
    """Run the rollout worker until stopped (or the context's test limits)."""
    rc = cfg.rollout
    # test limit (--max-messages): task messages each pool's loop fetches (usable or dead-lettered)
    # before it ends; with a limit set, the first pool loop to end stops the whole worker
    tasks_per_pool = ctx.max_messages
    async with worker_session("rollout", cfg, ctx) as s, contextlib.AsyncExitStack() as stack:
        engine = await asyncio.to_thread(make_engine, rc, str(ctx.model_path))
        stack.callback(close_engine, engine)  # an engine's spawned processes end with the worker
        watcher = WeightWatcher(s.js, s.reg, s.counters, speculative=True, nc=s.nc)
        await watcher.start()
        if not await watcher.wait_first(s.stop):
            return s.counters
        await watcher.maybe_load(engine)

        agents = agent_domains(cfg)
        endpoint = uds = None
        if rc.endpoint.enabled or agents:  # harness-owned episodes call the policy here (rollout_workers.endpoint)
            from rollout_workers.endpoint.server import Endpoint

            endpoint = Endpoint(engine, lambda: watcher.version, rc.endpoint, rc.max_context_tokens, watcher.load_lock)
            stack.push_async_callback(endpoint.stop)
            if agents:  # sandboxes without a network reach it through this socket (rollout_workers.agent_harness)
                uds = socket_dir()
                stack.callback(shutil.rmtree, os.path.dirname(uds), True)
            log.info(
                "rollout.endpoint_serving", base_url=await (endpoint.serve(uds) if uds else endpoint.serve()), uds=uds
            )

        open_sandbox = await sandbox_opener(cfg, ctx, s)
        inflight = None
        if rc.inflight.enabled:  # weight updates in flight (rollout_workers.inflight)
            reload = lambda: watcher.maybe_load(engine)
            inflight = Inflight(rc.inflight.chunk_tokens, lambda: watcher.version, reload, watcher.load_lock)
        workspaces = PayloadCache(s.js, s.reg)

        async def run_tool_tasks(tasks: list[Task], deadline: float) -> list:
            tasks = await resolve_workspaces(tasks, workspaces)
            episodes = await run_episodes(
                engine,
                tasks,
                version=lambda: watcher.version,
                open_sandbox=open_sandbox,
                before_turn=lambda: watcher.maybe_load(engine),
                slots=rc.sandbox_slots,
                tool_timeout=cfg.sandbox.timeout_s,
                deadline=deadline,
                context_budget=rc.max_context_tokens,
                obs_caps=(rc.observation_chars, rc.observation_chars // 2),
                inflight=inflight,
            )
            count_tool_errors(s.counters, episodes)
            moved = await offload_artifacts(s.js, s.reg, episodes, rc.artifact_inline_bytes)
            s.counters["artifacts_by_ref"] = s.counters.get("artifacts_by_ref", 0) + moved
            return [(s.reg.traj(ep.task.domain), ep.trajectory()) for ep in episodes]

        async def agent_tasks(tasks: list[Task]) -> list[Trajectory]:
            tasks = await resolve_workspaces(tasks, workspaces)
            trajs = await run_agent_tasks(endpoint, cfg, tasks, uds, slots=rc.sandbox_slots)
            by_id = {t.task_id: t for t in tasks}  # offload_artifacts reads ep.task, edits the artifacts in place
            shims = [
                SimpleNamespace(task=by_id[t.task_id], artifacts=t.artifacts, artifact_refs=t.artifact_refs)
                for t in trajs
            ]
            moved = await offload_artifacts(s.js, s.reg, shims, rc.artifact_inline_bytes)
            s.counters["artifacts_by_ref"] = s.counters.get("artifacts_by_ref", 0) + moved
            return trajs

        async def handle(batch: list[Delivery], budget_s: float):
            return await roll_out_batch(
                batch,
                js=s.js,
                reg=s.reg,
                engine=engine,
                watcher=watcher,
                counters=s.counters,
                budget_s=budget_s,
                run_tool_tasks=run_tool_tasks,
                run_agent_tasks=agent_tasks,
                agent_domains=agents,
                inflight=inflight,
            )

        async def serve(pool: str, pc: PoolConfig) -> None:
            ack_wait = pc.ack_wait_s or rc.ack_wait_s
            sub = await pool_subscription(s.js, s.reg, pool, ack_wait, rc.priority, s.counters)
            await run_pull_loop(
                s.js,
                s.reg,
                "rollout",
                sub,
                Task,
                lambda b: handle(b, pc.budget_s),
                batch=pc.batch_tasks or rc.batch_tasks,
                ack_wait_s=ack_wait,
                max_messages=tasks_per_pool,
                until_idle=ctx.until_idle,
                stop=s.stop,
                counters=s.counters,
            )
            if tasks_per_pool is not None:
                s.stop.set()

        # one pull loop per duration pool: a long episode holds only its own pool's loop
        await asyncio.gather(*(serve(pool, pc) for pool, pc in rc.pools.items()))
        return s.counters
