"""The `arith` domain kind: generated integer arithmetic, never a held-out eval problem.

Nothing is hidden here: the verifier recomputes the answer from the public expression.
Held-out problems (the scheduler's eval set for this run) are redrawn, never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from producers import arith
from producers.domains import DomainContext, Drawn, finish_task
from schemas import ChatMessage


@dataclass
class ArithDomain:
    """Task source of one `arith` config domain."""

    ctx: DomainContext
    heldout: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        ev = self.ctx.cfg.scheduler.eval
        self.heldout = frozenset(p.expression for p in arith.heldout_set(ev.seed, ev.n, ev.difficulty))

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
                return [(p.prompt, False), (p.completion, True)]
