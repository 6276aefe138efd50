"""The verifier worker process: trajectories in, Rewards out.

Guarantees:
- Every trajectory either yields exactly one published `Reward` before its ack, or is
  dead-lettered with the reason: at once for unusable input (unknown verifier, bad
  parameters, reward weights naming a component the trajectory does not have), after
  retries for infrastructure failures.
- Artifacts a trajectory carries by reference (`Trajectory.artifact_refs`: a large diff) are
  fetched from the run's payload bucket and checked (size, sha256) before its verifier runs,
  which sees them in `artifacts`; the published Reward embeds the trajectory as it arrived
  (refs, not bytes). A missing or corrupt object (`PayloadUnavailable`) is an infrastructure
  failure like the next point's.
- Infrastructure failures are never rewards: a `VerifierInfraError`, `HiddenDataMissing`,
  `PayloadUnavailable` or any unexpected exception a verifier raises naks the trajectory with
  a wait that doubles per delivery (`RetryPolicy`), and on the consumer's last delivery dead-letters
  it with error_type `infra_error`. No Reward, least of all one of 0, is published for it.
- The scalar reward is the weighted sum of the verifier's components plus the process
  components (`turns_used`, `tool_success_rate`), with the domain's `reward_weights`,
  else the verifier's own weights.
- The check is the task's, never the trajectory's: the verifier name, its params, the reward
  weights and the hidden ref come from the task's check in the hidden bucket, which only the
  task's publisher wrote (`bus.checks`); the rollout side's copies are replaced before anything
  is scored (the Reward embeds the bound trajectory; a copy that differed is counted in the
  worker's `check_forged` counter and logged with the fields it changed). No check for the task: `HiddenDataMissing`, an
  infrastructure failure (next point), never a reward from the trajectory's own fields.
  Resource params are clamped to the operator's maxima (`verifier.max_*`) by each verifier.
- A trajectory with a tool observation no recorded execution vouches for scores 0 with
  status `tamper`, without running its verifier.
- A Reward's msg_id derives from its trajectory's: a redelivery cannot create a second one.
- With `verifier.concurrency` > 0, at most that many verifications run at once, in
  worker threads unless a verifier was measured to be cheap (`InlinePolicy`), so a slow
  verifier never stalls acks and in_progress; 0 runs them all on the loop thread.
- Each trajectory is acked as soon as its own Reward is out: a slow one never holds back
  the others.
- A verifier with a `batched` hook (the `model` verifier) is scored through
  `rm_serving.RmBatcher` (`verifier.rm`: batch size, timeout, normalisation; a task in
  pairwise mode always, whatever the batch size): one call for the trajectories this worker
  holds, each still getting its own Reward or failure.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn

import structlog

from bus.checks import CheckCache, bind
from bus.conn import pull_subscription
from bus.hidden import HiddenCache, HiddenDataMissing
from bus.payloads import PayloadUnavailable, resolve_artifacts
from bus.publish import publish_many
from bus.pull import Delivery, Reject, Retry, run_pull_stream
from bus.session import WorkerContext, worker_session
from schemas import Reward, Trajectory
from schemas.agent_task import HARNESS_ERROR, agent_record
from schemas.config import RunConfig, VerifierSection
from verifier_workers import registry
from verifier_workers.errors import VerifierCrash, VerifierInfraError
from verifier_workers.rm_serving import RmBatcher
from verifier_workers.verdict import Verdict, VerifierInputError, compose

log = structlog.get_logger()

INLINE_BELOW_S = 0.0005  # a verifier whose mean verify time is below this runs on the loop thread
INLINE_WARMUP = 32  # threaded calls measured before a verifier may run inline
DEFAULT_RETRY_BASE_S = 1.0
DEFAULT_RETRY_MAX_S = 60.0
MIN_NAK_S = 0.01
_EXIT = re.compile(r"<obs\b[^>]*?\bexit\s*=\s*(-?\d+)", re.IGNORECASE)


# -- reward composition ----------------------------------------------------------------


def tool_success_rate(traj: Trajectory) -> float | None:
    """Fraction of tool executions that exited 0, or None when the episode used no tools.

    The structured `traj.tool_calls` are used when present; otherwise each `tool` turn
    counts, succeeding iff it holds at least one `<obs exit=N ...>` tag and every such
    tag says exit=0 (a tool turn without one, e.g. a refused call, is a failure).
    """
    if traj.tool_calls:
        return sum(c.exit_code == 0 for c in traj.tool_calls) / len(traj.tool_calls)
    tool_turns = [t.text for t in traj.turns if t.role == "tool"]
    if not tool_turns:
        return None
    ok = 0
    for text in tool_turns:
        codes = _EXIT.findall(text)
        ok += bool(codes) and all(int(c) == 0 for c in codes)
    return ok / len(tool_turns)


def process_components(traj: Trajectory) -> dict[str, float]:
    """Components every trajectory gets: `turns_used`, and `tool_success_rate` when tools ran."""
    out = {"turns_used": float(sum(t.role == "assistant" for t in traj.turns))}
    rate = tool_success_rate(traj)
    if rate is not None:
        out["tool_success_rate"] = rate
    return out


def configured_weights(traj: Trajectory) -> dict[str, float] | None:
    """The domain's `reward_weights` (`Trajectory.reward_weights`, finite numbers by the
    schema; None: verifier default). Weights inside `verifier_params`, where they travelled
    before they were a field, are refused rather than silently ignored."""
    if "reward_weights" in traj.verifier_params:
        raise VerifierInputError(
            "verifier_params.reward_weights is not read: reward weights travel as "
            "Task.reward_weights / Trajectory.reward_weights"
        )
    return dict(traj.reward_weights) or None


def compose_reward(traj: Trajectory, verdict: Verdict) -> tuple[float, dict[str, float]]:
    """(scalar, components): the verdict's components plus process ones, weighted."""
    components = {**process_components(traj), **verdict.components}
    weights = configured_weights(traj)
    if weights is not None:
        unknown = sorted(set(weights) - set(components))
        if unknown:
            raise VerifierInputError(
                f"reward_weights name unknown components {unknown}; verifier "
                f"{traj.verifier!r} gave {sorted(components)}"
            )
    else:
        weights = dict(verdict.weights)
    try:
        return compose(components, weights), components
    except ValueError as exc:  # a non-finite component: the verifier's bug, not the policy's
        raise VerifierCrash(f"verifier {traj.verifier!r}: {exc}") from exc


