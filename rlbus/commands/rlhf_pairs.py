"""`rlbus rlhf-pairs OUT`: preference pairs decided by the RLHF example's hidden rule.

Guarantees: what `producers.domains.rlhf.preference_pairs` guarantees (deterministic by
`--seed`, `--level`, `--max-chars`; chosen = the correct bare answer of at most max-chars
characters, rejected = a worked, a wrong or a padded answer), written as JSONL with
`prompt`, `chosen`, `rejected` (and `rejected_kind`), the form `rlbus train-rm` reads.
Prints the path and the count of each rejected kind, exit 0; a bad argument exits 2 with why.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def register(sub) -> None:
    """Add `rlbus rlhf-pairs` to the CLI's subparsers."""
    p = sub.add_parser(
        "rlhf-pairs",
        help="write preference pairs under the RLHF example's hidden rule (for train-rm)",
        description="Arithmetic preference pairs: chosen iff the answer is correct AND at most --max-chars "
        "characters (examples/rlhf.toml).",
    )
    p.add_argument("out", help="output JSONL file")
    p.add_argument("--n", type=int, default=2000, help="pairs to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", type=int, default=3, help="arith difficulty level of the prompts")
    p.add_argument("--max-chars", type=int, default=4, help="the hidden rule's length limit")
    p.add_argument("--eval-seed", type=int, default=0, help="scheduler.eval.seed whose held-out problems are left out")
    p.add_argument("--eval-n", type=int, default=200, help="scheduler.eval.n: how many held-out problems are left out")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus rlhf-pairs`."""
    from producers.domains.rlhf import preference_pairs, write_pairs

    if args.max_chars < 1:
        print(f"rlbus rlhf-pairs: --max-chars must be >= 1, got {args.max_chars}")
        return 2
    try:
        pairs = preference_pairs(args.seed, args.n, args.level, args.max_chars, args.eval_seed, args.eval_n)
    except ValueError as exc:
        print(f"rlbus rlhf-pairs: {exc}")
        return 2
    path = write_pairs(Path(args.out), pairs)
    print(json.dumps({"out": str(path), "pairs": len(pairs), "rejected": Counter(p["rejected_kind"] for p in pairs)}))
    return 0
