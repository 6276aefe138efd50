"""`rlbus sft MODEL OUT`: supervised warm start on arith demonstrations, with a progress bar.

Guarantees: what `learner.sft.run_sft` guarantees, on seeded arith demonstrations at
`--difficulty`; bounded by `--seconds` and `--max-steps`; prints the training stats, exit 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    """Add `rlbus sft` to the CLI's subparsers."""
    sft = sub.add_parser("sft", help="supervised warm start on arith demonstrations (progress bar)")
    sft.add_argument("model", help="HF model folder to start from")
    sft.add_argument("out", help="output folder")
    sft.add_argument("--seconds", type=float, default=75.0)
    sft.add_argument("--max-steps", type=int, default=100_000)
    sft.add_argument("--difficulty", type=int, default=3)
    sft.add_argument("--batch-size", type=int, default=64)
    sft.add_argument("--lr", type=float, default=3e-3)
    sft.add_argument("--threads", type=int, default=2)
    sft.add_argument("--seed", type=int, default=0)
    sft.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus sft`."""
    from learner.sft import run_sft
    from producers.demos import batches_of
    from producers.domains import arith

    def demo(rng):
        p = arith.generate(rng, args.difficulty)
        return p.prompt, p.completion

    stats = run_sft(
        Path(args.model),
        Path(args.out),
        batches_of(demo, args.seed, args.batch_size),
        seconds=args.seconds,
        max_steps=args.max_steps,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        progress=True,
    )
    print(stats)
    return 0
