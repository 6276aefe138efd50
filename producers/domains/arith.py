"""The `arith` domain kind: generated integer arithmetic problems.

Nothing is hidden here: the verifier recomputes the answer from the public expression.
Held-out problems (the scheduler's eval set for this run) are redrawn, never trained on.

Domain params (`[sampler.domains.<name>.params]`):
- `worked_share` (0..1, default 0): the fraction of SFT demonstrations that show their work,
  `(70+2)=72` for `21+51=` (`schemas.answers.worked_completion`), the rest answering bare
  (`72`). Both are correct answers and score the same; the demo mixes them so that RL has
  a choice to make between two habits of the teacher (see examples/demo.toml). Problems
  without a worked form (one digit, two operators) are always answered bare.
- Anything else in `params` is refused at start-up with the keys it knows.

Guarantees:
- Difficulty is an int >= 1 and sets the number of digits and operators
  (see `LEVELS`); the same (seed, difficulty) always yields the same problem stream.
- The gold answer is exact integer arithmetic, computed by `schemas.answers.arith_value`, never `eval`.
- `heldout_set(seed, n, difficulty)` is a fixed, seeded evaluation set, which `ArithDomain`
  never draws for training or demonstrations; `fixed_eval_set` (and the source's hook
  `eval_set(n, seed, level)`, default level `scheduler.eval.difficulty`) gives it as an
  `EvalSet` scored locally by one greedy completion, exact integer answer
  (`schemas.answers.arith_answer`), or through the pipeline by the `arith` verifier.
- Prompt format shared by SFT, rollout and evaluation: the model sees `"<expr>="`
  and must answer the integer, then end of sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from producers.domains import DomainContext, Drawn, finish_task
from producers.eval_set import EvalItem, EvalSet
from producers.params import share_param
from schemas import ChatMessage, Task
from schemas.answers import arith_answer, arith_value, worked_completion

PARAMS = ("worked_share",)

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


def fixed_eval_set(
    seed: int, n: int, level: int, *, domain: str = "arith", max_tokens: int = 16, run_id: str = "eval"
) -> EvalSet:
    """`heldout_set(seed, n, level)` as an eval set of domain `domain` (see the module guarantees);
    its content hash covers each problem's (expression, answer)."""
    items = tuple(
        EvalItem(
            Task(
                run_id=run_id,
                task_id=f"{domain}-eval-{i}",
                domain=domain,
                group_size=1,
                max_tokens=max_tokens,
                temperature=0.0,
                prompt=[ChatMessage(role="user", content=p.prompt)],
                verifier="arith",
                verifier_params={"expression": p.expression},
            ),
            gold=p.answer,
            row=(p.expression, p.answer),
        )
        for i, p in enumerate(heldout_set(seed, n, level))
    )
    return EvalSet(domain, seed, level, items, local="generate", answer=arith_answer)


@dataclass
class ArithDomain:
    """Task source of one `arith` config domain."""

    ctx: DomainContext
    heldout: frozenset[str] = field(init=False)

    worked_share: float = field(init=False)

    def __post_init__(self) -> None:
        ev = self.ctx.cfg.scheduler.eval
        self.heldout = frozenset(p.expression for p in heldout_set(ev.seed, ev.n, ev.difficulty))
        self.worked_share = share_param(self.ctx.name, self.ctx.dc.params, "worked_share", PARAMS)

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        while True:
            problem = generate(rng, level)
            if problem.expression not in self.heldout:
                break
        return Drawn(
            finish_task(
                self.ctx,
                task_id=f"{self.ctx.name}-{level}-{index}",
                difficulty=level,
                prompt=[ChatMessage(role="user", content=problem.prompt)],
                verifier="arith",
                verifier_params={"expression": problem.expression},
            )
        )

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool]]:
        """SFT segments of one problem at `level` (never a held-out one)."""
        while True:
            p = generate(rng, level)
            if p.expression not in self.heldout:
                break
        worked = worked_completion(p.expression, p.answer) if self.worked_share > 0 else None
        shown = worked if worked is not None and rng.random() < self.worked_share else p.completion
        return [(p.prompt, False), (shown, True)]

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """The held-out problems as this domain's eval set (default level `scheduler.eval.difficulty`)."""
        cfg = self.ctx.cfg
        return fixed_eval_set(
            seed,
            n,
            cfg.scheduler.eval.difficulty if level is None else level,
            domain=self.ctx.name,
            max_tokens=self.ctx.dc.max_tokens or cfg.sampler.max_tokens,
            run_id=self.ctx.run_id,
        )
