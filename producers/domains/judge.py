"""The `judge` domain kind: open answers scored by a reward model (JSONL task format, `producers.file_source`).

Guarantees:
- Default data examples/data/judge.jsonl; verifier `model`, with `params.model_path` (or env
  RLBUS_REWARD_MODEL on the verifier side) naming the reward model.
"""

from __future__ import annotations

from producers.domains import DomainContext
from producers.file_source import DATA, FileSource, file_source


def JudgeDomain(ctx: DomainContext) -> FileSource:
    """`judge`: open answers scored by the `model` verifier (default examples/data/judge.jsonl)."""
    extra = {"model_path": ctx.dc.params["model_path"]} if ctx.dc.params.get("model_path") else {}
    return file_source(ctx, DATA / "judge.jsonl", "model", extra)
