"""The scheduler process. So far: regression evaluation of weight versions.

Guarantees:
- Version 0 (the starting checkpoint) is always evaluated: it is the baseline.
- Afterwards every `eval_every_versions`-th version is evaluated as it appears, and on
  stop the newest version is evaluated if it was not yet, so `final` is always the
  score of the last version.
- Each evaluation is published as an `EvalResult` on `eval.<run>.<domain>`.
"""

from __future__ import annotations

import asyncio

import structlog

from bus.publish import publish
from rlbus.runtime import worker_session
from rollout_workers.engines import HFEngine
from rollout_workers.weights_watch import WeightWatcher
from schemas import EvalResult
from scheduler.evaluation import eval_set, greedy_accuracy

log = structlog.get_logger()


async def run(cfg, ctx) -> dict[str, float]:
    """Evaluate versions until stopped."""
    ec = cfg.scheduler
    async with worker_session("scheduler", cfg, ctx) as s:
        problems, digest = eval_set(ec.eval_seed, ec.eval_n, ec.eval_difficulty)
        engine = await asyncio.to_thread(HFEngine, str(ctx.model_path), "cpu", ec.threads)
        watcher = WeightWatcher(s.js, s.reg, s.counters)
        await watcher.start()
        last_eval = -1

        async def evaluate() -> None:
            nonlocal last_eval
            await watcher.maybe_load(engine)
            v = watcher.loaded
            score = await asyncio.to_thread(greedy_accuracy, engine, problems, cfg.sampler.max_tokens)
            await publish(s.js, s.reg.eval("arith"), EvalResult(
                run_id=s.reg.run_id, version=v.version, step=v.step, domain="arith", score=score,
                n=len(problems), eval_set_sha256=digest))
            last_eval = v.version
            s.counters.update(eval_version=v.version, eval_score=score, evals=s.counters.get("evals", 0) + 1)
            log.info("scheduler.eval", version=v.version, score=score, n=len(problems))

        if not await watcher.wait_first(s.stop):
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
            await evaluate()
        return s.counters
