"""Reward-model training, ours (`rlbus train-rm`) vs TRL `RewardTrainer`, one run, two sizes.

What it measures (`python bench/rm_vs_trl.py`; tens of minutes on 2 loaded cores):

- At each `--sizes` (`10m`: hidden 320, 6 layers, 10.5M params; `50m`: hidden 512, 12
  layers, 51.4M params; both Qwen2-shaped, head_dim 64, the locally trained byte-level
  BPE of `rlbus.model.bpe_tokenizer`, vocab 2048, built by `build_tiny_model`, no download)
  both sides train the SAME base (each side loads its own copy from the same directory)
  on the SAME preference pairs: arithmetic prompts `a+b=` (two-digit a, b), chosen the
  sum, rejected the product or the difference (the wrong operation), `--pairs` of them,
  split once into train.jsonl / test.jsonl by `learner.rm_data`'s content hash; both
  sides train on train and are scored on test.
- Same optimisation: `--steps` (per size) AdamW steps of `--batch-size` pairs, lr `--lr`, no weight
  decay, betas (0.9, 0.999), gradient clipping 1.0, warmup min(50, steps/10) steps then
  cosine to 10% of lr (TRL: `cosine_with_min_lr`, `min_lr_rate` 0.1), fp32, no
  activation checkpointing (TRL's default is on: turned off), the same torch threads
  (`--threads`, default 1: on this shared 2-core machine 2 intra-op threads made our step
  8x slower, 0.68 s vs 0.084 s, from contention alone).
- OURS: `learner.rm_train.run` (what `rlbus train-rm` runs, defaults: one row per pair
  with the prompt computed once, `learner.rm_shared`; fused AdamW, as TRL's default
  `adamw_torch_fused`), pairs/s from its summary (optimizer steps' time), held-out
  accuracy from its `rm_report.json`. Ours tokenizes (prompt, response) as a pair, as the
  `model` verifier serves it (no EOS appended); TRL tokenizes prompt + response + EOS.
- PEER: TRL `RewardTrainer` with `RewardConfig` as above (`max_length` the same; TRL
  appends EOS to each side, concatenates prompt + response and drops over-long pairs;
  none is over-long here). pairs/s = steps x batch / `train_runtime`; held-out accuracy
  per pair on test (`trl_accuracy`: r_chosen > r_rejected, each side as TRL tokenizes it;
  TRL's own `eval_accuracy`, a mean of per-batch means, is recorded next to it).
- The sides alternate `--rounds` times (ours, TRL, then TRL, ours, ...) so machine load hits
  both; per size the median pairs/s and the mean accuracy are reported, `ratio` = ours /
  TRL pairs/s, `accuracy_gap_points` = 100 x (ours - TRL), and the 1-minute load average
  after each run. Goal (issue 32 item 6): ratio >= 1.3 and gap >= -1 point at each size.

Writes bench/results/rm_vs_trl.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_data(root: Path, n: int, seed: int) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of arithmetic preference pairs, split by content hash."""
    from learner.rm_data import Pair

    rng = random.Random(seed)
    train, test = [], []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        wrong = a * b if rng.random() < 0.5 else a - b
        row = {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)}
        pair = Pair(row["prompt"], row["chosen"], row["rejected"])
        (test if int(pair.key()[:8], 16) / 0xFFFFFFFF < 0.15 else train).append(row)
    for name, rows in (("train", train), ("test", test)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "train.jsonl", root / "test.jsonl"


def ours(base: Path, train: Path, test: Path, out: Path, args) -> dict:
    from learner.rm_train import RmConfig, run

    cfg = RmConfig(
        data=[str(train), str(test)],
        model=str(base),
        out=str(out),
        dtype="fp32",
        lr=args.lr,
        batch_size=args.batch_size,
        max_steps=args.steps,
        max_length=args.max_length,
        heldout_split="test",
        eval_every=0,
        save_every=0,
        progress=False,
        threads=args.threads,
        seed=args.seed,
    )
    report = run(cfg)
    return {"pairs_per_s": report["pairs_per_s"], "heldout_accuracy": report["heldout_accuracy"]}


def trl_side(base: Path, train: Path, test: Path, out: Path, args) -> dict:
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, pad_token_id=tok.pad_token_id)
    config = RewardConfig(
        output_dir=str(out),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=max(1, min(50, args.steps // 10)),
        max_length=args.max_length,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=10**6,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    load = lambda p: datasets.load_dataset("json", data_files=str(p), split="train")
    trainer = RewardTrainer(
        model=model, args=config, train_dataset=load(train), eval_dataset=load(test), processing_class=tok
    )
    metrics = trainer.train().metrics
    return {
        "pairs_per_s": args.steps * args.batch_size / metrics["train_runtime"],
        "heldout_accuracy": trl_accuracy(trainer.model, tok, test),
        "trl_eval_accuracy": trainer.evaluate()["eval_accuracy"],
    }


def trl_accuracy(model, tok, test: Path) -> float:
    """Per-pair held-out accuracy of TRL's model, each side scored as TRL trained it
    (prompt + response + EOS, one sequence); TRL's own `eval_accuracy` is a mean of batch means."""
    import torch

    model.eval()
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    wins = 0
    with torch.no_grad():
        for r in rows:
            c, rj = (tok(r["prompt"] + r[k] + tok.eos_token, return_tensors="pt") for k in ("chosen", "rejected"))
            wins += float(model(**c).logits[0, 0]) > float(model(**rj).logits[0, 0])
    return wins / len(rows)


SIZES = {  # Qwen2-shaped, BPE (vocab 2048), head_dim 64; params as built (rlbus_model.json)
    "10m": {"hidden_size": 320, "num_layers": 6, "num_heads": 5},
    "50m": {"hidden_size": 512, "num_layers": 12, "num_heads": 8},
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10m,50m", help=f"comma-separated, of {sorted(SIZES)}")
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--steps", default="10m:60,50m:20", help="N for every size, or size:N,size:N")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench/results/rm_vs_trl.json"))
    args = p.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    try:
        spec = dict(x.split(":") if ":" in x else ("*", x) for x in args.steps.split(","))
        args.steps_by_size = {s: int(spec.get(s, spec.get("*", 0))) for s in args.sizes}
    except ValueError:
        p.error(f"--steps {args.steps!r}: give N or size:N,size:N")
    if min(args.steps_by_size.values(), default=0) < 1:
        p.error(f"--steps {args.steps!r} leaves a size without steps: {args.steps_by_size}")
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown --sizes {unknown}: choose from {sorted(SIZES)}")
    return args


def one_size(size: str, root: Path, train: Path, test: Path, args) -> dict:
    """Both sides on the `size` base, alternating `--rounds` times; the size's summary."""
    from rlbus.model.tiny_model import build_tiny_model

    base = build_tiny_model(root / f"base-{size}", tokenizer="bpe", seed=args.seed, **SIZES[size])
    meta = json.loads((base / "rlbus_model.json").read_text())
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    steps = args.steps_by_size[size]
    for k in range(args.rounds):  # alternate, starting side swapped each round: load hits both
        order = (("ours", ours), ("trl", trl_side)) if k % 2 == 0 else (("trl", trl_side), ("ours", ours))
        for name, fn in order:
            t0 = time.perf_counter()
            r = fn(base, train, test, root / f"{size}-{name}{k}", argparse.Namespace(**{**vars(args), "steps": steps}))
            runs[name].append({**r, "wall_s": round(time.perf_counter() - t0, 2), "load_1m": os.getloadavg()[0]})
            print(size, name, k, runs[name][-1], flush=True)
    summary = {
        name: {
            "pairs_per_s_median": statistics.median(r["pairs_per_s"] for r in rs),
            "heldout_accuracy_mean": statistics.mean(r["heldout_accuracy"] for r in rs),
            "runs": rs,
        }
        for name, rs in runs.items()
    }
    ratio = summary["ours"]["pairs_per_s_median"] / summary["trl"]["pairs_per_s_median"]
    gap = summary["ours"]["heldout_accuracy_mean"] - summary["trl"]["heldout_accuracy_mean"]
    return {
        "params": meta["params"],
        "steps": steps,
        "model": {k: meta[k] for k in ("arch", "tokenizer", "vocab_size", "hidden_size", "num_layers", "num_heads")},
        "ratio": round(ratio, 3),
        "accuracy_gap_points": round(100 * gap, 2),
        "goal_met": ratio >= 1.3 and gap >= -0.01,
        **summary,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train, test = make_data(root, args.pairs, args.seed)
        for size in args.sizes:  # the JSON is rewritten after each size (a long run leaves what it finished)
            sizes[size] = one_size(size, root, train, test, args)
            write(args, argv, sizes)
    for size, r in sizes.items():
        print(
            size,
            f"{r['params'] / 1e6:.1f}M params: ours {r['ours']['pairs_per_s_median']:.1f} pairs/s "
            f"acc {r['ours']['heldout_accuracy_mean']:.3f} | TRL {r['trl']['pairs_per_s_median']:.1f} pairs/s "
            f"acc {r['trl']['heldout_accuracy_mean']:.3f} | ratio {r['ratio']} gap {r['accuracy_gap_points']} pts",
        )
    return 0


def write(args, argv, sizes: dict) -> None:
    from importlib.metadata import version

    result = {
        "name": "rm_vs_trl",
        "command": "python bench/rm_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "trl": version("trl"),
        "torch": version("torch"),
        "cpus": os.cpu_count(),
        "loadavg_1m_end": os.getloadavg()[0],
        "goal": "per size: pairs/s >= 1.3x TRL's and held-out accuracy within 1 point",
        "sizes": sizes,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
