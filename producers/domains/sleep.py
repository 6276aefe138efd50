"""The `sleep` domain kind: tasks whose episodes take a known time (scheduling benchmarks).

With the rollout engine `sleep`, an episode of this domain takes `params.seconds`
(default 0.1) of wall time and is scored 1.0 by the `constant` verifier, which takes
`params.verify_seconds` (default 0) per call: a slow verifier for the fault benchmark. It measures the
pipeline's scheduling, never a model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from producers.domains import DomainContext, Drawn, finish_task
from schemas import ChatMessage


@dataclass
class SleepDomain:
    """Task source of one `sleep` config domain."""

    ctx: DomainContext

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        seconds = float(self.ctx.dc.params.get("seconds", 0.1))
        return Drawn(
            finish_task(
                self.ctx,
                task_id=f"{self.ctx.name}-{index}",
                difficulty=level,
                prompt=[ChatMessage(role="user", content=f"sleep:{seconds}")],
                verifier="constant",
                verifier_params=self.verifier_params(),
                pool=self.ctx.dc.pool,
            )
        )

    def verifier_params(self) -> dict:
        """`params.verify_seconds`: how long the `constant` verifier takes per call (a slow verifier)."""
        seconds = float(self.ctx.dc.params.get("verify_seconds", 0) or 0)
        return {"seconds": seconds} if seconds else {}
