"""The verifier worker process: trajectories in, Rewards out.

Guarantees:
- Every trajectory either yields exactly one published `Reward` before its ack, or is
  dead-lettered with the verifier's reason (unknown verifier, unusable parameters).
- A Reward's msg_id derives from its trajectory's, so re-verifying a redelivered
  trajectory cannot create a second reward for the same sample.
- Rewards of a fetched batch are published pipelined, then the batch is acked.
"""

from __future__ import annotations

import time

import structlog

from bus.conn import pull_subscription
from bus.hidden import HiddenCache, HiddenDataMissing
from bus.publish import publish_many
from bus.pull import Delivery, Reject, Retry, run_pull_loop
from rlbus.runtime import worker_session
from schemas import Reward, Trajectory
from verifier_workers.verifiers import VerifierInputError, get_verifier

log = structlog.get_logger()


def score(traj: Trajectory, hidden: dict | None = None) -> Reward:
    """Run the trajectory's verifier and compose its Reward (raises VerifierInputError)."""
    t0 = time.perf_counter()
    fn = get_verifier(traj.verifier)
    verdict = fn(traj, hidden) if traj.hidden_ref else fn(traj)
    return Reward(run_id=traj.run_id, msg_id=f"rw-{traj.msg_id}", trajectory=traj, reward=verdict.reward, components=verdict.components,
                  status=verdict.status, details=verdict.details[:2000], verify_seconds=time.perf_counter() - t0)


async def run(cfg, ctx) -> dict[str, float]:
    """Run the verifier worker until stopped (or the context's test limits)."""
    vc = cfg.verifier
    async with worker_session("verifier", cfg, ctx) as s:
        hidden = HiddenCache(s.js, s.reg)

        async def handle(batch: list[Delivery]):
            outcomes, items = [], []
            for d in batch:
                try:
                    payload = await hidden.get(d.msg.hidden_ref) if d.msg.hidden_ref else None
                    reward = score(d.msg, payload)
                except VerifierInputError as exc:
                    outcomes.append(Reject(f"verifier input: {exc}"))
                    continue
                except HiddenDataMissing as exc:  # infrastructure, not the policy: retry, never score 0
                    log.warning("verifier.hidden_missing", error=str(exc))
                    outcomes.append(Retry(delay=2.0, reason=str(exc)))
                    continue
                items.append((s.reg.rewards(d.msg.domain), reward))
                outcomes.append(None)
            await publish_many(s.js, items)
            s.counters["rewards"] = s.counters.get("rewards", 0) + len(items)
            s.counters["reward_sum"] = s.counters.get("reward_sum", 0) + sum(r.reward for _, r in items)
            return outcomes

        sub = await pull_subscription(s.js, s.reg.verifier_consumer(vc.ack_wait_s))
        await run_pull_loop(s.js, s.reg, "verifier", sub, Trajectory, handle, batch=vc.batch,
                            ack_wait_s=vc.ack_wait_s, max_messages=ctx.max_messages, until_idle=ctx.until_idle,
                            stop=s.stop, counters=s.counters)
        return s.counters
