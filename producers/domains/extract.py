"""The `extract` domain kind: text -> JSON fields, the gold hidden (JSONL task format, `producers.file_source`).

Guarantees:
- Default data examples/data/extract.jsonl; default verifier `extract`.
- Hidden gold travels behind `hidden_ref` only.
"""

from __future__ import annotations

from producers.domains import DomainContext
from producers.file_source import DATA, FileSource, file_source


def ExtractDomain(ctx: DomainContext) -> FileSource:
    """`extract`: text -> JSON fields, gold hidden (default examples/data/extract.jsonl)."""
    return file_source(ctx, DATA / "extract.jsonl", "extract")
