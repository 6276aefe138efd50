"""The file-backed source of the JSONL task format: the `jsonl`, `extract`, `judge` and `files` kinds.

Default row format (one JSON object per line in JSONL; the same columns in Parquet or a
`datasets` dir, see `producers.datafile`; `DomainConfig.field_map` renames them):
    {"id": "...", "prompt": "text" | [{"role", "content"}, ...],
     "hidden": {...verifier-only: gold, tests, reference...},
     "params": {...public verifier params...}, "level": 2 (optional)}

Guarantees:
- `hidden` (and a `gold` / `hidden.<key>` column of `field_map`) never travels with the
  task: it is returned as the `Drawn.hidden` payload, stored under `Task.hidden_ref =
  hidden_ref_for(domain, id)`, which only verifiers resolve. A row without hidden data
  has no hidden_ref.
- A row that puts `gold` in its public `params` is skipped (it would reach the policy),
  like every malformed row: counted and logged, the run goes on (`producers.datafile`).
- Public params are `DomainConfig.params["verifier_params"]` (defaults for every row)
  overlaid by the row's `params`; `DomainConfig.reward_weights` travel as usual
  (`finish_task`, as `Task.reward_weights`).
- Only training rows are drawn: held-out rows (`heldout_fraction`, `heldout_split`) never
  are; the source's `data` (`DataSplit`) holds both and their hashes.
- Rows with a `level` are drawn at that curriculum level when it has any, otherwise
  from all training rows (`StaticSource`), with the sampler's seeded RNG.
- Missing data, an empty dataset (or no usable row) or a missing column is a `ValueError`.
- The kinds themselves are `producers.domains.{jsonl,extract,judge,files}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.hidden import hidden_ref_for
from producers.datafile import (
    ROOT,
    DataSplit,
    RowError,
    Spec,
    TaskLine,
    chat_prompt,
    domain_split,
    level_of,
    load_split,
    resolve,
)
from producers.domains import DomainContext, StaticSource

__all__ = ["DATA", "JSONL", "TaskLine", "file_source", "items", "load", "resolve"]

DATA = ROOT / "examples" / "data"
PUBLIC_FORBIDDEN = ("gold",)


def parse_row(task_id: str, rec: dict[str, Any]) -> TaskLine:
    """One task row from its canonical record (RowError on a malformed one)."""
    params = rec["params"]
    leaked = [k for k in PUBLIC_FORBIDDEN if k in params]
    if leaked:
        raise RowError(
            "gold in public params", f"params {leaked} are public (the policy sees them); put them under 'hidden'"
        )
    return TaskLine(task_id, chat_prompt(rec["prompt"]), rec["hidden"] or None, params, level_of(rec.get("level")))


JSONL = Spec(
    "jsonl",
    (("id", "id"), ("prompt", "prompt"), ("hidden", "hidden"), ("params", "params"), ("level", "level")),
    ("prompt",),
    parse_row,
)
"""The task format of the `jsonl`, `extract`, `judge` (and `files`) kinds."""


def load(path: str) -> tuple[TaskLine, ...]:
    """Every usable task of a data file in the default format (cached; malformed rows skipped)."""
    return load_split(str(path), Path(path), JSONL).train


def items(
    ctx: DomainContext, tasks: tuple[TaskLine, ...], verifier: str, extra: dict[str, Any] | None = None
) -> list[tuple[dict[str, Any], dict[str, Any] | None, int | None]]:
    """StaticSource items: (task fields, hidden, level) per line."""
    defaults = {**(ctx.dc.params.get("verifier_params") or {}), **(extra or {})}
    out = []
    for t in tasks:
        fields: dict[str, Any] = dict(
            prompt=list(t.prompt), verifier=verifier, verifier_params={**defaults, "problem_id": t.id, **t.params}
        )
        if t.hidden:
            fields["hidden_ref"] = hidden_ref_for(ctx.name, t.id)
        out.append((fields, t.hidden, t.level))
    return out


@dataclass
class FileSource(StaticSource):
    """A StaticSource over a domain's training rows, with its whole `DataSplit` (held-out rows, hashes)."""

    data: DataSplit | None = None


def file_source(
    ctx: DomainContext, default_data: Path | None, verifier: str, extra: dict[str, Any] | None = None
) -> FileSource:
    """A source over the training rows of the domain's data."""
    split = domain_split(ctx, JSONL, default_data)
    return FileSource(ctx, items(ctx, split.train, verifier, extra), data=split)
