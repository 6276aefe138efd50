"""The `arith` domain kind: generated integer arithmetic, never a held-out eval problem.

Nothing is hidden here: the verifier recomputes the answer from the public expression.
Held-out problems (the scheduler's eval set for this run) are redrawn, never trained on.

Domain params (`[sampler.domains.<name>.params]`):
- `worked_share` (0..1, default 0): the fraction of SFT demonstrations that show their work,
  `(70+2)=72` for `21+51=` (`schemas.answers.worked_completion`), the rest answering bare
  (`72`). Both are correct answers and score the same; the demo mixes them so that RL has
  a choice to make between two habits of the teacher (see examples/demo.toml). Problems
  without a worked form (one digit, two operators) are always answered bare.
- Anything else in `params` is refused at start-up with the keys it knows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from producers import arith
from producers.domains import DomainContext, Drawn, finish_task
from producers.params import share_param
from schemas import ChatMessage
from schemas.answers import worked_completion

PARAMS = ("worked_share",)


@dataclass
class ArithDomain:
    """Task source of one `arith` config domain."""

    ctx: DomainContext
    heldout: frozenset[str] = field(init=False)

    worked_share: float = field(init=False)

    def __post_init__(self) -> None:
        ev = self.ctx.cfg.scheduler.eval
        self.heldout = frozenset(p.expression for p in arith.heldout_set(ev.seed, ev.n, ev.difficulty))
        self.worked_share = share_param(self.ctx.name, self.ctx.dc.params, "worked_share", PARAMS)

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        while True:
            problem = arith.generate(rng, level)
            if problem.expression not in self.heldout:
                break
        return Drawn(finish_task(self.ctx, task_id=f"{self.ctx.name}-{level}-{index}", difficulty=level,
                                 prompt=[ChatMessage(role="user", content=problem.prompt)], verifier="arith",
                                 verifier_params={"expression": problem.expression}))

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool]]:
        """SFT segments of one problem at `level` (never a held-out one)."""
        while True:
            p = arith.generate(rng, level)
            if p.expression not in self.heldout:
                break
        worked = worked_completion(p.expression, p.answer) if self.worked_share > 0 else None
        shown = worked if worked is not None and rng.random() < self.worked_share else p.completion
        return [(p.prompt, False), (shown, True)]

