"""The verifier contract (`Verdict`, `VerifierInputError`) and the `arith`/`constant` built-ins.

A verifier `fn(traj, hidden=None)` maps a trajectory (and, for tasks with a
`hidden_ref`, the resolved verifier-only payload) to named reward components and a status; the scalar
reward is composed from the components by weights (default: the `correct` component,
see `registry.compose`). Verifiers are looked up by name in `verifier_workers.registry`
(built-ins, then `rlbus.verifiers` entry points); `get_verifier` delegates to it.

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
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas import Trajectory
from schemas.answers import arith_answer, arith_value


class VerifierInputError(ValueError):
    """The trajectory/task cannot be verified as given (dead-letter it)."""


@dataclass
class Verdict:
    """What a verifier found."""

    components: dict[str, float]
    status: str = "ok"
    details: str = ""
    weights: dict[str, float] = field(default_factory=lambda: {"correct": 1.0})
    sandbox_s: float = 0.0
    """Wall time the verification spent in sandboxes (0 for a verifier that runs none): the run's sandbox cost."""

    @property
    def reward(self) -> float:
        """Scalar reward: the weighted sum of the components."""
        from verifier_workers.registry import compose

        return compose(self.components, self.weights)


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


VERIFIERS: dict[str, Callable[[Trajectory], Verdict]] = {
    "arith": verify_arith,
    "constant": verify_constant,
}
"""The built-ins defined in this module (the registry lists every verifier)."""


def get_verifier(name: str) -> Callable[[Trajectory], Verdict]:
    """The verifier registered as `name`, or VerifierInputError naming the known ones."""
    from verifier_workers.registry import get

    return get(name)