def run_verifier(traj: Trajectory, hidden: dict | None) -> Verdict:
    """Call the trajectory's verifier; anything unexpected it raises becomes a VerifierCrash."""
    fn = registry.get(traj.verifier)
    try:
        return fn(traj, hidden) if traj.hidden_ref else fn(traj)
    except (VerifierInputError, VerifierInfraError):
        raise
    except Exception as exc:
        raise VerifierCrash(f"verifier {traj.verifier!r} crashed: {type(exc).__name__}: {exc}") from exc


def score(
    traj: Trajectory,
    hidden: dict | None = None,
    embed: Trajectory | None = None,
    verdict: Verdict | None = None,
    t0: float | None = None,
) -> Reward:
    """Verify one trajectory and compose its Reward (which embeds `embed`, default `traj`: the
    trajectory as it arrived when `traj` is its copy with artifacts resolved). A harness-owned
    episode whose harness crashed after the policy acted (`schemas.agent_task`) scores 0 with
    status `harness_error` and the harness's stderr tail, without running the verifier.

    `verdict` (with the time `t0` it was asked at): already computed (`rm_serving.RmBatcher`).

    Raises VerifierInputError (unusable task) or VerifierInfraError (retry later).
    """
    t0 = time.perf_counter() if t0 is None else t0
    record = agent_record(traj)
    if record is not None and record.get("status") == HARNESS_ERROR:  # the harness crashed after the policy acted
        reward, components = 0.0, {"correct": 0.0, **process_components(traj)}
        verdict = Verdict(components, status=HARNESS_ERROR, details=f"harness exit {record.get('exit_code')}: "
                          f"{str(record.get('stderr_tail', ''))[-1500:]}")  # fmt: skip
    else:
        verdict = run_verifier(traj, hidden) if verdict is None else verdict
        reward, components = compose_reward(traj, verdict)
    traj = embed if embed is not None else traj
    return Reward(
        run_id=traj.run_id,
        msg_id=f"rw-{traj.msg_id}",
        trajectory=traj,
        reward=reward,
        components=components,
        status=verdict.status,
        details=verdict.details[:2000],
        verify_seconds=time.perf_counter() - t0,
        sandbox_seconds=verdict.sandbox_s,
    )


