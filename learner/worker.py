"""The learner process: rewards in, policy steps, weight versions out.

Read it top to bottom: set up (model, reference, optimizer, resume), publish version 0,
then loop: pull rewards -> pool into groups -> when enough groups are ready (or the
time window closes) take one GRPO step -> ack, record task fates, publish weights every
K steps, checkpoint every C steps.

Guarantees:
- A reward is acked only after the step that used it (or after it is filtered with a
  recorded reason), so a learner crash redelivers everything not yet trained.
- Each sample, identified by (group_id, sample_index), is trained at most once per
  run: duplicates are acked and counted, never trained again (the trained set is
  checkpointed).
- Every task the learner touches gets a ledger record: `trained` (with the reward
  msg_ids), `filtered` (with the reason), or `pending` at stop.
- Exact resume: a checkpoint holds model, optimizer, RNG, step, the REWARDS position
  (the consumer's ack floor) and the trained set. A learner that starts on a run whose
  learner consumer already made progress restores the checkpoint (or the start model if
  there is none), publishes a ledger rollback marker (records after the checkpoint are
  superseded), and re-reads REWARDS from the checkpoint's position, skipping what the
  checkpoint already trained: every reward ends up trained exactly once in the model's
  lineage. Weight version numbers stay monotonic across restarts.
- The weight store holds the newest `learner.keep_versions` versions plus version 0 and
  the released one; older blobs are deleted after each publish (`learner.retention`).
- At most one learner per run trains at a time: it must hold the KV lease `learner.lease`
  (see `learner.lease`); a second one waits, and one that loses its lease stops.
- `learner.world_size` = N > 1: this process is rank 0 and alone talks to the bus; it
  starts ranks 1..N-1 after taking the lease (`learner.ranks`), broadcasts each step's
  batch, and every rank steps its FSDP2 shard. The weights it publishes are gathered to
  its CPU; checkpoints are DCP (`checkpoints/learner.dcp/`) holding the same state, so
  the guarantees above hold unchanged. A rank that dies ends every rank (rank 0 exits
  with `learner.ranks.RANK_DIED_EXIT`) and the restarted learner resumes from the last
  checkpoint. A configuration the machine cannot run (`learner.distributed.world_problem`)
  exits at start with one line saying what to set, before any rank starts.
- `learner.launch = "external"` (one rank per process, started from outside: pods, srun
  tasks): every rank runs this same worker; the environment says which rank it is
  (`learner.rendezvous.resolve`). Rank 0 runs exactly as above, its ranks joining at
  MASTER_ADDR:MASTER_PORT instead of being its children; ranks 1..N-1 never open a bus
  session (`learner.rendezvous.run_follower`). A missing or bad variable, or a rendezvous
  that times out, exits with one line naming what to set.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from nats.js.errors import NotFoundError

from bus.conn import ensure_consumer, ensure_consumer_from
from bus.kv import LEARNER_OVERRIDES, LEARNER_PROGRESS, WEIGHTS_LATEST, get_json, put_json
from bus.publish import publish
from bus.pull import decode_batch, fetch
from bus.session import WorkerContext, worker_session
from bus.weight_stores import make_store
from learner import checkpoint
from learner.distributed import world_problem
from learner.groups import Group, GroupPool, PooledSample, partition
from learner.lease import LearnerLease
from learner.retention import Retention
from learner.step import load_models, skipped_loss_scale, train_step
from learner.weights import publish_version
from schemas import Reward, TaskFate, TaskFates
from schemas.config import RunConfig

log = structlog.get_logger()
OVERRIDES_EVERY = 5  # steps between reads of the overrides


class Learner:
    """State carried between steps (kept small on purpose)."""

    def __init__(self, s, policy, ref, optimizer, pad_id, group=None):
        self.s, self.policy, self.ref, self.optimizer, self.pad_id = s, policy, ref, optimizer, pad_id
        self.group = group  # learner.ranks.RankGroup when world_size > 1 (then policy/ref/optimizer are None)
        self.lc = s.cfg.learner
        self.pool = GroupPool(self.lc.group_deadline_s)
        self.step, self.version, self.tasks_done, self.samples_trained = 0, 0, 0, 0
        self.tasks_done_by_pool: dict[str, int] = {}  # what the sampler's per-pool gates subtract
        self.trained: set[str] = set()  # reward msg_ids trained (for exactly-once)
        self.last_step_at = time.monotonic()
        self.short_window_at = -1.0  # last_step_at of the window last logged as short
        self.ckpt_path = s.ctx.run_path / "checkpoints" / "learner.pt"
        self.dcp_root = s.ctx.run_path / "checkpoints" / "learner.dcp"  # world_size > 1
        self.ledger_seq = 0  # LEDGER sequence of this learner's last record (checkpointed)
        self.store = make_store(self.lc.weight_store, s.js, s.reg)  # where weight blobs go (nats, file://, s3://)
        self.retention = Retention(self.store, self.lc.keep_versions, s.js, s.reg)  # deletes superseded blobs

    def state(self, rewards_ack_floor: int = 0) -> dict:
        """What a checkpoint records besides model/optimizer: counters, the trained set,
        and the position in the REWARDS log (the learner consumer's ack floor)."""
        return {
            "step": self.step,
            "version": self.version,
            "tasks_done": self.tasks_done,
            "tasks_done_by_pool": self.tasks_done_by_pool,
            "samples_trained": self.samples_trained,
            "trained": sorted(self.trained),
            "rewards_ack_floor": rewards_ack_floor,
            "ledger_seq": self.ledger_seq,
        }

    async def rewards_position(self) -> int:
        """Stream sequence below which every reward is acked (0 if the consumer is missing)."""
        try:
            info = await self.s.js.consumer_info(self.s.reg.stream("REWARDS"), "learner")
        except NotFoundError:
            return 0
        # Any other error (timeout, no responders, 503) propagates: answering 0 would checkpoint
        # an ack floor of 0, and the next resume would replay the whole REWARDS log and re-decide
        # (re-record) every reward the checkpoint had already filtered.
        return info.ack_floor.stream_seq if info.ack_floor else 0

    @property
    def has_model(self) -> bool:
        """False for the null policy (nothing to checkpoint)."""
        return self.policy is not None or self.group is not None

    async def weights(self):
        """What `publish_version` publishes: the policy, or the ranks' gathered full state."""
        return await self.group.full_state() if self.group else self.policy

    async def save_checkpoint(self) -> None:
        """Write model, optimizer, RNG and state atomically."""
        state = self.state(await self.rewards_position())
        if self.group:
            await self.group.save(self.dcp_root, state)
            return
        await asyncio.to_thread(
            checkpoint.save, self.ckpt_path, model=self.policy, optimizer=self.optimizer, state=state
        )

    async def load_checkpoint(self) -> dict | None:
        """Restore the last checkpoint into the model(s); its state, or None."""
        if self.group:
            return await self.group.load(self.dcp_root)
        if self.policy is None:
            return None
        return await asyncio.to_thread(checkpoint.load, self.ckpt_path, model=self.policy, optimizer=self.optimizer)

    async def record(self, fates: list[TaskFate], rollback_after_seq: int | None = None) -> None:
        """Publish task fates (or a rollback marker) to the ledger; remember its sequence."""
        if fates or rollback_after_seq is not None:
            ack = await publish(
                self.s.js,
                self.s.reg.ledger("learner"),
                TaskFates(
                    run_id=self.s.reg.run_id,
                    stage="learner",
                    step=self.step,
                    fates=fates,
                    rollback_after_seq=rollback_after_seq,
                ),
            )
            self.ledger_seq = ack.seq

    async def restore(self, saved: dict | None) -> None:
        """Continue a run: restore counters, supersede post-checkpoint ledger records and
        replay REWARDS from the checkpoint's position (see the module docstring)."""
        js, reg = self.s.js, self.s.reg
        spec = reg.learner_consumer()
        try:
            info = await js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:  # a fresh run; a transient error must not pass for one (it propagates)
            info = None
        progressed = info is not None and (
            info.delivered.stream_seq > 0 or (info.ack_floor and info.ack_floor.stream_seq > 0)
        )
        latest = await get_json(js, reg, WEIGHTS_LATEST) or {}
        if saved:
            self.step, self.tasks_done = saved["step"], saved["tasks_done"]
            self.tasks_done_by_pool = dict(saved.get("tasks_done_by_pool") or {"short": self.tasks_done})
            self.samples_trained, self.trained = saved["samples_trained"], set(saved["trained"])
        self.version = max(int(latest.get("version", 0)), saved["version"] if saved else 0)
        if not progressed:
            return
        floor = int(saved.get("rewards_ack_floor", 0)) if saved else 0
        after = int(saved.get("ledger_seq", 0)) if saved else 0
        await self.record([], rollback_after_seq=after)
        await js.delete_consumer(spec.stream, spec.durable)
        await ensure_consumer_from(js, spec, floor + 1)
        self.s.counters["resumed_from_step"] = self.step
        log.info(
            "learner.resumed",
            step=self.step,
            version=self.version,
            replay_from_seq=floor + 1,
            trained_in_checkpoint=len(self.trained),
            ledger_rollback_after=after,
        )

    async def take(self, raws) -> None:
        """Decode fetched rewards and pool them (duplicates acked and counted)."""
        now = time.monotonic()
        for d in await decode_batch(self.s.js, self.s.reg, "learner", raws, Reward):
            if d.msg.trajectory.purpose != "train":
                await d.raw.ack()
                continue
            if d.msg.msg_id in self.trained or not self.pool.add(PooledSample(d.msg, d.raw), now):
                self.s.counters["duplicates"] = self.s.counters.get("duplicates", 0) + 1
                await d.raw.ack()

    @property
    def refill(self) -> bool:
        """DAPO batch filling: only groups whose rewards differ count towards a step."""
        return self.lc.skip_zero_variance and self.lc.refill_skipped

    def should_step(self) -> bool:
        """A full batch (`groups_per_step` ready groups), or the time window closed with at
        least `min_groups_per_step`; a window that closes short is logged with its reason
        (once per window) and extended."""
        now = time.monotonic()
        ready = self.pool.count_ready(now, informative_only=self.refill)
        if ready >= self.lc.groups_per_step:
            return True
        if now - self.last_step_at < self.lc.step_window_s:
            return False
        if ready >= self.lc.min_groups_per_step:
            return True
        if self.refill and self.pool.count_ready(now) > 0:
            return True  # only groups to filter: consume them (the sampler's gate counts them done)
        if self.short_window_at != self.last_step_at:
            self.short_window_at = self.last_step_at
            self.s.counters["short_windows"] = self.s.counters.get("short_windows", 0) + 1
            log.info(
                "learner.window_short",
                ready=ready,
                needed=self.lc.min_groups_per_step,
                incomplete=len(self.pool.pending()),
                window_s=self.lc.step_window_s,
                reason="fewer complete groups than min_groups_per_step; waiting for more",
            )
        return False

    async def step_once(self) -> None:
        """One window: collect the ready groups -> partition them -> train -> record, ack,
        report (acks come after the step, so a crash in it redelivers the window)."""
        ready, expired = self.pool.pop_ready(time.monotonic(), self.lc.groups_per_step, informative_only=self.refill)
        part = partition(
            ready,
            expired,
            self.version,
            max_staleness=self.lc.max_staleness,
            skip_zero_variance=self.lc.skip_zero_variance,
        )
        self.s.counters["stale_samples"] = self.s.counters.get("stale_samples", 0) + part.stale_samples
        samples = [s for g in part.train for s in g.samples.values()]
        metrics = await self.train(samples, part.skipped) if samples else {}
        self.count_done(ready + expired)
        await self.record(part.fates)
        for raw in part.to_ack:
            await raw.ack()
        self.last_step_at = time.monotonic()
        if samples:
            await self.after_step(metrics)
        elif ready or expired:  # consumed without a step (all filtered): the sampler's gate must see it
            await self.progress()

    async def train(self, samples: list[PooledSample], skipped: list[Reward]) -> dict[str, float]:
        """One optimizer step on `samples`; returns its metrics (staleness included)."""
        scale = (
            skipped_loss_scale(self.lc.objective, [s.reward for s in samples], skipped)
            if self.lc.skipped_keep_scale
            else 1.0
        )
        if self.group:
            metrics = await self.group.train(samples, self.lc, loss_scale=scale)
        else:
            metrics = await asyncio.to_thread(
                train_step, self.policy, self.ref, self.optimizer, samples, self.pad_id, self.lc, loss_scale=scale
            )
        lags = [self.version - s.reward.trajectory.oldest_version for s in samples]  # from the oldest token
        metrics.update(staleness_mean=sum(lags) / len(lags), staleness_max=float(max(lags)))
        self.step += 1
        self.samples_trained += len(samples)
        self.trained.update(s.reward.msg_id for s in samples)
        return metrics

    def count_done(self, groups: list[Group]) -> None:
        """Count consumed tasks, in total and per pool (what the sampler's per-pool gates subtract)."""
        self.tasks_done += len(groups)
        for g in groups:
            pool = next(iter(g.samples.values())).reward.trajectory.pool if g.samples else "short"
            self.tasks_done_by_pool[pool] = self.tasks_done_by_pool.get(pool, 0) + 1

    async def after_step(self, metrics: dict[str, float]) -> None:
        """Publish weights every K steps, checkpoint every C, report progress."""
        c = self.s.counters
        c.update({k: v for k, v in metrics.items()})
        c.update(step=self.step, samples_trained=self.samples_trained, tasks_done=self.tasks_done)
        c["tokens_trained"] = c.get("tokens_trained", 0) + float(metrics.get("tokens", 0))
        log.info("learner.step", step=self.step, version=self.version, **{k: round(v, 4) for k, v in metrics.items()})
        if self.step % self.lc.publish_every == 0:
            self.version += 1
            await publish_version(
                self.s.js,
                self.s.reg,
                await self.weights(),
                self.version,
                self.step,
                {**metrics, "samples_trained": float(self.samples_trained)},
                store=self.store,
                nc=self.s.nc,
            )
            c["version"] = self.version
            c["weights_deleted"] = c.get("weights_deleted", 0) + await self.retention.after_publish(self.version)
        if self.step % self.lc.checkpoint_every == 0 and self.has_model:
            await self.save_checkpoint()
        if self.step % OVERRIDES_EVERY == 0:
            await self.apply_overrides()
        await self.progress()

    async def apply_overrides(self) -> None:
        """Take the scheduler's forgetting-guard overrides (KV `learner.overrides`): a larger
        replay share and/or KL beta. A beta > 0 without a reference model loads one first."""
        o = await get_json(self.s.js, self.s.reg, LEARNER_OVERRIDES)
        if not o:
            return
        now = {"replay_share": self.lc.replay.share, "beta": self.lc.beta}  # KV keys -> current values
        updates = {k: float(o[k]) for k in now if k in o and float(o[k]) != now[k]}
        if not updates:
            return
        if updates.get("beta", 0) > 0 and self.ref is None and self.policy is not None:
            from transformers import AutoModelForCausalLM

            self.ref = (await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, self.s.ctx.model_path)).eval()
            self.ref.requires_grad_(False)
        replay = self.lc.replay.model_copy(update={"share": updates.get("replay_share", self.lc.replay.share)})
        self.lc = self.lc.model_copy(update={"beta": updates.get("beta", self.lc.beta), "replay": replay})
        self.s.counters.update({f"override_{k}": v for k, v in updates.items()})
        log.warning("learner.overrides_applied", reason=o.get("reason"), **updates)

    async def progress(self) -> None:
        """KV learner.progress: what the sampler's gate and the live view read."""
        await put_json(
            self.s.js,
            self.s.reg,
            LEARNER_PROGRESS,
            {
                "step": self.step,
                "version": self.version,
                "tasks_done": self.tasks_done,
                "tasks_done_by_pool": self.tasks_done_by_pool,
                "samples_trained": self.samples_trained,
                "reward_mean": self.s.counters.get("reward_mean"),
                "updated_at": time.time(),
            },
        )


