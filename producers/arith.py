"""The `arith` domain: generated integer arithmetic problems.

Guarantees:
- Difficulty is an int >= 1 and sets the number of digits and operators
  (see `LEVELS`); the same (seed, difficulty) always yields the same problem stream.
- The gold answer is exact integer arithmetic, computed by `evaluate`, never `eval`.
- `heldout_set(seed, n, difficulty)` is a fixed, seeded evaluation set; `is_heldout`
  lets the sampler keep those problems out of training.
- Prompt format shared by SFT, rollout and evaluation: the model sees `"<expr>="`
  and must answer the integer, then end of sequence.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# difficulty -> (digits per operand, number of operators, operators allowed)
LEVELS: dict[int, tuple[int, int, str]] = {
    1: (1, 1, "+"),
    2: (1, 1, "+-"),
    3: (2, 1, "+-"),
    4: (2, 2, "+-"),
    5: (3, 1, "+-"),
    6: (2, 2, "+-*"),
}

_TOKEN = re.compile(r"\s*(\d+|[+\-*])")


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
    return ArithProblem(expression, evaluate(expression))


def evaluate(expression: str) -> int:
    """Exact value of an expression of non-negative integers and + - * (usual precedence).

    Raises ValueError on anything else, so a malformed expression is an error, not a 0.
    """
    tokens = _TOKEN.findall(expression)
    if "".join(tokens) != expression.replace(" ", "") or not tokens:
        raise ValueError(f"not an arith expression: {expression!r}")
    terms: list[int] = []
    sign, product, expect_number = 1, None, True
    pending_op = "+"
    for tok in tokens:
        if expect_number:
            if not tok.isdigit():
                raise ValueError(f"expected a number in {expression!r}, got {tok!r}")
            n = int(tok)
            product = n if pending_op != "*" else product * n
            expect_number = False
        else:
            if tok == "*":
                pending_op = "*"
            else:
                terms.append(sign * product)
                sign, pending_op = (1 if tok == "+" else -1), tok
            expect_number = True
    if expect_number:
        raise ValueError(f"expression ends with an operator: {expression!r}")
    terms.append(sign * product)
    return sum(terms)


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


def parse_answer(completion: str) -> int | None:
    """The integer the model answered: the whole completion, stripped; None if it is not one."""
    text = completion.strip()
    if re.fullmatch(r"-?\d{1,12}", text):
        return int(text)
    return None
