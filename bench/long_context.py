"""Long-context benchmark: multi-turn findoc-like episodes at growing histories, with and
without KV reuse across turns (`rollout.hf.prefix_reuse`; on vLLM `rollout.vllm.prefix_caching`).

What it measures (`python bench/long_context.py`, a few minutes on 2 shared cores with the defaults):

- The model: `--model DIR`, else a tiny Qwen2 (`--hidden`, `--layers`, char tokenizer, built
  with room for the longest history).
- An episode is driven as `rollout_workers.agent` drives the engine: turn 1's prompt is a
  findoc filing (`producers.domains.findoc_gen`: its blocks' text, repeated and cut to
  `--histories` tokens, then a question); every later turn's prompt is the previous context,
  the model turn (`--gen` tokens, greedy) and a tool observation of `--obs` tokens (a
  `read_file`-sized slice of the filing), as token ids. `--episodes` episodes run together,
  one batched `generate` per turn; `--turns` turns each.
- Both sides (reuse off, reuse on) run in the same process on the same engine weights,
  alternating `--repeats` times per history (the same machine load); the median of each
  measure is reported: time per episode (all turns), time per later turn (turns 2.., where
  reuse acts), generated tokens / s, and the speed-up (off / on). The generated ids of the
  two sides are compared (greedy: must be equal; a difference fails the run).
- The growth exponent of time per later turn vs history length: the slope of a least-squares
  fit of log(time) on log(history), per side (1 = linear; the goal with reuse: at most 1).
- `--engine vllm` runs the same episodes on `VLLMEngine` (prefix caching off vs on) and needs
  vLLM (`.venv-vllm`, `make vllm-env`, or the gpu extra); not run on the 2-core machine.
- Results: `bench/results/long_context.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def filing_ids(engine, tokens: int, seed: int = 0) -> list[int]:
    """`tokens` ids of findoc filing text (blocks in order, repeated as needed)."""
    from producers.domains import findoc_gen as gen

    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < tokens:
        filing = gen.make_filing(rng)
        text = "\n\n".join(b.text for b in sorted(gen.blocks(filing).values(), key=lambda b: b.order))
        ids.extend(int(x) for x in engine.encode(text))
    return ids[:tokens]


def run_episodes(engine, doc: list[int], question: list[int], args) -> dict:
    """One batch of episodes; per-turn wall times, generated tokens and every turn's ids."""
    contexts = [doc + question for _ in range(args.episodes)]
    turns, generated, outputs = [], 0, []
    for t in range(args.turns):
        t0 = time.perf_counter()
        groups = engine.generate(contexts, 1, args.gen, 0.0)
        turns.append(time.perf_counter() - t0)
        for i, (c, (s,)) in enumerate(zip(contexts, groups, strict=True)):
            ids = [int(x) for x in s.token_ids]
            generated += len(ids)
            outputs.append(ids)
            start = (t * args.obs * 7 + i * 131) % max(1, len(doc) - args.obs)
            c.extend(ids)
            c.extend(doc[start : start + args.obs])  # the observation: a slice of the filing
    return {"turns": turns, "generated": generated, "outputs": outputs}


def make_engine(args, model_dir: str, reuse: bool):
    if args.engine == "vllm":
        from rollout_workers.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, enforce_eager=True, prefix_caching=reuse, dtype="float32")
    from rollout_workers.engines.hf_engine import HFEngine

    return HFEngine(model_dir, "cpu", args.threads, prefix_reuse=reuse)


def growth(xs: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through (log x, log y)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def measure(engines: dict, history: int, args) -> dict:
    """Both sides at one history, alternated `args.repeats` times; medians."""
    probe = engines[False]
    doc = filing_ids(probe, history)
    question = [int(x) for x in probe.encode("\n\nQuestion: What was total revenue in the last fiscal year?\nAnswer:")]
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.repeats):
        for reuse in (False, True) if r % 2 == 0 else (True, False):
            engine = engines[reuse]
            if getattr(engine, "prefix", None) is not None:
                engine.prefix.clear()  # every repeat starts cold: turn 1 prefills the history
            runs[reuse].append(run_episodes(engine, doc, question, args))
    if runs[False][0]["outputs"] != runs[True][0]["outputs"]:
        raise SystemExit(f"history {history}: generated ids differ with and without reuse (greedy)")
    out = {}
    for reuse, rs in runs.items():
        episode = statistics.median(sum(x["turns"]) for x in rs)
        later = statistics.median(statistics.mean(x["turns"][1:]) for x in rs)
        first = statistics.median(x["turns"][0] for x in rs)
        out["reuse" if reuse else "full"] = {
            "seconds_per_episode": episode / args.episodes,
            "seconds_per_batch": episode,
            "first_turn_s": first,
            "later_turn_s": later,
            "tokens_per_s": rs[0]["generated"] / episode,
        }
    out["speedup_episode"] = out["full"]["seconds_per_batch"] / out["reuse"]["seconds_per_batch"]
    out["speedup_later_turn"] = out["full"]["later_turn_s"] / out["reuse"]["later_turn_s"]
    out["prompt_tokens_last_turn"] = history + len(question) + (args.turns - 1) * (args.gen + args.obs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--model", default=None, help="model dir (default: a tiny Qwen2 built here)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--histories", default="1024,2048,4096,8192", help="document tokens, comma-separated")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--obs", type=int, default=64, help="tokens of each tool observation")
    p.add_argument("--episodes", type=int, default=2, help="episodes per batch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_context.json"))
    args = p.parse_args()
    histories = [int(x) for x in args.histories.split(",")]
    model_dir = args.model
    if model_dir is None:
        from rlbus.model.tiny_model import build_tiny_model

        need = max(histories) + 256 + args.turns * (args.gen + args.obs)
        size = 1 << (need - 1).bit_length()
        model_dir = str(
            build_tiny_model(
                Path(tempfile.mkdtemp()) / "m",
                hidden_size=args.hidden,
                num_layers=args.layers,
                max_position_embeddings=size,
            )
        )
    engines = {False: make_engine(args, model_dir, False), True: make_engine(args, model_dir, True)}
    results = {}
    for h in histories:
        results[str(h)] = measure(engines, h, args)
        r = results[str(h)]
        print(
            f"history {h:>6}: episode {r['full']['seconds_per_episode']:.3f}s -> {r['reuse']['seconds_per_episode']:.3f}s "
            f"(x{r['speedup_episode']:.2f}), later turn {r['full']['later_turn_s']:.3f}s -> "
            f"{r['reuse']['later_turn_s']:.3f}s (x{r['speedup_later_turn']:.2f}), "
            f"tok/s {r['full']['tokens_per_s']:.1f} -> {r['reuse']['tokens_per_s']:.1f}",
            flush=True,
        )
    fit = {
        side: growth([float(h) for h in histories], [results[str(h)][side]["later_turn_s"] for h in histories])
        for side in ("full", "reuse")
    }
    print(f"growth exponent of time per later turn vs history: full {fit['full']:.2f}, reuse {fit['reuse']:.2f}")
    report = {
        "engine": args.engine,
        "model": args.model or f"tiny qwen2 hidden {args.hidden}, {args.layers} layers, char tokenizer",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model")},
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "histories": results,
        "growth_exponent_later_turn": fit,
        "ids_equal": True,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