async def bind_learner_consumer(js, reg):
    """Bind to the learner durable, creating it only when missing (a replaying durable made
    by `restore` keeps its start position; re-adding it with another policy would fail)."""
    spec = reg.learner_consumer()
    try:
        await js.consumer_info(spec.stream, spec.durable)
    except NotFoundError:  # only a missing durable is (re)created; other errors propagate
        await ensure_consumer(js, spec)
    return await js.pull_subscribe_bind(spec.durable, stream=spec.stream)


async def external_rank(cfg: RunConfig, ctx: WorkerContext):
    """`learner.launch = "external"`: rank 0's `Rendezvous`; on ranks 1..N-1 serve rank 0 (no bus)
    and return None. A missing variable or a failed rendezvous exits with what to set."""
    from learner.rendezvous import RendezvousError, resolve, run_follower

    try:
        rendezvous = resolve(cfg.learner)
        if rendezvous.rank == 0:
            return rendezvous
        await asyncio.to_thread(run_follower, cfg, ctx.model_path, rendezvous)
        return None
    except RendezvousError as exc:
        raise SystemExit(f"rlbus worker learner: {exc}") from None


async def start_ranks(group) -> None:
    """`group.start()`, a failed rendezvous (external launch) an exit with what to check."""
    from learner.rendezvous import RendezvousError

    try:
        await group.start()
    except RendezvousError as exc:
        raise SystemExit(f"rlbus worker learner: {exc}") from None


