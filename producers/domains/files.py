"""The `files` domain kind: the policy writes a file (JSON, CSV, SVG) that must meet requirements.

Task file: the JSONL format of `producers.file_source`, where each line's `params` name
the file (`path`, `format`: json|csv|svg) and `hidden` holds the requirements the
`files` verifier checks (schema, gold values, required SVG elements). The prompt says
what to write; the gold values stay hidden.

Guarantees:
- Default data examples/data/files.jsonl; default verifier `files`.
- Every line must give a `path` and a known `format` (ValueError naming the line's id).
- Tasks carry `DomainConfig.params["tools"]` (default none) so multi-turn configs can
  let the policy write the file in its sandbox (the rollout worker exports it as an
  artifact); single-turn episodes answer with the file in a fenced block instead.
- Hidden requirements travel behind `hidden_ref` only (see `producers.file_source`).
"""

from __future__ import annotations

from producers.domains import DomainContext
from producers.file_source import DATA, FileSource, file_source

FORMATS = ("json", "csv", "svg")


def FilesDomain(ctx: DomainContext) -> FileSource:
    """Task source of one `files` config domain (its data, split, field_map and held-out rows
    read as every file-backed domain's are)."""
    source = file_source(ctx, DATA / "files.jsonl", "files")
    for fields, _, _ in source.items:
        params = fields["verifier_params"]
        if not isinstance(params.get("path"), str) or params.get("format") not in FORMATS:
            raise ValueError(
                f"sampler.domains.{ctx.name}: task {params.get('problem_id')!r} needs params.path and "
                f"params.format in {FORMATS}"
            )
    tools = list(ctx.dc.params.get("tools") or [])
    if tools:
        for fields, _, _ in source.items:
            fields["tools"] = tools
    return source