# -- retries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How infrastructure failures are retried: delays by delivery count, then the DLQ.

    JetStream quirk: on a consumer with `backoff`, a nak's delay is added to
    (backoff[n-1] - ack_wait) for delivery n. The nak delay subtracts that, so the wait
    is the policy's delay whenever it exceeds the consumer's own backoff, else the latter.
    """

    max_deliver: int
    base_s: float = DEFAULT_RETRY_BASE_S
    max_s: float = DEFAULT_RETRY_MAX_S
    ack_wait_s: float = 0.0
    backoff_s: tuple[float, ...] = ()

    def delay(self, delivered: int) -> float:
        """Wanted wait after delivery `delivered` (1-based): base x 2^(n-1), capped."""
        return min(self.max_s, self.base_s * 2 ** max(0, delivered - 1))

    def server_extra(self, delivered: int) -> float:
        """What the consumer's backoff adds to a nak delay after delivery `delivered`."""
        if not self.backoff_s:
            return 0.0
        return max(0.0, self.backoff_s[min(delivered, len(self.backoff_s)) - 1] - self.ack_wait_s)

    def nak_delay(self, delivered: int) -> float:
        """The delay to nak with so the redelivery comes after `delay(delivered)` (or the server's floor)."""
        return max(MIN_NAK_S, self.delay(delivered) - self.server_extra(delivered))

    def fail(self, delivered: int, exc: Exception) -> NoReturn:
        """Raise Retry (with backoff), or Reject (dead letter) on the consumer's last delivery."""
        reason = f"infra_error: {type(exc).__name__}: {exc}"
        if delivered >= self.max_deliver:
            raise Reject(f"{reason} (gave up after {delivered} deliveries)", error_type="infra_error") from exc
        raise Retry(delay=self.nak_delay(delivered), reason=reason) from exc


def retry_policy(vc: VerifierSection, spec) -> RetryPolicy:
    """The policy of a verifier config section on consumer `spec`."""
    return RetryPolicy(spec.max_deliver, vc.retry_base_s, vc.retry_max_s, spec.ack_wait_s, tuple(spec.backoff_s))


# -- the worker --------------------------------------------------------------------------


def observation_turns(traj: Trajectory) -> list:
    """Every text the policy side produced or relayed, as integrity inputs: tool turns with
    the exec_id of the call before them, model turns as plain text (no execution behind)."""
    from sandbox_workers.integrity import ToolTurn

    exec_of_turn = {c.turn + 1: c.exec_id or None for c in traj.tool_calls}
    out = []
    for i, t in enumerate(traj.turns):
        if t.role == "tool":
            out.append(ToolTurn(exec_of_turn.get(i), t.text))
        elif t.role == "assistant":
            out.append(ToolTurn(None, t.text))
    return out


def tamper_reward(traj: Trajectory, forged: list) -> Reward:
    """The Reward of a trajectory carrying forged tool observations: 0, status `tamper`."""
    reasons = sorted({f.reason for f in forged})
    return Reward(
        run_id=traj.run_id,
        msg_id=f"rw-{traj.msg_id}",
        trajectory=traj,
        reward=0.0,
        components={"correct": 0.0, "forged_observations": float(len(forged)), **process_components(traj)},
        status="tamper",
        details=f"forged tool observations: {reasons}"[:2000],
    )


class InlinePolicy:
    """Which verifiers are cheap enough to run on the event loop thread.

    Per verifier name: a moving mean (factor `alpha`) of measured verify seconds. A
    verifier runs inline once `warmup` calls were measured and while the mean is below
    `below_s`; any slow call (inline or not) raises the mean, so a verifier that turns
    slow goes back to threads after a call or two.
    """

    def __init__(self, below_s: float = INLINE_BELOW_S, warmup: int = INLINE_WARMUP, alpha: float = 0.1):
        self.below_s, self.warmup, self.alpha = below_s, warmup, alpha
        self.mean: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def inline(self, verifier: str) -> bool:
        return self.calls.get(verifier, 0) >= self.warmup and self.mean[verifier] < self.below_s

    def observe(self, verifier: str, seconds: float) -> None:
        n = self.calls.get(verifier, 0)
        self.mean[verifier] = seconds if n == 0 else self.mean[verifier] + self.alpha * (seconds - self.mean[verifier])
        self.calls[verifier] = n + 1


RESOURCE_PARAMS = {"timeout_s": "max_timeout_s", "memory_mb": "max_memory_mb", "cpus": "max_cpus", "pids": "max_pids"}
"""verifier_params that size a verification's sandbox -> the VerifierSection field that caps each."""