async def run(cfg: RunConfig, ctx: WorkerContext) -> dict[str, float]:
    """Run the learner until stopped (or `ctx.max_messages` steps)."""
    lc = cfg.learner
    problem = world_problem(lc)  # before the bus, before any rank: one line saying what to set
    if problem:
        raise SystemExit(f"rlbus worker learner: {problem}")
    rendezvous = None
    if lc.world_size > 1 and lc.launch == "external":
        rendezvous = await external_rank(cfg, ctx)
        if rendezvous is None:  # a follower rank: it served rank 0 until `stop`
            return {}
    if lc.policy != "null":
        import torch
    async with worker_session("learner", cfg, ctx) as s:
        group = None
        if lc.policy == "null" or lc.world_size > 1:
            policy = ref = optimizer = pad_id = None
        else:
            policy, ref, pad_id = await asyncio.to_thread(load_models, ctx.model_path, lc)
            optimizer = torch.optim.AdamW(policy.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)
        lease = LearnerLease(s.js, s.reg)
        if not await lease.acquire(s.stop):
            return s.counters
        lease_keeper = asyncio.create_task(lease.keep(s.stop))
        try:
            if lc.world_size > 1:
                from learner.ranks import RankGroup

                group = RankGroup(lc, ctx.model_path, ctx.run_path, rendezvous=rendezvous)
                await start_ranks(group)
            L = Learner(s, policy, ref, optimizer, pad_id, group=group)
            await serve(L, lease, ctx.max_messages)
            if group and not lease.lost:
                await group.close()
        finally:
            if group:
                group.abort()  # no-op after a clean close; kills the ranks on any error
            lease_keeper.cancel()
        if not lease.lost:
            await lease.release()
        return s.counters


