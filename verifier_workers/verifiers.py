"""The `arith` and `constant` built-in verifiers (the contract: `verifier_workers.verdict`).

Guarantees:
- `arith` recomputes the gold answer with exact integer arithmetic from the task's
  public expression (there is nothing hidden to leak) and scores the completion 1.0
  iff it is exactly that integer, else 0.0; `format` says whether it was an integer.
- `constant` (benchmarks) scores everything `ok` with reward 1.0 without looking (after
  `verifier_params.seconds` of sleep, the slow verifier of the fault benchmark).
- A task whose public parameters are unusable raises `VerifierInputError`, which the
  worker dead-letters with the reason: never a silent reward of 0.
"""

from __future__ import annotations

import time

from schemas import Trajectory
from schemas.answers import arith_answer, arith_value
from verifier_workers.verdict import Verdict, VerifierInputError


def verify_arith(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Exact-match integer answer to the task's expression."""
    expression = traj.verifier_params.get("expression")
    if not isinstance(expression, str):
        raise VerifierInputError("arith task without a string verifier_params.expression")
    try:
        gold = arith_value(expression)
    except ValueError as exc:
        raise VerifierInputError(str(exc)) from None
    answer = arith_answer(traj.final_text)
    return Verdict({"correct": float(answer == gold), "format": float(answer is not None)},
                   details=f"answer={answer!r}")


def verify_constant(traj: Trajectory, hidden: dict | None = None) -> Verdict:
    """Reward 1.0 for anything (benchmarks of the bus itself), after `verifier_params.seconds`
    (default 0, at most 600) of wall time: a slow verifier, for backpressure benchmarks."""
    seconds = min(600.0, max(0.0, float(traj.verifier_params.get("seconds", 0) or 0)))
    if seconds:
        time.sleep(seconds)
    return Verdict({"correct": 1.0})
