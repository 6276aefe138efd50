"""The `constant` verifier (benchmarks of the bus itself; the contract: `verifier_workers.verdict`).

Guarantees:
- It scores everything `ok` with reward 1.0 without looking, after `verifier_params.seconds`
  (default 0, at most 600) of sleep: the slow verifier of the fault benchmark.
"""

from __future__ import annotations

import time

from schemas import Trajectory
from verifier_workers.verdict import Verdict


def verify_constant(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Reward 1.0 for anything (benchmarks of the bus itself), after `verifier_params.seconds`
    (default 0, at most 600) of wall time: a slow verifier, for backpressure benchmarks."""
    seconds = min(600.0, max(0.0, float(traj.verifier_params.get("seconds", 0) or 0)))
    if seconds:
        time.sleep(seconds)
    return Verdict({"correct": 1.0})
