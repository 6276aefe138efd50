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
- `--engine vllm` (run with `.venv-vllm/bin/python`, `make vllm-env`, or the gpu extra) runs
  the same episodes on two `VLLMEngine`s on the same weights, `prefix_caching` off and on
  (vLLM's `enable_prefix_caching`), fp32, eager, alternated the same way; its defaults:
  histories 2k/8k/32k, `--heads 2` (head_dim 64, which vLLM's CPU attention takes), results
  `bench/results/long_context_vllm.json`. The reuse side's cache is reset before every
  repeat (turn 1 always prefills the history), as the HF side's kept rows are cleared. vLLM
  also shares the filing's blocks between the episodes of a batch on turn 1 (HF reuse is per
  row), so its first turn is reported per side too.
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
    """The engine of one side: KV reuse across turns off or on."""
    if args.engine == "vllm":
        from rollout_workers.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            enforce_eager=True,
            prefix_caching=reuse,
            dtype="float32",
            max_model_len=args.max_len,
            kv_cache_memory_mb=args.kv_cache_mb,
            max_num_seqs=max(2, args.episodes),
        )
    from rollout_workers.engines.hf_engine import HFEngine

    return HFEngine(model_dir, "cpu", args.threads, prefix_reuse=reuse)


class CachedTokens:
    """Counts, through a vLLM engine's `LLM.generate`, the prompt tokens sent and those vLLM
    served from its prefix cache (`RequestOutput.num_cached_tokens`)."""

    def __init__(self, engine):
        self.prompt = self.cached = 0
        self.generate = engine.llm.generate
        engine.llm.generate = self

    def __call__(self, *args, **kwargs):
        outs = self.generate(*args, **kwargs)
        self.prompt += sum(len(o.prompt_token_ids or ()) for o in outs)
        self.cached += sum(o.num_cached_tokens or 0 for o in outs)
        return outs

    def take(self) -> float:
        """The hit rate (cached / prompt tokens) since the last take; counters restart."""
        rate = self.cached / self.prompt if self.prompt else 0.0
        self.prompt = self.cached = 0
        return rate


def start_cold(engine) -> None:
    """Forget every kept prefix, so the next turn 1 prefills the whole history (HF: the kept
    rows; vLLM: its prefix cache, which must reset or the run stops)."""
    if getattr(engine, "prefix", None) is not None:
        engine.prefix.clear()
    llm = getattr(engine, "llm", None)
    if llm is not None and llm.reset_prefix_cache() is False:
        raise SystemExit("vLLM refused to reset its prefix cache (requests still running?)")


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
    counters = {k: CachedTokens(e) for k, e in engines.items() if getattr(e, "llm", None) is not None}
    for r in range(args.repeats):
        for reuse in (False, True) if r % 2 == 0 else (True, False):
            engine = engines[reuse]
            start_cold(engine)  # every repeat starts cold: turn 1 prefills the history
            runs[reuse].append(run_episodes(engine, doc, question, args))
    for reuse in counters:  # unwrap: the next history wraps again
        del engines[reuse].llm.generate
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
        if reuse in counters:  # vLLM: share of prompt tokens served from its prefix cache
            out["reuse" if reuse else "full"]["prefix_cache_hit_rate"] = counters[reuse].take()
    out["speedup_episode"] = out["full"]["seconds_per_batch"] / out["reuse"]["seconds_per_batch"]
    out["speedup_later_turn"] = out["full"]["later_turn_s"] / out["reuse"]["later_turn_s"]
    out["prompt_tokens_last_turn"] = history + len(question) + (args.turns - 1) * (args.gen + args.obs)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The options; `--histories`, `--heads` and `--out` default per engine (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--model", default=None, help="model dir (default: a tiny Qwen2 built here)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: hf 4, vllm 2 = head_dim 64)")
    p.add_argument("--histories", default=None, help="document tokens, comma-separated (hf 1k-8k, vllm 2k,8k,32k)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--obs", type=int, default=64, help="tokens of each tool observation")
    p.add_argument("--episodes", type=int, default=2, help="episodes per batch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the hf engine")
    p.add_argument("--max-len", type=int, default=None, help="vllm max_model_len (default: the model's positions)")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="vllm KV cache per engine, MiB")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    vllm = args.engine == "vllm"
    args.histories = args.histories or ("2048,8192,32768" if vllm else "1024,2048,4096,8192")
    args.heads = args.heads or (2 if vllm else 4)
    name = "long_context_vllm.json" if vllm else "long_context.json"
    args.out = args.out or str(ROOT / "bench" / "results" / name)
    if args.turns < 2:
        raise SystemExit("--turns must be >= 2: reuse acts from turn 2 on")
    return args


