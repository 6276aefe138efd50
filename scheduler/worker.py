"""The scheduler process: regression evaluation of weight versions (every domain whose source
gives an eval set, `producers.eval_set`; with `scheduler.eval.mode = "pipeline"` the rounds between the
local baseline and the local final score go through rollout and verifier workers as
`purpose=eval` tasks, in the `eval` priority class ahead of training with `rollout.priority.enabled`,
see `scheduler.pipeline_eval`), the recorder that writes the run's streams into the SQL
run store, dead-letter capture and the curriculum.

Guarantees:
- Version 0 (the starting checkpoint) is always evaluated first, from the checkpoint
  files themselves: it is the baseline, even if the learner has moved on already.
- Afterwards every `scheduler.eval.every_versions`-th version is evaluated as it appears, and on
  stop the newest version is evaluated if it was not yet, so `final` is always the
  score of the last version.
- Each evaluation is published as an `EvalResult` on `eval.<run>.<domain>`, with
  `purpose` = `heldout` for a zero-shot domain (`sampler.domains.<d>.heldout`), else `train`.
- Sets only the pipeline can score (`EvalSet.local` None: e.g. a held-out reasoning domain's
  drawn tasks) go through `purpose=eval` rounds in either eval mode: one
  right after the first weight version appears (its baseline, at the version rollout
  served then), and one with every evaluation of a new version in `local` mode (in
  `pipeline` mode the round covers every set). The final evaluation at stop is local, so
  their last score is the last round's.
- The gates judge the trained domains' scores (`purpose=train`) of the baseline, of each
  evaluation of a version and of the final one; held-out scores, and those of the extra
  rounds above, are recorded and published, never gated.
- MAX_DELIVERIES advisories of the work streams are turned into dead letters
  (`scheduler.dlq`) while it runs.
- The recorder (`scheduler.recorder`) runs alongside and stops only after the final
  evaluation, so the run store holds every reward, version, eval and dead letter.
- With `scheduler.curriculum.enabled`, the curriculum service (`scheduler.curriculum_service`)
  runs alongside too: domain weights and levels from the rewards, published to KV
  `curriculum` for the sampler and recorded in the run store; stopped at the end.
- After every evaluation the gates (`scheduler.gates`) run: release gate (KV
  `release.latest`), forgetting guard (KV `learner.overrides`) and plateau detection (KV
  `plateau`, and `status` = "stop-requested" with `scheduler.plateau.stop`), each
  verdict a `gate_checks` row.
- Shutdown is one sequence of named phases, run whether the work ended cleanly or not,
  each phase even if an earlier one failed (the first failure is raised afterwards):
  stop intake, stop the side tasks, stop the recorder, close the store. Only a clean end
  runs the recorder's last pass and marks the run `stopped` in the store.
- For this role `ctx.max_messages` counts evaluations (the baseline included): once that
  many are done the scheduler stops, after the final evaluation above.
"""

from __future__ import annotations

import asyncio

import structlog

from bus.kv import EVAL_BASELINE, get_json, put_json
from bus.publish import publish
from bus.session import Session, WorkerContext, worker_session
from rollout_workers.engines import make_engine
from rollout_workers.engines.hf_engine import HFEngine
from rollout_workers.weights_watch import WeightWatcher
from scheduler.costs import track_costs
from scheduler.curriculum_service import run_curriculum
from scheduler.dlq import capture_max_deliveries
from scheduler.durations import track_durations
from scheduler.evaluation import EvalSuite
from scheduler.gates import Gates, add_general_set
from scheduler.pipeline_eval import PipelineEval
from scheduler.recorder import record
from scheduler.store import Store, open_store
from schemas import EvalResult
from schemas.config import HFEngineSection, RolloutSection, RunConfig

log = structlog.get_logger()
EVAL_INFRA_TRIES = 4


