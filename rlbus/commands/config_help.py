"""`rlbus config-help [KEY]`: every run-config field with its type, default and docstring.

Guarantees: the listing is generated from the config models themselves (`schemas.config`),
so it is never out of date; a KEY prefix (`learner`, `learner.lora`, `scheduler.eval.n`)
narrows it, and a prefix that matches nothing exits 1 naming the top-level sections.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import BaseModel

from schemas.config import RunConfig


def fields(model: type[BaseModel], place: str = ""):
    """(dotted key, type, default, doc) of every leaf field, sections expanded in order."""
    for name, info in model.model_fields.items():
        key = f"{place}{name}"
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from fields(ann, key + ".")
            continue
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        yield key, getattr(ann, "__name__", None) or str(ann).replace("typing.", ""), default, info.description or ""


def main(args: argparse.Namespace) -> int:
    prefix = args.key or ""
    rows = [r for r in fields(RunConfig) if not prefix or r[0] == prefix or r[0].startswith(prefix + ".")]
    if not rows:
        print(
            f"rlbus config-help: no config field {prefix!r}; sections: {', '.join(RunConfig.model_fields)}",
            file=sys.stderr,
        )
        return 1
    for key, typ, default, doc in rows:
        print(f"{key} ({typ}) = {default!r}")
        for line in doc.splitlines():
            print(f"    {line.strip()}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "config-help",
        help="every run-config field: type, default and what it does",
        description="List run-config fields (TOML keys, or `--set KEY=VALUE` for `rlbus up`) with "
        "their type, default and docstring, e.g. `rlbus config-help learner.lora`.",
    )
    p.add_argument("key", nargs="?", help="a key or section prefix, e.g. learner, scheduler.eval, sampler.group_size")
    p.set_defaults(func=main)
