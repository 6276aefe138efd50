"""The scheduler process: regression evaluation of weight versions (every domain with an
evaluator: arith, tool_calc; with `scheduler.eval_mode = "pipeline"` the rounds between the
local baseline and the local final score go through rollout and verifier workers as
`purpose=eval` tasks, see `scheduler.pipeline_eval`), the recorder that writes the run's streams into the SQL
run store, dead-letter capture and the curriculum.

Guarantees:
- Version 0 (the starting checkpoint) is always evaluated first, from the checkpoint
  files themselves: it is the baseline, even if the learner has moved on already.
- Afterwards every `eval_every_versions`-th version is evaluated as it appears, and on
  stop the newest version is evaluated if it was not yet, so `final` is always the
  score of the last version.
- Each evaluation is published as an `EvalResult` on `eval.<run>.<domain>`.
- MAX_DELIVERIES advisories of the work streams are turned into dead letters
  (`scheduler.dlq`) while it runs.
- The recorder (`scheduler.recorder`) runs alongside and stops only after the final
  evaluation, so the run store holds every reward, version, eval and dead letter.
- With `scheduler.curriculum` on, the curriculum service (`scheduler.curriculum_service`)
  runs alongside too: domain weights and levels from the rewards, published to KV
  `curriculum` for the sampler and recorded in the run store; stopped at the end.
- After every evaluation the gates (`scheduler.gates`) run: release gate (KV
  `release.latest`), forgetting guard (KV `learner.overrides`) and plateau detection (KV
  `plateau`, and `status` = "stop-requested" with `scheduler.stop_on_plateau`), each
  verdict a `gate_checks` row.
"""

from __future__ import annotations

import asyncio

import structlog

from bus.kv import EVAL_BASELINE, get_json, put_json
from bus.publish import publish
from bus.session import worker_session
from rollout_workers.engines import HFEngine
from rollout_workers.weights_watch import WeightWatcher
from scheduler.costs import track_costs
from scheduler.curriculum_service import run_curriculum
from scheduler.dlq import capture_max_deliveries
from scheduler.durations import track_durations
from scheduler.evaluation import EvalSuite
from scheduler.gates import Gates, add_general_set
from scheduler.pipeline_eval import PipelineEval
from scheduler.recorder import record
from scheduler.store import open_store
from schemas import EvalResult

log = structlog.get_logger()


