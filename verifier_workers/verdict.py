"""The verifier contract: `Verdict`, `VerifierInputError` and `compose`.

A verifier `fn(traj, hidden=None)` maps a trajectory (and, for tasks with a `hidden_ref`,
the resolved verifier-only payload) to named reward components and a status in a `Verdict`;
the scalar reward is composed from the components by weights. Verifiers are looked up by
name in `verifier_workers.registry`; this module imports nothing of the project but the
schemas, so verifiers, the registry and the worker all import it without a cycle.

Guarantees:
- `compose()` turns named components into the scalar reward: a weighted sum (a missing
  component counts 0), by default just the `correct` component; a non-finite component or
  weight raises ValueError. `Verdict.reward` is `compose(components, weights)`.
- `VerifierInputError` means the task itself is unusable as given (bad public params, an
  unknown or broken verifier): the worker dead-letters it at once, never a silent reward of 0.
  Failures outside the task are `errors.VerifierInfraError` (retried).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


class VerifierInputError(ValueError):
    """The trajectory/task cannot be verified as given (dead-letter it)."""


def compose(
    components: Mapping[str, float], weights: Mapping[str, float] | None = None, default: str = "correct"
) -> float:
    """The scalar reward: sum of weight x component (a missing component counts 0).

    With `weights` None the scalar is the `default` component alone (0.0 if absent).
    A non-finite component or weight raises ValueError.
    """
    if weights is None:
        weights = {default: 1.0}
    total = 0.0
    for key, w in weights.items():
        value = float(components.get(key, 0.0))
        if not (math.isfinite(value) and math.isfinite(float(w))):
            raise ValueError(f"non-finite reward component/weight {key!r}: {value!r} x {w!r}")
        total += float(w) * value
    return total


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
        return compose(self.components, self.weights)