class SchedulerWorker:
    """One scheduler process inside its bus session: `start`, then `work`, then `shutdown`
    (`run` does the three, shutdown in a `finally`)."""

    def __init__(self, s: Session) -> None:
        self.s, self.cfg, self.ec = s, s.cfg, s.cfg.scheduler
        # The context's message limit is, for this role, the number of evaluations to run
        # (the baseline included); read here only, so a rename of the field touches one line.
        self.max_evaluations: int | None = s.ctx.max_messages
        self.last_eval = -1  # the newest version evaluated so far
        self.completed = False  # `work` returned (a clean stop), as opposed to raised
        self.store: Store | None = None
        self.recorder: asyncio.Task | None = None
        self.recorder_stop = asyncio.Event()
        self.side_tasks: dict[str, asyncio.Task] = {}  # dead letters, durations, costs, curriculum
        self.curriculum_stop = asyncio.Event()
        self.suite: EvalSuite | None = None
        self.gates: Gates | None = None
        self.engine: HFEngine | None = None
        self.watcher: WeightWatcher | None = None
        self.pipeline: PipelineEval | None = None

    async def run(self) -> dict[str, float]:
        """Start, evaluate until stopped, shut down; returns the session's counters."""
        try:
            await self.start()
            await self.work()
            self.completed = True
        finally:
            await self.shutdown()
        return self.s.counters

    # -- start -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the run store, start the recorder and the side tasks, load the eval suite,
        the gates and the engine, and subscribe to weight versions (and eval rewards)."""
        s, cfg, ec = self.s, self.cfg, self.ec
        self.store = await asyncio.to_thread(open_store, ec.db_url or None, s.ctx.run_path)
        await asyncio.to_thread(self.store.ensure_run, s.reg.run_id, cfg.model_dump(mode="json"))
        self.recorder = asyncio.create_task(record(s.js, s.reg, self.store, stop=self.recorder_stop))
        self.side_tasks["dead_letters"] = asyncio.create_task(capture_max_deliveries(s.js, s.reg, s.stop))
        self.side_tasks["durations"] = asyncio.create_task(track_durations(s.js, s.reg, s.stop))
        self.side_tasks["costs"] = asyncio.create_task(track_costs(s.nc, s.reg, self.store, s.stop))
        if ec.curriculum.enabled:
            self.side_tasks["curriculum"] = asyncio.create_task(
                run_curriculum(s.js, s.reg, cfg, self.curriculum_stop, self.store)
            )
        # off the loop: drawing eval sets can take seconds (reasoning-gym countdown: ~7 s for 142 entries),
        # and the heartbeats must go on meanwhile (the launcher kills a worker silent for heartbeat_timeout_s)
        self.suite = await asyncio.to_thread(EvalSuite.from_config, cfg)
        add_general_set(self.suite, cfg)  # the forgetting guard's general set (scheduler.eval.general), if on
        self.gates = Gates(s.js, s.reg, self.store, cfg)
        await self.gates.load()
        if self.suite.skipped:
            log.info("scheduler.eval_skipped", domains=self.suite.skipped, why="their sources give no eval set")
        local = RolloutSection(engine="hf", hf=HFEngineSection(device="cpu", threads=ec.threads))
        self.engine = await asyncio.to_thread(make_engine, local, str(s.ctx.model_path))
        self.watcher = WeightWatcher(s.js, s.reg, s.counters)
        await self.watcher.start()
        if ec.eval.mode == "pipeline" or self.suite.pipeline_only():
            klass = "eval" if cfg.rollout.priority.enabled else "train"  # rollout pulls eval tasks first
            self.pipeline = PipelineEval(s.js, s.reg, self.suite, ec.eval.timeout_s, klass)
            await self.pipeline.start()

    # -- work ------------------------------------------------------------------------------

    async def work(self) -> None:
        """The baseline, then every `eval.every_versions`-th version until stopped (or
        `max_evaluations`), then the newest version if it was not evaluated yet."""
        s = self.s
        if await get_json(s.js, s.reg, EVAL_BASELINE) is None:
            # The baseline is the starting checkpoint exactly as the learner publishes it as
            # version 0 (same files), evaluated before any blob is loaded: however late the
            # scheduler starts, the baseline is never a later version.
            await self._evaluate_engine(0, 0)
            await put_json(s.js, s.reg, EVAL_BASELINE, {"version": 0, "score": s.counters["eval_score"]})
        if not await self.watcher.wait_first(s.stop):
            return
        await self._pipeline_only_round()  # the baseline of the sets only the pipeline scores
        while not s.stop.is_set():
            newest = self.watcher.newest
            if newest and (self.last_eval < 0 or newest.version >= self.last_eval + self.ec.eval.every_versions):
                await self.evaluate()
            if self.max_evaluations is not None and s.counters.get("evals", 0) >= self.max_evaluations:
                break
            try:
                await asyncio.wait_for(s.stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        if self.watcher.newest and self.watcher.newest.version != self.last_eval:
            # at stop the rollout and verifier workers are already drained: the final score
            # is always computed here, like the baseline
            await self.evaluate(local=True)

    async def evaluate(self, local: bool = False) -> None:
        """Evaluate the newest weight version: in the pipeline (eval mode `pipeline`, not
        `local`), else with this process's engine after loading it."""
        watcher = self.watcher
        if self.ec.eval.mode != "pipeline" or local:
            await watcher.maybe_load(self.engine)
            await self._evaluate_engine(watcher.loaded.version, watcher.loaded.step, watcher.loaded.metrics)
            if not local:
                await self._pipeline_only_round()
            return
        asked = watcher.newest.version
        result = await self.pipeline.evaluate(stop=self.s.stop)
        if result is None:
            return  # stopping: the final evaluation in `work` scores the newest version locally
        scores, version = result
        version = asked if version is None else version
        await self._record_scores(scores, version, watcher.steps.get(version, 0), None, groups=self.pipeline.groups)
        self.last_eval = max(asked, version)

    async def _pipeline_only_round(self) -> None:
        """A pipeline round over the sets only the pipeline scores (none: nothing), recorded
        under the version most of its trajectories used; neither gated nor counted in `evals`."""
        names = self.suite.pipeline_only()
        if not names or self.pipeline is None:
            return
        result = await self.pipeline.evaluate(stop=self.s.stop, only=names)
        if result is None:
            return
        scores, version = result
        version = self.watcher.newest.version if version is None else version
        await self._record_scores(
            scores, version, self.watcher.steps.get(version, 0), None, gated=False, groups=self.pipeline.groups
        )

    async def _evaluate_engine(self, version: int, step: int, metrics: dict | None = None) -> None:
        """Score the engine's current weights as `version` locally. A sandbox that fails under
        the evaluation's tool episodes (infrastructure: the Docker engine restarting) repeats the
        round, up to EVAL_INFRA_TRIES times, 5 s apart, before the error ends the worker."""
        from rollout_workers.agent import SandboxUnavailable

        for attempt in range(1, EVAL_INFRA_TRIES + 1):
            try:
                scores = await self.suite.evaluate(self.engine, self._open_eval_sandbox)
                break
            except SandboxUnavailable as exc:
                if attempt == EVAL_INFRA_TRIES:
                    raise
                log.warning("scheduler.eval_infra_retry", version=version, attempt=attempt, error=str(exc)[:200])
                await asyncio.sleep(5.0)
        await self._record_scores(scores, version, step, metrics)
        self.last_eval = version

    async def _open_eval_sandbox(self):
        # eval episodes run on the controlled side, in local sandboxes of the configured backend
        from sandbox_workers.async_sandbox import LocalAsyncSandbox, limits_from

        sc = self.cfg.sandbox
        return await LocalAsyncSandbox.open(
            "process" if sc.remote else sc.backend,
            image=sc.image,
            limits=limits_from(sc),
            timeout=sc.timeout_s,
            allow_degraded=sc.allow_degraded,
        )

    async def _record_scores(
        self, scores: dict, version: int, step: int, metrics: dict | None, gated: bool = True, groups=None
    ) -> None:
        """Publish one `EvalResult` per domain (with its purpose, and a pipeline round's per-group
        scores, `PipelineEval.groups`); when `gated`, run the gates on the gated sets' scores and
        count the evaluation."""
        s, suite = self.s, self.suite
        for domain, (score, n, digest) in scores.items():
            purpose = suite.purpose(domain)
            await publish(
                s.js,
                s.reg.eval(domain),
                EvalResult(
                    run_id=s.reg.run_id,
                    version=version,
                    step=step,
                    domain=domain,
                    score=score,
                    n=n,
                    eval_set_sha256=digest,
                    purpose=purpose,
                    groups=(groups or {}).get(domain, {}),
                ),
            )
            s.counters[f"eval_{domain}"] = score
            log.info(
                "scheduler.eval",
                version=version,
                domain=domain,
                score=score,
                n=n,
                mode=self.ec.eval.mode,
                purpose=purpose,
                **({"groups": groups[domain]} if groups and domain in groups else {}),
            )
        if not gated:
            return
        judged = {d: v[0] for d, v in scores.items() if suite.purpose(d) == "train"}
        await self.gates.after_eval(version, step, judged, metrics)
        first = next(iter(judged.values()), 0.0)
        s.counters.update(eval_version=version, eval_score=first, evals=s.counters.get("evals", 0) + 1)

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Run the shutdown phases in order; each runs even if an earlier one failed.

        The order follows who writes what: the recorder copies into the store what the
        final evaluation and the side tasks publish (eval results, dead letters), so it
        stops after them and then makes one last pass; the side tasks (costs, curriculum)
        and the recorder write to the store, so it closes last. (The old early exit, taken
        when stopped before any weight version, stopped the recorder before the
        dead-letterer, losing the dead letters captured in between, and skipped the rest;
        the exit after `max_evaluations` never set `stop`, so it waited for the dead-letterer
        forever. Intake stops first now, setting `stop`, on every path.)
        """
        first_error: BaseException | None = None
        for name, phase in (
            ("stop_intake", self._stop_intake),
            ("stop_side_tasks", self._stop_side_tasks),
            ("stop_recorder", self._stop_recorder),
            ("close_store", self._close_store),
        ):
            try:
                await phase()
            except Exception as exc:  # noqa: BLE001 - every phase runs; the first failure is raised below
                log.error("scheduler.shutdown_phase_failed", phase=name, error=repr(exc))
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    async def _stop_intake(self) -> None:
        """No new work: `stop` set (it ends the side tasks that follow it: with
        `max_evaluations` the loop ends without it), weight and eval-reward subscriptions left."""
        self.s.stop.set()
        if self.pipeline is not None:
            await self.pipeline.stop()
        if self.watcher is not None:
            await self.watcher.close()

    async def _stop_side_tasks(self) -> None:
        """Stop the curriculum (its own event: it publishes its state one last time) and
        wait for it and the dead-letterer, durations and costs (they end on `stop`)."""
        self.curriculum_stop.set()
        names = list(self.side_tasks)
        results = dict(zip(names, await asyncio.gather(*self.side_tasks.values(), return_exceptions=True)))
        failed = [r for r in results.values() if isinstance(r, Exception)]  # a cancelled one just ended
        if isinstance(results.get("dead_letters"), int):
            self.s.counters["max_deliveries_dead_lettered"] = results["dead_letters"]
        if isinstance(results.get("curriculum"), dict):
            self.s.counters.update(results["curriculum"])
        if failed:
            raise failed[0]

    async def _stop_recorder(self) -> None:
        """Stop the recorder; after a clean end, one last pass until the streams are idle,
        so the final eval and rewards are in."""
        if self.recorder is None:
            return
        self.recorder_stop.set()
        counts = await self.recorder
        if not self.completed:
            return
        s = self.s
        tail = await record(s.js, s.reg, self.store, stop=asyncio.Event(), until_idle=1.0)
        s.counters.update({f"recorded_{k}": v + tail.get(k, 0) for k, v in counts.items()})

    async def _close_store(self) -> None:
        """Mark the run `stopped` (after a clean end only) and close the store."""
        if self.store is None:
            return
        try:
            if self.completed:
                await asyncio.to_thread(self.store.set_run_status, self.s.reg.run_id, "stopped")
        finally:
            await asyncio.to_thread(self.store.close)


async def run(cfg: RunConfig, ctx: WorkerContext) -> dict[str, float]:
    """Evaluate versions until stopped (or `ctx.max_messages` evaluations); returns the counters."""
    async with worker_session("scheduler", cfg, ctx) as s:
        return await SchedulerWorker(s).run()