async def run(cfg, ctx) -> dict[str, float]:
    """Evaluate versions until stopped."""
    ec = cfg.scheduler
    async with worker_session("scheduler", cfg, ctx) as s:
        store = await asyncio.to_thread(open_store, ec.db_url or None, ctx.run_path)
        await asyncio.to_thread(store.ensure_run, s.reg.run_id, cfg.model_dump(mode="json"))
        recorder_stop = asyncio.Event()
        recorder = asyncio.create_task(record(s.js, s.reg, store, stop=recorder_stop))
        dead_letterer = asyncio.create_task(capture_max_deliveries(s.js, s.reg, s.stop))
        durations = asyncio.create_task(track_durations(s.js, s.reg, s.stop))
        costs = asyncio.create_task(track_costs(s.nc, s.reg, store, s.stop))
        curriculum_stop = asyncio.Event()
        curriculum = (asyncio.create_task(run_curriculum(s.js, s.reg, cfg, curriculum_stop, store))
                      if ec.curriculum else None)

        async def stop_curriculum() -> None:
            curriculum_stop.set()
            if curriculum is not None:
                s.counters.update(await curriculum)
        suite = EvalSuite.from_config(cfg)
        add_general_set(suite, cfg)  # the forgetting guard's general set (scheduler.general_eval), if on
        gates = Gates(s.js, s.reg, store, cfg)
        await gates.load()
        if suite.skipped:
            log.info("scheduler.eval_skipped", domains=suite.skipped, why="no evaluator for their kind yet")
        engine = await asyncio.to_thread(HFEngine, str(ctx.model_path), "cpu", ec.threads)

        async def open_eval_sandbox():
            # eval episodes run on the controlled side, in local sandboxes of the configured backend
            from sandbox_workers.async_sandbox import LocalAsyncSandbox, limits_from

            sc = cfg.sandbox
            return await LocalAsyncSandbox.open("process" if sc.remote else sc.backend, image=sc.image,
                                                limits=limits_from(sc), timeout=sc.timeout_s)
        watcher = WeightWatcher(s.js, s.reg, s.counters)
        await watcher.start()
        last_eval = -1

        async def publish_eval(version: int, step: int, metrics: dict | None = None) -> None:
            nonlocal last_eval
            await record_scores(await suite.evaluate(engine, open_eval_sandbox), version, step, metrics)
            last_eval = version

        async def record_scores(scores: dict, version: int, step: int, metrics: dict | None) -> None:
            for domain, (score, n, digest) in scores.items():
                await publish(s.js, s.reg.eval(domain), EvalResult(
                    run_id=s.reg.run_id, version=version, step=step, domain=domain, score=score,
                    n=n, eval_set_sha256=digest))
                s.counters[f"eval_{domain}"] = score
                log.info("scheduler.eval", version=version, domain=domain, score=score, n=n, mode=ec.eval_mode)
            await gates.after_eval(version, step, {d: v[0] for d, v in scores.items()}, metrics)
            first = next(iter(scores.values()), (0.0, 0, ""))[0]
            s.counters.update(eval_version=version, eval_score=first, evals=s.counters.get("evals", 0) + 1)

        pipeline = PipelineEval(s.js, s.reg, suite, ec.eval_timeout_s) if ec.eval_mode == "pipeline" else None
        if pipeline is not None:
            await pipeline.start()

        async def evaluate(local: bool = False) -> None:
            nonlocal last_eval
            if pipeline is None or local:
                await watcher.maybe_load(engine)
                await publish_eval(watcher.loaded.version, watcher.loaded.step, watcher.loaded.metrics)
                return
            asked = watcher.newest.version
            result = await pipeline.evaluate(stop=s.stop)
            if result is None:
                return  # stopping: the final evaluation below scores the newest version locally
            scores, version = result
            version = asked if version is None else version
            await record_scores(scores, version, watcher.steps.get(version, 0), None)
            last_eval = max(asked, version)

        if await get_json(s.js, s.reg, EVAL_BASELINE) is None:
            # The baseline is the starting checkpoint exactly as the learner publishes it as
            # version 0 (same files), evaluated before any blob is loaded: however late the
            # scheduler starts, the baseline is never a later version.
            await publish_eval(0, 0)
            await put_json(s.js, s.reg, EVAL_BASELINE, {"version": 0, "score": s.counters["eval_score"]})

        if not await watcher.wait_first(s.stop):
            await stop_curriculum()
            recorder_stop.set()
            await recorder
            await dead_letterer
            await durations
            await costs
            return s.counters
        while not s.stop.is_set():
            newest = watcher.newest
            if newest and (last_eval < 0 or newest.version >= last_eval + ec.eval_every_versions):
                await evaluate()
            if ctx.max_messages is not None and s.counters.get("evals", 0) >= ctx.max_messages:
                break
            try:
                await asyncio.wait_for(s.stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        if watcher.newest and watcher.newest.version != last_eval:
            # at stop the rollout and verifier workers are already drained: the final score
            # is always computed here, like the baseline
            await evaluate(local=True)
        if pipeline is not None:
            await pipeline.stop()
        s.counters["max_deliveries_dead_lettered"] = await dead_letterer
        await durations
        await costs
        await stop_curriculum()
        recorder_stop.set()
        counts = await recorder
        # one last pass until the streams are idle, so the final eval and rewards are in
        tail = await record(s.js, s.reg, store, stop=asyncio.Event(), until_idle=1.0)
        s.counters.update({f"recorded_{k}": v + tail.get(k, 0) for k, v in counts.items()})
        await asyncio.to_thread(store.set_run_status, s.reg.run_id, "stopped")
        return s.counters
