"""The `arith` verifier (the contract: `verifier_workers.verdict`).

Guarantees:
- It recomputes the gold answer with exact integer arithmetic from the task's
  public expression (there is nothing hidden to leak) and scores the completion 1.0
  iff it is exactly that integer, else 0.0; `format` says whether it was an integer.
- A task whose public parameters are unusable raises `VerifierInputError`, which the
  worker dead-letters with the reason: never a silent reward of 0.
"""

from __future__ import annotations

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
    return Verdict(
        {"correct": float(answer == gold), "format": float(answer is not None)}, details=f"answer={answer!r}"
    )
