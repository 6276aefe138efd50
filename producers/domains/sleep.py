"""The `sleep` domain kind: tasks whose episodes take a known time (scheduling benchmarks).

With the rollout engine `sleep`, an episode of this domain takes `params.seconds`
(default 0.1) of wall time and is scored 1.0 by the `constant` verifier, which takes
`params.verify_seconds` (default 0) per call: a slow verifier for the fault benchmark. It measures the
pipeline's scheduling, never a model.

A heavy tail (`bench/long_tail.py`): with `params.long_fraction` p, a task is long with
probability p and takes `seconds * long_factor` (default 10); with `params.tool_fraction` q it is
a multi-turn tool episode with probability q, taking `tool_turns` (default 3) times
`seconds + tool_seconds` (default 1.0): the sleep engine has no tools, so a slow tool's time is
part of the episode's sleep. Both default to 0 (every task takes `seconds`); the draw uses the
sampler's seeded rng, so a seed gives the same mix.
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
        seconds = self.episode_seconds(rng)
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

    def episode_seconds(self, rng: random.Random) -> float:
        """One task's episode time: `seconds`, or a tool episode's / a long one's (module docstring)."""
        p = self.ctx.dc.params
        seconds = float(p.get("seconds", 0.1))
        tool_fraction, long_fraction = float(p.get("tool_fraction", 0)), float(p.get("long_fraction", 0))
        if not (0 <= tool_fraction <= 1 and 0 <= long_fraction <= 1 and tool_fraction + long_fraction <= 1):
            raise ValueError(
                f"sleep domain {self.ctx.name}: tool_fraction {tool_fraction} and long_fraction {long_fraction} "
                "must each be in [0, 1] with a sum <= 1"
            )
        if not tool_fraction and not long_fraction:
            return seconds
        u = rng.random()
        if u < tool_fraction:
            turns = int(p.get("tool_turns", 3))
            return round(turns * (seconds + float(p.get("tool_seconds", 1.0))), 6)
        if u < tool_fraction + long_fraction:
            return round(seconds * float(p.get("long_factor", 10)), 6)
        return seconds

    def verifier_params(self) -> dict:
        """`params.verify_seconds`: how long the `constant` verifier takes per call (a slow verifier)."""
        seconds = float(self.ctx.dc.params.get("verify_seconds", 0) or 0)
        return {"seconds": seconds} if seconds else {}
