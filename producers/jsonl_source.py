"""JSONL-backed domain kinds: `jsonl` (any task file + any verifier), `extract` and `judge`.

Task file format, one JSON object per line:
    {"id": "...", "prompt": "text" | [{"role", "content"}, ...],
     "hidden": {...verifier-only: gold, tests, reference...},
     "params": {...public verifier params...}, "level": 2 (optional)}

Guarantees:
- `hidden` never travels with the task: it is returned as the `Drawn.hidden` payload,
  stored under `Task.hidden_ref = hidden_ref_for(domain, id)`, which only verifiers
  resolve. A line without `hidden` (or with an empty one) has no hidden_ref.
- A line that puts `gold` in its public `params` is refused (it would reach the policy).
- Public params are `DomainConfig.params["verifier_params"]` (defaults for every line)
  overlaid by the line's `params`; `DomainConfig.reward_weights` travel as usual
  (`finish_task`, as `Task.reward_weights`).
- Lines with a `level` are drawn at that curriculum level when it has any, otherwise
  from the whole file (`StaticSource`), with the sampler's seeded RNG.
- `jsonl` requires `DomainConfig.verifier` and `DomainConfig.data`; a missing one, a
  missing/empty file or a malformed line is a `ValueError` naming the file and line.
- `extract` defaults to examples/data/extract.jsonl and the `extract` verifier; `judge`
  to examples/data/judge.jsonl and the `model` verifier, with `params.model_path` (or
  env RLBUS_REWARD_MODEL on the verifier side) naming the reward model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from bus.hidden import hidden_ref_for
from producers.domains import DomainContext, StaticSource
from schemas import ChatMessage

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
PUBLIC_FORBIDDEN = ("gold",)


@dataclass(frozen=True)
class TaskLine:
    """One line of a task file."""

    id: str
    prompt: tuple[ChatMessage, ...]
    hidden: dict[str, Any] | None
    params: dict[str, Any]
    level: int | None


def resolve(data: str, default: Path | None = None) -> Path:
    """The data file (relative paths from the cwd, else from the repository root)."""
    if not data:
        if default is None:
            raise ValueError("no data file given")
        return default
    p = Path(data)
    return p if p.is_absolute() or p.exists() else ROOT / p


def _prompt(raw: Any) -> tuple[ChatMessage, ...]:
    if isinstance(raw, str) and raw.strip():
        return (ChatMessage(role="user", content=raw),)
    if isinstance(raw, list) and raw:
        return tuple(ChatMessage(**m) for m in raw)
    raise ValueError("prompt must be a non-empty string or list of {role, content}")


def parse_line(d: Any) -> TaskLine:
    """One task line (ValueError/KeyError/TypeError on a malformed one)."""
    if not isinstance(d, dict):
        raise ValueError("line is not a JSON object")
    hidden, params = d.get("hidden"), d.get("params") or {}
    if hidden is not None and not isinstance(hidden, dict):
        raise ValueError("hidden must be an object")
    if not isinstance(params, dict):
        raise ValueError("params must be an object")
    leaked = [k for k in PUBLIC_FORBIDDEN if k in params]
    if leaked:
        raise ValueError(f"params {leaked} are public (the policy sees them); put them under 'hidden'")
    level = d.get("level")
    return TaskLine(str(d["id"]), _prompt(d["prompt"]), hidden or None, params,
                    int(level) if level is not None else None)


@lru_cache(maxsize=16)
def load(path: str) -> tuple[TaskLine, ...]:
    """Every task of a JSONL file (cached per path)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"task file {p} not found")
    out, seen = [], set()
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = parse_line(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{p}:{n}: bad task line ({exc!r}); need id, prompt, optional hidden/params/level") from None
        if task.id in seen:
            raise ValueError(f"{p}:{n}: duplicate id {task.id!r}")
        seen.add(task.id)
        out.append(task)
    if not out:
        raise ValueError(f"task file {p} has no tasks")
    return tuple(out)


def items(ctx: DomainContext, tasks: tuple[TaskLine, ...], verifier: str,
          extra: dict[str, Any] | None = None) -> list[tuple[dict[str, Any], dict[str, Any] | None, int | None]]:
    """StaticSource items: (task fields, hidden, level) per line."""
    defaults = {**(ctx.dc.params.get("verifier_params") or {}), **(extra or {})}
    out = []
    for t in tasks:
        fields: dict[str, Any] = dict(prompt=list(t.prompt), verifier=verifier,
                                      verifier_params={**defaults, "problem_id": t.id, **t.params})
        if t.hidden:
            fields["hidden_ref"] = hidden_ref_for(ctx.name, t.id)
        out.append((fields, t.hidden, t.level))
    return out


def file_source(ctx: DomainContext, default_data: Path | None, verifier: str,
                extra: dict[str, Any] | None = None) -> StaticSource:
    """A StaticSource over the domain's task file."""
    return StaticSource(ctx, items(ctx, load(str(resolve(ctx.dc.data, default_data))), verifier, extra))


def JsonlDomain(ctx: DomainContext) -> StaticSource:
    """`jsonl`: any task file (`data`, required) scored by any registered verifier (`verifier`, required)."""
    if not ctx.dc.verifier:
        raise ValueError(f"domain {ctx.name!r} (kind jsonl) needs sampler.domains.{ctx.name}.verifier: "
                         "the registered verifier that scores its tasks")
    if not ctx.dc.data:
        raise ValueError(f"domain {ctx.name!r} (kind jsonl) needs sampler.domains.{ctx.name}.data: a JSONL task file")
    return file_source(ctx, None, ctx.dc.verifier)


def ExtractDomain(ctx: DomainContext) -> StaticSource:
    """`extract`: text -> JSON fields, gold hidden (default examples/data/extract.jsonl)."""
    return file_source(ctx, DATA / "extract.jsonl", "extract")


def JudgeDomain(ctx: DomainContext) -> StaticSource:
    """`judge`: open answers scored by the `model` verifier (default examples/data/judge.jsonl)."""
    extra = {"model_path": ctx.dc.params["model_path"]} if ctx.dc.params.get("model_path") else {}
    return file_source(ctx, DATA / "judge.jsonl", "model", extra)
