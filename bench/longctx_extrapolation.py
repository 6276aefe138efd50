"""Length extrapolation of the tiny model on `recall` (issue 33 item 6): trained at one length,
evaluated at 1x, 2x and 4x it, recall reported by needle position at each.

What it measures (`python bench/longctx_extrapolation.py`, a few minutes on 2 shared cores):

- Models: one tiny qwen2 per `--ropes` entry (`none`, `linear`, `yarn`, `dynamic`), each built by
  `rlbus.model.tiny_model.build_tiny_model` with `max_position_embeddings` = 4 x `--train-length`
  + `--gen` and, for a scaled one, `rope_scaling` KIND with factor 4 (`[model] rope_scaling =
  "KIND:4"`, `rlbus init-model --rope-scaling KIND:4`: the rotary embedding covers the 4x length
  with the original positions of ~1x); then the same SFT (`learner.sft.run_sft`, same seed, same
  demonstrations: `recall` `single` at `--train-length` tokens, `--sft-seconds` / `--sft-steps`).
  `--model DIR` evaluates that model instead (its rope read from its config; `--train-length`
  is then the length it was trained at).
- Eval: `recall` problems (`producers.domains.recall`, the `eval` stream, variant `single`) at
  1x, 2x, 4x the training length, `--per-cell` problems per (length, position decile), the
  needle at the decile's middle. Per problem: `exact`, the greedy answer scored by the `recall`
  verifier's `score` (what the run's eval counts), and the teacher-forced needle: given the
  prompt and the demonstration up to the needle's access code, the share of the code's tokens
  that are the model's argmax (`code_acc`) and their mean NLL (`code_nll`): a graded recall
  signal a tiny model moves before it answers exactly.
- Results: `bench/results/longctx_extrapolation.json` (or `--out`): per model, per length, the
  means and the per-decile means, with the SFT summary, the machine load and the arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FACTORS = (1, 2, 4)


def recall_source(tok_dir: Path, train_length: int, max_tokens: int):
    """A `recall` source (variant `single`) whose levels 1..3 are 1x, 2x, 4x `train_length`."""
    from producers.domains import make_source
    from schemas.config import load_config

    lengths = [train_length * f for f in FACTORS]
    cfg_file = Path(tempfile.mkdtemp(prefix="lcx-")) / "recall.toml"
    cfg_file.write_text(
        f"[sampler.domains.recall]\nmax_level = {len(lengths)}\nmax_tokens = {max_tokens}\n"
        f'params = {{ tokenizer = "{tok_dir}", lengths = {lengths}, variants = ["single"], '
        f"max_prompt_tokens = {lengths[-1] + 64} }}\n"
    )
    return make_source("lcx", "recall", load_config(cfg_file))


def build_and_train(rope: str, work: Path, args) -> tuple[Path, dict]:
    """A tiny model with `rope` (none or KIND, factor 4) after the shared SFT; (dir, SFT summary)."""
    from learner.sft import run_sft
    from rlbus.model.tiny_model import build_tiny_model

    base = build_tiny_model(
        work / f"{rope}-base",
        tokenizer="bpe",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        max_position_embeddings=args.train_length * FACTORS[-1] + args.gen,
        rope_scaling=None if rope == "none" else (rope, float(FACTORS[-1])),
        seed=args.seed,
    )
    src = recall_source(base, args.train_length, args.gen)
    rng = random.Random(args.seed)
    batches = ([src.demonstration(rng, 1) for _ in range(args.batch)] for _ in iter(int, 1))
    out = work / f"{rope}-sft"
    stats = run_sft(
        base,
        out,
        batches,
        seconds=args.sft_seconds,
        max_steps=args.sft_steps,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        progress=False,
    )
    return out, stats


def needle_scores(model, tok, prompt_ids: list[int], completion: str, code: str) -> tuple[float, float]:
    """(argmax accuracy, mean NLL) of `code`'s tokens at its first place in `completion`, teacher-forced."""
    import torch

    enc = tok(completion, add_special_tokens=False, return_offsets_mapping=True)
    start = completion.index(code)
    span = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < start + len(code) and b > start]
    ids = torch.tensor([prompt_ids + list(enc["input_ids"])])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    pos = torch.tensor([len(prompt_ids) + i - 1 for i in span])
    targets = ids[0, pos + 1]
    logp = torch.log_softmax(logits[pos], dim=-1)
    acc = (logits[pos].argmax(-1) == targets).float().mean().item()
    return acc, -logp[torch.arange(len(span)), targets].mean().item()


