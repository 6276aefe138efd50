"""The `math` domain: training tasks from a JSONL file of problems.

Each line is `{"id": ..., "problem": ..., "answer": ...}` (optionally `"level"`: int).

Guarantees:
- The prompt asks for the final answer in `\\boxed{}`; the task is scored by the `math`
  verifier (answer equivalence with math-verify).
- Gold never travels with the task: `MathDomain` returns it as the hidden payload
  `{"gold": ...}` stored under `Task.hidden_ref`, which only verifiers resolve.
- A task's level is the curriculum level asked for; problems that carry a `level` are
  drawn from that level when it has any, otherwise from the whole file.
- Problems are drawn with the sampler's seeded RNG (deterministic per run/position).
- A missing, empty or malformed file is a `ValueError` naming the file and line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import ChatMessage

if TYPE_CHECKING:
    from producers.domains import DomainContext, Drawn

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT / "examples" / "data" / "math.jsonl"
INSTRUCTION = "Put your final answer in \\boxed{}."


@dataclass(frozen=True)
class MathProblem:
    """One problem of the file."""

    id: str
    problem: str
    answer: str
    level: int | None = None

    @property
    def prompt(self) -> str:
        """The user message."""
        return f"{self.problem}\n{INSTRUCTION}"


def resolve_path(data: str) -> Path:
    """The data file: `data` (relative paths from the repository root), else the default."""
    if not data:
        return DEFAULT_DATA
    p = Path(data)
    return p if p.is_absolute() or p.exists() else ROOT / p


@lru_cache(maxsize=8)
def load(path: str) -> tuple[MathProblem, ...]:
    """All problems of a JSONL file (cached per path)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"math data file {p} not found")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            level = d.get("level")
            out.append(MathProblem(str(d["id"]), str(d["problem"]), str(d["answer"]),
                                   int(level) if level is not None else None))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{p}:{n}: bad math problem ({exc!r}); need id, problem, answer") from None
    if not out:
        raise ValueError(f"math data file {p} has no problems")
    return tuple(out)


def pick(problems: tuple[MathProblem, ...], rng: random.Random, level: int) -> MathProblem:
    """A problem at `level` if the file has any there, else any problem."""
    at_level = [q for q in problems if q.level == level]
    return rng.choice(at_level or problems)


@dataclass
class MathDomain:
    """Task source of one `math` config domain (gold hidden behind `hidden_ref`)."""

    ctx: "DomainContext"

    def make_task(self, rng: random.Random, level: int, index: int) -> "Drawn":
        from bus.hidden import hidden_ref_for
        from producers.domains import Drawn, finish_task

        q = pick(load(str(resolve_path(self.ctx.dc.data))), rng, level)
        ref = hidden_ref_for(self.ctx.name, q.id)
        task = finish_task(self.ctx, task_id=f"{self.ctx.name}-{level}-{index}", difficulty=level,
                           prompt=[ChatMessage(role="user", content=q.prompt)], verifier="math",
                           verifier_params={"problem_id": q.id}, hidden_ref=ref)
        return Drawn(task, {"gold": q.answer})