def clamp_resources(traj: Trajectory, vc: VerifierSection) -> Trajectory:
    """`traj` with its resource params (RESOURCE_PARAMS) clamped to the operator's maxima; other
    values, and params that are not numbers (the verifier refuses those), are left as they are."""
    vp, changed = dict(traj.verifier_params), False
    for key, cap_field in RESOURCE_PARAMS.items():
        value, cap = vp.get(key), getattr(vc, cap_field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value <= cap:
            vp[key] = cap
            changed = True
    if not changed:
        return traj
    return Trajectory.model_validate({**traj.model_dump(), "verifier_params": vp})


class Scorer:
    """Scores deliveries concurrently (bounded); failures are raised as pull-loop outcomes (Retry, Reject)."""

    def __init__(
        self,
        hidden: HiddenCache,
        policy: RetryPolicy,
        concurrency: int,
        js=None,
        reg=None,
        secret: bytes | None = None,
        retarget=None,
        limits: VerifierSection | None = None,
        run_path=None,
    ) -> None:
        self.hidden, self.policy, self.concurrency = hidden, policy, concurrency
        self.limits = limits or VerifierSection()
        self.checks = CheckCache(js, reg) if js is not None else None
        self.retarget = retarget  # the operator's own override after binding (`rlbus rescore --verifier/--set`)
        self.forged_checks = 0
        self.slots = asyncio.Semaphore(max(1, concurrency))
        # its own threads: the loop's default executor has only min(32, cpus + 4) of them
        self.executor = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="verify")
        self.js, self.reg, self.secret = js, reg, secret
        self.inline_policy = InlinePolicy()
        self.inline_calls = 0
        rm = self.limits.rm  # batched verifiers (the `model` one) go through the batcher
        self.batching = rm.batch_size > 1 or rm.normalize != "none"
        self.batcher = RmBatcher(rm, self.executor, run_path)  # pairwise tasks need it whatever the batch size

    async def _batched(self, fn, traj: Trajectory, payload: dict | None, embed: Trajectory) -> Reward:
        """Score through the batcher (`verifier_workers.rm_serving`); failures as `run_verifier`'s."""
        t0 = time.perf_counter()
        try:
            verdict = await self.batcher.verdict(fn, traj, payload)
        except (VerifierInputError, VerifierInfraError):
            raise
        except Exception as exc:
            raise VerifierCrash(f"verifier {traj.verifier!r} crashed: {type(exc).__name__}: {exc}") from exc
        return score(traj, payload, embed, verdict=verdict, t0=t0)

    async def forged(self, traj: Trajectory) -> list:
        """Observation blocks of `traj` that no recorded execution vouches for."""
        from sandbox_workers.integrity import find_observations, verify_observations

        turns = observation_turns(traj)
        if not any(find_observations(t.text) for t in turns):
            return []
        if self.secret is None:
            raise VerifierInfraError(
                "trajectory has tool observations but this verifier has no tool secret "
                "(set RLBUS_TOOL_SECRET or RLBUS_TOOL_SECRET_FILE as for the sandbox side)"
            )
        _, forged = await verify_observations(self.js, self.reg, self.secret, turns)
        return forged

    async def _score(self, traj: Trajectory, payload: dict | None) -> Reward:
        embed = traj
        if traj.artifact_refs:
            if self.js is None:
                raise VerifierInfraError("trajectory has artifacts by reference but this scorer has no bus connection")
            traj = await resolve_artifacts(self.js, self.reg, traj)
        batched = RmBatcher.batched_fn(registry.get(traj.verifier))
        if batched is not None and (self.batching or self.batcher.needs_group(traj)):
            return await self._batched(batched, traj, payload, embed)
        if self.concurrency <= 0:
            return score(traj, payload, embed)
        if self.inline_policy.inline(traj.verifier):
            self.inline_calls += 1
            t0 = time.perf_counter()
            try:
                return score(traj, payload, embed)
            finally:
                self.inline_policy.observe(traj.verifier, time.perf_counter() - t0)
        async with self.slots:
            reward = await asyncio.get_running_loop().run_in_executor(self.executor, score, traj, payload, embed)
        self.inline_policy.observe(traj.verifier, reward.verify_seconds)
        return reward

    async def bound(self, traj: Trajectory) -> Trajectory:
        """`traj` with its task's check (module guarantees); HiddenDataMissing without one."""
        if self.checks is None:
            raise VerifierInfraError("this scorer has no bus connection to read the task's check from")
        check = await self.checks.get(traj.domain, traj.task_id)
        out, forged = bind(traj, check)
        if forged:
            self.forged_checks += 1
            log.warning("verifier.check_forged", fields=forged, task_id=traj.task_id, msg_id=traj.msg_id)
        out = self.retarget(out) if self.retarget is not None else out
        return clamp_resources(out, self.limits)

    async def one(self, d: Delivery) -> Reward:
        """The delivery's Reward; raises Reject (unusable input, or infra failures exhausted) or Retry."""
        traj: Trajectory = d.msg
        try:
            traj = await self.bound(traj)
            forged = await self.forged(traj) if self.js is not None else []
            if forged:
                await release_episode(traj)
                return tamper_reward(traj, forged)
            payload = await self.hidden.get(traj.hidden_ref) if traj.hidden_ref else None
            return await self._score(traj, payload)
        except VerifierInputError as exc:
            await release_episode(traj)
            raise Reject(f"verifier input: {exc}") from exc
        except (VerifierInfraError, HiddenDataMissing, PayloadUnavailable) as exc:
            try:
                self.policy.fail(d.delivered, exc)
            except (Retry, Reject) as outcome:
                if isinstance(outcome, Reject):
                    await release_episode(traj)
                log.warning(
                    "verifier.infra_error",
                    error=str(exc)[:500],
                    delivered=d.delivered,
                    verifier=traj.verifier,
                    outcome=type(outcome).__name__.lower(),
                )
                raise