def evaluate(model_dir: Path, args) -> dict:
    """Per length factor: means and per-decile means of exact, code_acc, code_nll."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from producers.domains import recall_gen as gen
    from producers.domains.recall import bucket_of
    from schemas.answers import ANSWER_OPEN, tagged_answer
    from schemas.chat import prompt_ids
    from verifier_workers.verifiers.recall import score

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    src = recall_source(model_dir, args.train_length, args.gen)
    out: dict = {}
    for level, factor in enumerate(FACTORS, 1):
        cells: dict[str, list[tuple[float, float, float]]] = {}
        for decile in range(10):
            position = (decile + 0.5) / 10
            for i in range(args.per_cell):
                lay = src.layout("eval", level, decile * args.per_cell + i, position, args.seed + 1)
                ids = prompt_ids(tok, lay.prompt)
                with torch.no_grad():
                    gen_ids = model.generate(
                        torch.tensor([ids]), max_new_tokens=args.gen, do_sample=False, pad_token_id=tok.pad_token_id
                    )[0, len(ids) :]
                text = tok.decode(gen_ids, skip_special_tokens=True)
                exact, _ = score({"gold": dict(lay.case.gold)}, tagged_answer(text))
                completion = f"Found: {lay.case.needles[0]}\n{ANSWER_OPEN}{gen.answer_text(lay.case)}"
                acc, nll = needle_scores(model, tok, ids, completion, lay.case.gold["value"])
                cells.setdefault(bucket_of(position), []).append((float(exact == 1.0), acc, nll))
        rows = [r for rs in cells.values() for r in rs]
        out[f"{factor}x"] = {
            "length": args.train_length * factor,
            **mean3(rows),
            "by_position": {b: mean3(rs) for b, rs in cells.items()},
        }
    return out


def mean3(rows: list[tuple[float, float, float]]) -> dict:
    n = len(rows)
    return {
        "n": n,
        "exact": round(sum(r[0] for r in rows) / n, 4),
        "code_acc": round(sum(r[1] for r in rows) / n, 4),
        "code_nll": round(sum(r[2] for r in rows) / n, 4),
    }


def rope_of(model_dir: Path) -> str:
    """`KIND:FACTOR` of a model's RoPE scaling (transformers 5 writes `rope_parameters`), else `none`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type"))
    return f"{kind}:{rs['factor']:g}" if kind not in (None, "default") and rs.get("factor") else "none"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-length", type=int, default=256, help="tokens of the training prompts (1x)")
    ap.add_argument("--ropes", default="none,linear,yarn", help="rope variants to build and train (factor 4)")
    ap.add_argument("--model", default="", help="evaluate this model dir instead of building ones")
    ap.add_argument("--sft-seconds", type=float, default=120.0)
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=32, help="generated tokens per answer")
    ap.add_argument("--per-cell", type=int, default=2, help="problems per (length, position decile)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "longctx_extrapolation.json"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results: dict = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="lcx-") as tmp:
        if args.model:
            results[rope_of(Path(args.model))] = {"model": args.model, "eval": evaluate(Path(args.model), args)}
        for rope in [] if args.model else args.ropes.split(","):
            model_dir, sft = build_and_train(rope, Path(tmp), args)
            results[rope if rope == "none" else f"{rope}:{FACTORS[-1]}"] = {
                "sft": sft,
                "eval": evaluate(model_dir, args),
            }
            print(f"{rope}: sft {sft['steps']} steps, loss {sft['first_loss']:.2f} -> {sft['final_loss']:.2f}")
    for name, res in results.items():
        for factor, row in res["eval"].items():
            deciles = " ".join(f"{v['code_acc']:.2f}" for v in row["by_position"].values())
            print(
                f"{name:10s} {factor} ({row['length']:5d} tok): exact {row['exact']:.2f} code_acc {row['code_acc']:.3f} "
                f"nll {row['code_nll']:.2f} | code_acc by decile {deciles}"
            )
    report = {
        "args": vars(args),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "seconds": round(time.time() - t0, 1),
        "models": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"results -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
