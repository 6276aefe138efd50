"""Eval sets as data: a domain's fixed held-out problems, and how they are scored.

A domain source gives its eval set through the hook `eval_set(n, seed, level) -> EvalSet | None`
(`producers.domains.DomainSource`); the scheduler (`scheduler.evaluation`, `.gates`,
`.pipeline_eval`) only reads what the set says, so a new domain with an eval set needs no
scheduler edit.

Guarantees:
- An `EvalSet` is a pure function of the domain's config and (n, seed, level): the same
  items in the same order every time. Each item is a ready `Task` (its prompt, budgets,
  tools, tool format, verifier and public params), its verifier-only `hidden` payload, the
  public `payloads` its task names by reference, and, for local scoring, its `gold`.
- `sha256` is the content hash of the set: sha256 of the JSON list of the items' `row`s
  (sorted keys, non-JSON values as strings); an item's default row is its prompt messages,
  verifier, public params and hidden payload. Scores are comparable across runs only when
  the hashes match.
- `local` says how the scheduler's own engine scores the set: `generate` (one greedy
  completion per prompt), `episodes` (greedy agent episodes, tool calls in fresh local
  sandboxes), or None (only the pipeline scores it, with the tasks' own verifiers). A
  local item is correct iff `answer(final text) == gold`; a local set without `answer` is
  a ValueError.
- `purpose` is `heldout` for a zero-shot domain's set, else `train` (`with_purpose`).
- `in_eval_slice(hex digest)` is the one held-out rule of every domain that holds out by
  content (reasoning-gym questions, repository tasks, Harbor tasks): one hash bucket in
  `EVAL_BUCKETS`, so held-out and training items are disjoint whatever the process or seed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from schemas import Task

if TYPE_CHECKING:
    from producers.domains import Drawn

Local = Literal["generate", "episodes"]

EVAL_BUCKETS = 8
"""One content-hash bucket in this many is the eval slice (never trained on)."""


def in_eval_slice(digest: str) -> bool:
    """Whether an item with this content hash (hex) is held out for eval."""
    return int(digest[:8], 16) % EVAL_BUCKETS == 0


def content_sha256(rows: list) -> str:
    """sha256 of `rows` as JSON (sorted keys, non-JSON values as their str)."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class EvalItem:
    """One eval problem: its task, verifier-only payload, public payloads and gold."""

    task: Task
    hidden: dict[str, Any] | None = None
    payloads: dict[str, bytes] = field(default_factory=dict)
    """sha256 -> bytes of each public payload the task names by reference (`Task.workspace_ref`)."""
    gold: Any = None
    """What a local score compares `EvalSet.answer(final text)` with (None for pipeline-only sets)."""
    row: Any = None
    """What the set's content hash covers for this item (None: prompt, verifier, params, hidden)."""

    def content(self) -> Any:
        """This item's row of the content hash."""
        if self.row is not None:
            return self.row
        t = self.task
        return [[m.model_dump() for m in t.prompt], t.verifier, t.verifier_params, self.hidden]


@dataclass(frozen=True)
class EvalSet:
    """A domain's fixed eval set: the items, the domain, seed, level and how to score them."""

    domain: str
    """The config domain (or `general_<kind>`) its scores are published under."""
    seed: int
    level: int | None
    """The difficulty level the set was drawn at (None: a source without levels)."""
    items: tuple[EvalItem, ...]
    local: Local | None = None
    answer: Callable[[str], Any] | None = None
    """Parses a final text into what `EvalItem.gold` is compared with (local sets)."""
    purpose: Literal["train", "heldout"] = "train"

    def __post_init__(self) -> None:
        if self.local is not None and self.answer is None:
            raise ValueError(f"eval set {self.domain!r}: a locally scored set ({self.local}) needs `answer`")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def sha256(self) -> str:
        """The set's content hash (see the module guarantees)."""
        return content_sha256([it.content() for it in self.items])

    @property
    def score_key(self) -> tuple:
        """Sets with equal keys score the same under greedy decoding (scored once)."""
        budgets = sorted({(t.max_tokens, t.max_turns, t.tool_format, tuple(t.tools)) for t in self.tasks()})
        return (self.sha256, self.local, self.answer, tuple(budgets))

    def tasks(self) -> list[Task]:
        """The items' tasks, in order."""
        return [it.task for it in self.items]

    def correct(self, item: EvalItem, text: str) -> bool:
        """Whether a local final text answers `item` (see the module guarantees)."""
        assert self.answer is not None
        return self.answer(text) == item.gold

    def head(self, n: int) -> EvalSet:
        """The first `n` items (the same set when it has no more)."""
        return self if len(self.items) <= n else replace(self, items=self.items[:n])

    def with_purpose(self, purpose: Literal["train", "heldout"]) -> EvalSet:
        """This set published with `purpose`."""
        return replace(self, purpose=purpose)


def drawn_set(domain: str, seed: int, level: int | None, drawn: Iterable[Drawn]) -> EvalSet:
    """A pipeline-only set of drawn tasks (`producers.domains.Drawn`: task, hidden, payloads),
    scored by their own verifiers and hidden gold."""
    items = tuple(EvalItem(d.task, d.hidden, dict(d.payloads)) for d in drawn)
    return EvalSet(domain, seed, level, items)
