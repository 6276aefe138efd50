"""`rlbus init-model OUT`: build a tiny HF-format causal LM locally (no hub).

Guarantees: what `rlbus.model.tiny_model.build_tiny_model` guarantees (the same flags give
the same weights and tokenizer); prints where it was written, exit 0. `--max-positions N`
is the context; `--rope-scaling KIND:FACTOR` scales the rotary embedding from N/FACTOR
original positions (`tiny_model.parse_rope_scaling`); a malformed one prints why, exit 2.
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
    im.add_argument(
        "--max-positions", type=int, default=512, help="context in tokens (max_position_embeddings; default 512)"
    )
    im.add_argument(
        "--rope-scaling",
        metavar="KIND:FACTOR",
        default=None,
        help="scale the rotary embedding by FACTOR from max-positions/FACTOR original positions: linear, dynamic or yarn (e.g. linear:4)",
    )
    im.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus init-model`."""
    from rlbus.model.tiny_model import build_tiny_model, parse_rope_scaling

    try:
        rope = None if args.rope_scaling is None else parse_rope_scaling(args.rope_scaling)
    except ValueError as exc:
        print(f"rlbus init-model: {exc}")
        return 2
    if args.max_positions < 16:
        print(f"rlbus init-model: --max-positions {args.max_positions} is below 16")
        return 2
    path = build_tiny_model(
        Path(args.out),
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        seed=args.seed,
        tokenizer=args.tokenizer,
        max_position_embeddings=args.max_positions,
        rope_scaling=rope,
    )
    scaled = f", rope {rope[0]} x{rope[1]:g}" if rope else ""
    print(f"tiny model ({args.tokenizer} tokenizer, {args.max_positions} positions{scaled}) written to {path}")
    return 0
