"""vLLM speed tiers: `fast` (fp8 + n-gram speculative decoding) vs `standard`, same weights (GPU).

What it measures (`python bench/vllm_tiers.py [--model DIR] [--margin 0.02]`, needs a
CUDA GPU and vLLM; a few minutes):

- One model directory (default: the demo's tiny qwen2 built and SFT-warmed here for
  `--sft-seconds`; pass `--model` for a real checkpoint) is loaded into a
  `VLLMEngine` per tier, one tier at a time (the previous engine is deleted and the
  GPU cache emptied first).
- EVAL SET: arith held-out problems (`producers.domains.arith.heldout_set(1234, n, 3)`),
  greedy (temperature 0), `--max-tokens` new tokens.
- SPEED: generated tokens/s of a sampling workload (every held-out prompt, G=8 samples,
  temperature 1) after one warm-up call, median of `--repeats` calls; plus the greedy
  eval's own time.
- ACCURACY: greedy accuracy per tier; the fast tier passes when its accuracy is within
  `--margin` (absolute) of standard's.

Writes bench/results/vllm_tiers.json: `ours` = fast tokens/s, `peer` = standard
tokens/s, `ratio` = speed gain, and `accuracy_delta` with the margin and pass flag.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "vllm_tiers.json"


def measure_tier(model_dir: Path, tier: str, problems, max_tokens: int, group: int, repeats: int) -> dict:
    """Throughput and greedy accuracy of one tier on `problems` (an arith `EvalSet`)."""
    import torch

    from rollout_workers.engines.vllm_engine import VLLMEngine
    from scheduler.evaluation import greedy_accuracy

    t0 = time.perf_counter()
    engine = VLLMEngine(str(model_dir), tier, gpu_memory_utilization=0.3, max_model_len=64)
    startup = time.perf_counter() - t0
    prompts = [it.task.prompt[0].content for it in problems.items]
    engine.generate(prompts[:8], group, max_tokens, 1.0)  # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.generate(prompts, group, max_tokens, 1.0)
        dt = time.perf_counter() - t
        rates.append(sum(len(s.token_ids) for g in out for s in g) / dt)
    t = time.perf_counter()
    acc = greedy_accuracy(engine, problems, batch=len(problems))
    eval_s = time.perf_counter() - t
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_all": [round(r, 1) for r in rates],
        "greedy_accuracy": acc,
        "greedy_eval_s": round(eval_s, 3),
        "startup_s": round(startup, 1),
    }


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model dir (default: build + SFT the demo's tiny model)")
    ap.add_argument("--sft-seconds", type=float, default=60.0)
    ap.add_argument("--n", type=int, default=500, help="held-out problems")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--margin", type=float, default=0.02, help="allowed absolute accuracy drop of the fast tier")
    ap.add_argument("--tiers", default="standard,fast")
    a = ap.parse_args()
    from bench import skip_unless

    skip_unless(__file__, modules=("vllm",), cuda=True)
    from importlib.metadata import version

    import torch

    from producers.domains import arith

    problems = arith.fixed_eval_set(1234, a.n, 3, max_tokens=a.max_tokens)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-tiers-") as d:
        model_dir = Path(a.model) if a.model else None
        sft = None
        if model_dir is None:
            from bench.e2e_shared import prepare_start

            model_dir, sft = prepare_start(Path(d), a.sft_seconds, 100_000, a.n)
        tiers = {t: measure_tier(model_dir, t, problems, a.max_tokens, a.group, a.repeats) for t in a.tiers.split(",")}
    std, fast = tiers["standard"], tiers.get("fast") or tiers[a.tiers.split(",")[-1]]
    delta = fast["greedy_accuracy"] - std["greedy_accuracy"]
    result = {
        "name": "vllm_tiers",
        "ours": round(fast["tokens_per_s"], 1),
        "peer": round(std["tokens_per_s"], 1),
        "unit": "generated tokens/s (fast tier vs standard tier, same weights)",
        "ratio": round(fast["tokens_per_s"] / std["tokens_per_s"], 3),
        "accuracy_delta": round(delta, 4),
        "accuracy_margin": a.margin,
        "accuracy_within_margin": delta >= -a.margin,
        "tiers": tiers,
        "command": "python bench/vllm_tiers.py" + (f" --model {a.model}" if a.model else ""),
        "settings": {
            "n": a.n,
            "max_tokens": a.max_tokens,
            "group": a.group,
            "repeats": a.repeats,
            "model": a.model or "tiny qwen2 (demo) + SFT",
            "sft": sft,
        },
        "gpu": torch.cuda.get_device_name(0),
        "vllm": version("vllm"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ours", "peer", "ratio", "accuracy_delta", "accuracy_within_margin")}))
    return result


if __name__ == "__main__":
    main()
