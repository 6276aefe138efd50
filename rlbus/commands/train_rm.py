"""`rlbus train-rm DATA... --model BASE --out DIR`: a reward model from preference pairs.

Guarantees: what `learner.rm_train` guarantees (Bradley-Terry loss with optional margin
and centring, length-sorted micro-batches, one process or `--world-size` FSDP2 ranks,
checkpoints and exact resume from `--out`), on the data forms of `learner.rm_data`.
It writes `DIR/model/` (a plain HF `AutoModelForSequenceClassification`, the `model`
verifier's `model_path`), `DIR/rm_report.json` and `DIR/rm_scores.png`, prints the
report's headline figures and exits 0. Bad data, a base model without a classifier head,
or a setting this machine cannot run exits 2 with the reason and what to change.
"""

from __future__ import annotations

import argparse
import sys


def _field_map(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        ours, sep, theirs = item.partition("=")
        if not sep or not ours or not theirs:
            raise argparse.ArgumentTypeError(f"--field-map {item!r}: expected OURS=THEIRS, e.g. prompt=question")
        out[ours.strip()] = theirs.strip()
    return out


def register(sub) -> None:
    """Add `rlbus train-rm` to the CLI's subparsers."""
    p = sub.add_parser(
        "train-rm",
        help="train a reward model on preference pairs (Bradley-Terry; progress bar, checkpoints, HF export)",
        description="Train a reward model on (prompt, chosen, rejected) pairs: JSONL, Parquet, a datasets "
        "save_to_disk directory, split files (train.jsonl test.jsonl) or a directory of them.",
    )
    p.add_argument("data", nargs="+", help="preference data: file(s) or one directory")
    p.add_argument("--model", required=True, help="base HF model directory (a causal LM or a 1-label classifier)")
    p.add_argument("--out", required=True, help="output directory (resumes from its checkpoints when present)")
    p.add_argument("--world-size", type=int, default=1, help="FSDP2 ranks (gloo on CPU, nccl on GPUs)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="auto: bf16 where native")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: full fine-tune)")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=32, help="pairs per optimizer step")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=0, help="steps (0: from --epochs)")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per side (longer: truncated from the left)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="padded positions per micro-batch")
    p.add_argument("--center-coef", type=float, default=0.0, help="centring: coef * mean((r_c + r_r)^2)")
    p.add_argument("--heldout-frac", type=float, default=0.05, help="pairs held out by content hash")
    p.add_argument("--heldout-split", default=None, help="use this split as the held-out set")
    p.add_argument("--field-map", nargs="*", default=[], metavar="OURS=THEIRS", help="e.g. prompt=question")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus train-rm`."""
    from transformers.utils import logging as hf_logging

    from learner.rm import RmModelError
    from learner.rm_data import RmDataError
    from learner.rm_train import RmConfig, run

    hf_logging.set_verbosity_error()  # the head's "newly initialized" report is expected here
    hf_logging.disable_progress_bar()  # the command shows its own

    try:
        cfg = RmConfig(
            data=[str(d) for d in args.data],
            model=str(args.model),
            out=str(args.out),
            world_size=args.world_size,
            backend=args.backend,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            dtype=args.dtype,
            lr=args.lr,
            weight_decay=args.weight_decay,
            batch_size=args.batch_size,
            epochs=args.epochs,
            max_steps=args.max_steps,
            max_length=args.max_length,
            micro_batch_tokens=args.micro_batch_tokens,
            center_coef=args.center_coef,
            heldout_frac=args.heldout_frac,
            heldout_split=args.heldout_split,
            field_map=_field_map(args.field_map),
            seed=args.seed,
            threads=args.threads,
            eval_every=args.eval_every,
            save_every=args.save_every,
        )
        report = run(cfg)
    except (RmDataError, RmModelError, ValueError, argparse.ArgumentTypeError) as exc:
        print(f"rlbus train-rm: {exc}", file=sys.stderr)
        return 2
    keys = ("steps", "pairs_per_s", "final_loss", "heldout_accuracy", "mean_margin", "ece", "skipped", "model_dir")
    print({k: report.get(k) for k in keys})
    return 0