def tiny_model(args, histories: list[int], directory: str) -> str:
    """A tiny random Qwen2 (char tokenizer) with room for the longest episode."""
    from rlbus.model.tiny_model import build_tiny_model

    need = max(histories) + 256 + args.turns * (args.gen + args.obs)
    size = 1 << (need - 1).bit_length()
    return str(
        build_tiny_model(
            Path(directory) / "m",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            max_position_embeddings=size,
        )
    )


def run_sides(args, model_dir: str, histories: list[int]) -> dict:
    """Both engines, every history (the report rewritten after each, so a stopped run keeps
    what it measured); closes the engines (vLLM's processes) before returning."""
    engines = {False: make_engine(args, model_dir, False), True: make_engine(args, model_dir, True)}
    results: dict[str, dict] = {}
    try:
        if args.engine == "vllm":  # vLLM's first call pays one-time costs: not in the first side's figure
            for engine in engines.values():
                engine.generate([[7] * 200], 1, 4, 0.0)
        for h in histories:
            results[str(h)] = r = measure(engines, h, args)
            print(
                f"history {h:>6}: episode {r['full']['seconds_per_episode']:.3f}s -> "
                f"{r['reuse']['seconds_per_episode']:.3f}s (x{r['speedup_episode']:.2f}), later turn "
                f"{r['full']['later_turn_s']:.3f}s -> {r['reuse']['later_turn_s']:.3f}s "
                f"(x{r['speedup_later_turn']:.2f}), tok/s {r['full']['tokens_per_s']:.1f} -> "
                f"{r['reuse']['tokens_per_s']:.1f}",
                flush=True,
            )
            write_report(args, results)
    finally:
        for engine in engines.values():
            if hasattr(engine, "close"):
                engine.close()
    return results


def engine_version(engine: str) -> str:
    if engine == "vllm":
        import vllm

        return f"vllm {vllm.__version__}"
    import torch

    return f"torch {torch.__version__}"


def write_report(args, results: dict) -> None:
    """The JSON report of the histories measured so far, with the growth fit once there are two."""
    done = [int(h) for h in results]
    fit = None
    if len(done) >= 2:
        xs = [float(h) for h in done]
        fit = {side: growth(xs, [results[str(h)][side]["later_turn_s"] for h in done]) for side in ("full", "reuse")}
    model = f"tiny qwen2 hidden {args.hidden}, {args.layers} layers, {args.heads} heads, char tokenizer"
    report = {
        "engine": args.engine,
        "version": engine_version(args.engine),
        "model": args.model or model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model")},
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "histories": results,
        "growth_exponent_later_turn": fit,
        "ids_equal": True,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    histories = [int(x) for x in args.histories.split(",")]
    with tempfile.TemporaryDirectory(prefix="rlbus-long-context-") as d:
        model_dir = args.model or tiny_model(args, histories, d)
        run_sides(args, model_dir, histories)
    fit = json.loads(Path(args.out).read_text())["growth_exponent_later_turn"]
    if fit:
        print(f"growth exponent of time per later turn vs history: full {fit['full']:.2f}, reuse {fit['reuse']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
