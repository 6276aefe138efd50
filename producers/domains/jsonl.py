"""The `jsonl` domain kind: any task file (JSONL task format, `producers.file_source`) scored by
any registered verifier.

Guarantees:
- It requires `DomainConfig.verifier` and `DomainConfig.data`; a missing one is a `ValueError`
  naming the key, as is missing data, an empty dataset (or no usable row) or a missing column.
- Hidden columns travel behind `hidden_ref` only (see `producers.file_source`).
"""

from __future__ import annotations

from producers.domains import DomainContext
from producers.file_source import FileSource, file_source


def JsonlDomain(ctx: DomainContext) -> FileSource:
    """`jsonl`: any task file (`data`, required) scored by any registered verifier (`verifier`, required)."""
    if not ctx.dc.verifier:
        raise ValueError(
            f"domain {ctx.name!r} (kind jsonl) needs sampler.domains.{ctx.name}.verifier: "
            "the registered verifier that scores its tasks"
        )
    if not ctx.dc.data:
        raise ValueError(
            f"domain {ctx.name!r} (kind jsonl) needs sampler.domains.{ctx.name}.data: a JSONL or Parquet "
            "file, or a datasets save_to_disk directory"
        )
    return file_source(ctx, None, ctx.dc.verifier)
