"""The `arith` domain: generated integer arithmetic problems.

Guarantees:
- Difficulty is an int >= 1 and sets the number of digits and operators
  (see `LEVELS`); the same (seed, difficulty) always yields the same problem stream.
- The gold answer is exact integer arithmetic, computed by `schemas.answers.arith_value`, never `eval`.
- `heldout_set(seed, n, difficulty)` is a fixed, seeded evaluation set; `is_heldout`
  lets the sampler keep those problems out of training.
- Prompt format shared by SFT, rollout and evaluation: the model sees `"<expr>="`
  and must answer the integer, then end of sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from schemas.answers import arith_value

# difficulty -> (digits per operand, number of operators, operators allowed)
LEVELS: dict[int, tuple[int, int, str]] = {
    1: (1, 1, "+"),
    2: (1, 1, "+-"),
    3: (2, 1, "+-"),
    4: (2, 2, "+-"),
    5: (3, 1, "+-"),
    6: (2, 2, "+-*"),
}

@dataclass(frozen=True)
class ArithProblem:
    """One problem: the expression text and its exact integer answer."""

    expression: str
    answer: int

    @property
    def prompt(self) -> str:
        """The text the model is conditioned on."""
        return render_prompt(self.expression)

    @property
    def completion(self) -> str:
        """The demonstration answer (without end-of-sequence)."""
        return str(self.answer)


def render_prompt(expression: str) -> str:
    """Prompt text for an expression: `12+34=`."""
    return f"{expression}="


def level(difficulty: int) -> tuple[int, int, str]:
    """(digits, operators, allowed ops) for a difficulty, clamped to the known range."""
    return LEVELS[max(1, min(difficulty, max(LEVELS)))]


def generate(rng: random.Random, difficulty: int) -> ArithProblem:
    """Draw one problem of the given difficulty from `rng`."""
    digits, n_ops, ops = level(difficulty)
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    parts = [str(rng.randint(lo, hi))]
    for _ in range(n_ops):
        parts.append(rng.choice(ops))
        parts.append(str(rng.randint(lo, hi)))
    expression = "".join(parts)
    return ArithProblem(expression, arith_value(expression))


def heldout_set(seed: int, n: int, difficulty: int) -> list[ArithProblem]:
    """A fixed evaluation set of `n` distinct problems (fewer if the level has fewer)."""
    rng = random.Random(f"arith-heldout-{seed}-{difficulty}")
    seen: dict[str, ArithProblem] = {}
    for _ in range(n * 50):
        if len(seen) >= n:
            break
        p = generate(rng, difficulty)
        seen.setdefault(p.expression, p)
    return list(seen.values())