async def serve(L: Learner, lease: LearnerLease, max_steps: int | None) -> None:
    """Resume, announce the weights, then train until stopped or `max_steps` optimizer steps
    (the learner's unit of the generic message limit); at stop record what is still
    pending and checkpoint (not when fenced: the lease's new holder owns the run)."""
    s = L.s
    await L.restore(await L.load_checkpoint())
    if (await get_json(s.js, s.reg, WEIGHTS_LATEST)) is None:
        await publish_version(s.js, s.reg, await L.weights(), 0, 0, {}, store=L.store)
    elif s.counters.get("resumed_from_step") is not None:
        L.version += 1  # the restored weights, announced under a new (monotonic) version
        await publish_version(s.js, s.reg, await L.weights(), L.version, L.step, {}, store=L.store)
    s.counters.update(step=L.step, version=L.version)
    await L.progress()
    sub = await bind_learner_consumer(s.js, s.reg)
    while not s.stop.is_set():
        if max_steps is not None and L.step >= max_steps:
            break
        await L.take(await fetch(sub, 512, 0.2))
        while L.should_step() and not s.stop.is_set():
            await L.step_once()
    if lease.lost:
        log.error("learner.fenced", why="another learner took the lease; stopping without recording")
        return
    await L.record([TaskFate(task_msg_id=g.task_msg_id, fate="pending") for g in L.pool.pending()])
    if L.has_model:
        await L.save_checkpoint()
