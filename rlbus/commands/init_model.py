"""`rlbus init-model OUT`: build a tiny HF-format causal LM locally (no hub).

Guarantees: what `rlbus.model.tiny_model.build_tiny_model` guarantees (the same flags give
the same weights and tokenizer); prints where it was written, exit 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    """Add `rlbus init-model` to the CLI's subparsers."""
    im = sub.add_parser("init-model", help="build a tiny HF-format causal LM (BPE or char tokenizer) locally")
    im.add_argument("out", help="output folder")
    im.add_argument(
        "--tokenizer",
        choices=("bpe", "char"),
        default="bpe",
        help="bpe: byte-level BPE with a ChatML chat template (default); char: one id per character",
    )
    im.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    for flag, default in (("--hidden-size", 128), ("--num-layers", 4), ("--num-heads", 4), ("--seed", 0)):
        im.add_argument(flag, type=int, default=default)
    im.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus init-model`."""
    from rlbus.model.tiny_model import build_tiny_model

    path = build_tiny_model(
        Path(args.out),
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        seed=args.seed,
        tokenizer=args.tokenizer,
    )
    print(f"tiny model ({args.tokenizer} tokenizer) written to {path}")
    return 0