async def release_episode(traj: Trajectory) -> None:
    """Free what an episode handed over for verification (a Harbor task's container) once its
    outcome is final without its verifier (tamper, dead letter); the harbor verifier frees it itself."""
    if traj.verifier == "harbor" and "harbor_container" in traj.artifacts:
        from verifier_workers.verifiers.harbor import release

        await asyncio.to_thread(release, traj)


async def run(cfg: RunConfig, ctx: WorkerContext) -> dict[str, float]:
    """Run the verifier worker until stopped (or the context's test limits)."""
    vc = cfg.verifier
    from verifier_workers import answer_pool

    answer_pool.configure(section=vc)  # the operator's limits on answer-dependent scoring (verifier.answer_*)
    async with worker_session("verifier", cfg, ctx) as s:
        spec = s.reg.verifier_consumer(vc.ack_wait_s)
        from sandbox_workers.integrity import load_or_create_secret, load_secret

        secret = load_secret() or load_or_create_secret(ctx.run_path)
        scorer = Scorer(
            HiddenCache(s.js, s.reg),
            retry_policy(vc, spec),
            vc.concurrency,
            s.js,
            s.reg,
            secret,
            limits=vc,
            run_path=ctx.run_path,
        )

        async def handle(d: Delivery) -> None:
            c = s.counters
            try:
                result = await scorer.one(d)
            except (Retry, Reject) as outcome:
                if isinstance(outcome, Retry) or outcome.error_type == "infra_error":
                    c["infra_errors"] = c.get("infra_errors", 0) + 1
                raise
            await publish_many(s.js, [(s.reg.rewards(d.msg.domain), result)])
            c["rewards"] = c.get("rewards", 0) + 1
            c["verified_inline"] = scorer.inline_calls
            c["check_forged"] = scorer.forged_checks
            c["reward_sum"] = c.get("reward_sum", 0) + result.reward

        sub = await pull_subscription(s.js, spec)
        # each trajectory is acked as soon as its own reward is out: one slow verification
        # never holds back the fast ones fetched with it. Up to `batch` trajectories are held
        # at once (their rewards publish concurrently), `concurrency` of them verifying.
        await run_pull_stream(
            s.js,
            s.reg,
            "verifier",
            sub,
            Trajectory,
            handle,
            inflight=max(vc.batch, scorer.concurrency),
            fetch_batch=vc.batch,
            ack_wait_s=vc.ack_wait_s,
            max_messages=ctx.max_messages,
            until_idle=ctx.until_idle,
            stop=s.stop,
            counters=s.counters,
        )
        scorer.batcher.close()
        s.counters["rm_batches"] = scorer.batcher.batches
        s.counters["rm_partial_groups"] = scorer.batcher.partial_groups
        return s.counters
