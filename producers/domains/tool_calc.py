"""The `tool_calc` domain: products too large for a tiny model to compute in its head.

The model must call the python tool and copy the printed result into its answer:

    prompt     417*382=?
    assistant  <py>417*382</py>                   (a tool call; generation stops at </py>;
                                                   the python tool prints a final expression)
    tool       \\n<obs exit=0>\\n159294\\n</obs>\\n   (the sandbox's recorded observation)
    assistant  =159294<eos>                        (the final answer)

Guarantees:
- Level L multiplies two numbers of L+2 digits each (level 1: 3x3 digits, ...), so the
  answer is out of reach without the tool; the gold is recomputed by the verifier from
  the public expression (nothing hidden to leak).
- `heldout_set(seed, n, level)` is a fixed seeded eval set; training never draws it. The
  source's hook `eval_set(n, seed, level)` (default level: the domain's start level) gives
  it as an `EvalSet` of tool tasks in the domain's `tool_format` (at least 2 turns), scored
  locally by greedy agent episodes, exact product in the final answer
  (`schemas.answers.calc_answer`), or through the pipeline by the `tool_calc` verifier; its
  content hash covers the expressions.
- `demonstration(rng, level)` returns the SFT segments above, with only the model's own
  text trainable (prompt and observation are context), built with the same observation
  renderer the sandbox side uses. With `tool_format="json"` (the domain's
  `tool_format`) the call is `<tool_call>{"name": "python", "arguments": {"code":
  "417*382"}}</tool_call>` and the segments are a `ToolDemo` whose `tools` are the specs
  the prompt declares (the chat template renders them into the system turn, as rollout
  does), so the domain teaches either format.
- Domain param `direct_share` (0..1, default 0): the fraction of SFT demonstrations in which
  the teacher answers from memory, `=159294` with no tool call (a correct answer, as a
  teacher that multiplies in its head gives it); the rest call the tool. A tiny model
  cannot imitate mental 3-digit products, so the habit scores near 0 for it: the demo
  mixes the two so that RL has a choice to make (examples/demo.toml). Other params are
  refused at start-up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from producers.domains import DomainContext, Drawn, finish_task
from producers.eval_set import EvalItem, EvalSet
from producers.params import share_param
from schemas import ChatMessage, Task
from schemas.answers import calc_answer
from schemas.tool_protocol import CALL_CLOSE, CALL_OPEN, ToolDemo, json_call_text, tool_specs, tool_turn_text

TOOL = "python"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}"

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def prompt(self) -> str:
        return f"{self.expression}=?"


def generate(rng: random.Random, level: int) -> Problem:
    """A problem at `level` (two factors of level+2 digits)."""
    digits = max(1, level) + 2
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    return Problem(rng.randint(lo, hi), rng.randint(lo, hi))


def heldout_set(seed: int, n: int, level: int) -> list[Problem]:
    """The fixed evaluation problems of a run."""
    rng = random.Random(f"tool_calc-heldout-{seed}-{level}")
    seen: dict[str, Problem] = {}
    while len(seen) < n:
        p = generate(rng, level)
        seen.setdefault(p.expression, p)
    return list(seen.values())


def demonstration(
    rng: random.Random,
    level: int,
    heldout: frozenset[str] = frozenset(),
    tool_format: str = "tags",
    direct_share: float = 0.0,
) -> list[tuple[str, bool | None]]:
    """SFT segments (text, trainable) of one worked episode in `tool_format`; with
    probability `direct_share`, one answered without the tool: the `=` that opens an
    answer from memory is supervised, the product's digits are shown but not trained on
    (flag None: a student that cannot multiply in its head could only memorise them as
    noise, which set its arithmetic back: docs/benchmarks.md, "demo")."""
    from sandbox_workers.base import ExecResult
    from sandbox_workers.integrity import render_observation

    while True:
        p = generate(rng, level)
        if p.expression not in heldout:
            break
    if direct_share > 0 and rng.random() < direct_share:
        direct = [(p.prompt, False), ("=", True), (str(p.answer), None)]
        return ToolDemo(direct, tool_specs([TOOL])) if tool_format == "json" else direct
    obs = render_observation(ExecResult(exit_code=0, stdout=f"{p.answer}\n", stderr=""))
    if tool_format == "json":
        return ToolDemo(
            [
                (p.prompt, False),
                (json_call_text(TOOL, p.expression), True),
                (tool_turn_text(obs), False),
                (f"={p.answer}", True),
            ],
            tool_specs([TOOL]),
        )
    return [
        (p.prompt, False),
        (f"{CALL_OPEN}{p.expression}{CALL_CLOSE}", True),
        (tool_turn_text(obs), False),
        (f"={p.answer}", True),
    ]


@dataclass
class ToolCalcDomain:
    """Task source of one `tool_calc` config domain."""

    ctx: DomainContext
    heldout: frozenset[str] = field(init=False)
    direct_share: float = field(init=False)

    def __post_init__(self) -> None:
        ev = self.ctx.cfg.scheduler.eval
        levels = range(self.ctx.dc.min_level, self.ctx.dc.max_level + 1)
        self.heldout = frozenset(p.expression for lvl in levels for p in heldout_set(ev.seed, ev.n, lvl))
        self.direct_share = share_param(self.ctx.name, self.ctx.dc.params, "direct_share", ("direct_share",))

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        while True:
            p = generate(rng, level)
            if p.expression not in self.heldout:
                break
        return Drawn(
            finish_task(
                self.ctx,
                task_id=f"{self.ctx.name}-{level}-{index}",
                difficulty=level,
                prompt=[ChatMessage(role="user", content=p.prompt)],
                tools=[TOOL],
                max_turns=max(2, self.ctx.dc.max_turns),
                verifier="tool_calc",
                verifier_params={"expression": p.expression},
            )
        )

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool | None]]:
        return demonstration(rng, level, self.heldout, self.ctx.dc.tool_format, self.direct_share)

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """The held-out problems as this domain's eval set (see the module guarantees)."""
        dc, name = self.ctx.dc, self.ctx.name
        level = dc.initial_level if level is None else level
        max_tokens = dc.max_tokens or self.ctx.cfg.sampler.max_tokens
        items = tuple(
            EvalItem(
                Task(
                    run_id=self.ctx.run_id,
                    task_id=f"{name}-eval-{i}",
                    domain=name,
                    group_size=1,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    max_turns=max(2, dc.max_turns),
                    prompt=[ChatMessage(role="user", content=p.prompt)],
                    tools=[TOOL],
                    tool_format=dc.tool_format,
                    verifier="tool_calc",
                    verifier_params={"expression": p.expression},
                ),
                gold=p.answer,
                row=p.expression,
            )
            for i, p in enumerate(heldout_set(seed, n, level))
        )
        return EvalSet(name, seed, level, items, local="episodes", answer=calc_answer)
