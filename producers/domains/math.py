"""The `math` domain: training tasks from a dataset of problems (JSONL, Parquet or a `datasets` dir).

Default row format: `{"id": ..., "problem": ..., "answer": ...}` (optionally `"level"`: int);
`DomainConfig.field_map` renames the columns (`{ prompt = "question", gold = "solution" }`),
and `producers.datafile` reads every format.

Guarantees:
- The prompt asks for the final answer in `\\boxed{}`; the task is scored by the `math`
  verifier (answer equivalence with math-verify).
- Gold never travels with the task: `MathDomain` returns it as the hidden payload
  `{"gold": ...}` (plus any `hidden.<key>` columns) stored under `Task.hidden_ref`, which
  only verifiers resolve.
- Only training rows are drawn: held-out rows (`heldout_fraction`, `heldout_split`) never
  are; `MathDomain.data` (`DataSplit`) holds both and their hashes.
- A task's level is the curriculum level asked for; problems that carry a `level` are
  drawn from that level when it has any, otherwise from all training rows.
- Problems are drawn with the sampler's seeded RNG (deterministic per run/position).
- A row whose problem is not text or whose answer is not text or a number is skipped
  (counted and logged); missing data, an empty dataset or a missing column is a
  `ValueError` naming the file (and the columns present).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from producers.datafile import ROOT, DataSplit, RowError, Spec, TaskLine, domain_split, level_of, load_split, resolve
from schemas import ChatMessage

if TYPE_CHECKING:
    from producers.domains import DomainContext, Drawn

DEFAULT_DATA = ROOT / "examples" / "data" / "math.jsonl"
INSTRUCTION = "Put your final answer in \\boxed{}."


def parse_problem(task_id: str, rec: dict[str, Any]) -> TaskLine:
    """One math row from its canonical record (RowError on a malformed one)."""
    problem, gold = rec["prompt"], rec["hidden"]["gold"]
    if not isinstance(problem, str):
        raise RowError("bad prompt", f"a math problem is text, not {type(problem).__name__}")
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise RowError("bad gold", f"an answer is text or a number, not {type(gold).__name__}")
    return TaskLine(
        task_id,
        (ChatMessage(role="user", content=f"{problem}\n{INSTRUCTION}"),),
        {**rec["hidden"], "gold": str(gold)},
        rec["params"],
        level_of(rec.get("level")),
    )


MATH = Spec(
    "math",
    (("id", "id"), ("prompt", "problem"), ("gold", "answer"), ("level", "level")),
    ("prompt", "gold"),
    parse_problem,
)
"""The `math` kind's format: id, problem, answer (gold), level."""


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
    """The data path: `data` (relative paths from the cwd, else the repository root), else the default."""
    return resolve(data, DEFAULT_DATA)


def load(path: str) -> tuple[MathProblem, ...]:
    """Every usable problem of a data file in the default format (cached; malformed rows skipped)."""
    return tuple(
        MathProblem(t.id, t.prompt[0].content.removesuffix(f"\n{INSTRUCTION}"), t.hidden["gold"], t.level)
        for t in load_split(str(path), Path(path), MATH).train
    )


@dataclass
class MathDomain:
    """Task source of one `math` config domain (gold hidden behind `hidden_ref`)."""

    ctx: "DomainContext"
    data: DataSplit = field(init=False)
    by_level: dict[int | None, list[TaskLine]] = field(init=False)

    def __post_init__(self) -> None:
        self.data = domain_split(self.ctx, MATH, DEFAULT_DATA)
        self.by_level = {}
        for q in self.data.train:
            self.by_level.setdefault(q.level, []).append(q)

    def make_task(self, rng: random.Random, level: int, index: int) -> "Drawn":
        from bus.hidden import hidden_ref_for
        from producers.domains import Drawn, finish_task

        q = rng.choice(self.by_level.get(level) or self.data.train)  # at `level` if any there
        ref = hidden_ref_for(self.ctx.name, q.id)
        task = finish_task(
            self.ctx,
            task_id=f"{self.ctx.name}-{level}-{index}",
            difficulty=level,
            prompt=list(q.prompt),
            verifier="math",
            verifier_params={"problem_id": q.id, **q.params},
            hidden_ref=ref,
        )
        return Drawn(task, dict(q.hidden))
