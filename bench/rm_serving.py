"""Reward-model serving benchmark: the verifier worker's `model` verifier, unbatched vs batched.

What it measures (`python bench/rm_serving.py`, under a minute on 2 cores with the defaults):

- One reward model: `--model DIR` (an `rlbus train-rm` export), else a tiny Qwen2 (hidden
  `--hidden`, `--layers`) turned into a one-label classifier by `learner.rm` and exported,
  as `rlbus train-rm` writes it.
- `--trajectories` trajectories with answers of 4..`--max-words` words (a rollout's spread), all
  handed at once to the verifier worker's real `Scorer` (`verifier_workers.worker`), as
  the worker hands the trajectories it holds (`verifier.batch`) to its verifiers: every
  one through `Scorer._score`, which composes the real Reward.
- UNBATCHED: `verifier.rm.batch_size = 1`, the per-trajectory path: `verifier.concurrency`
  threads (`--concurrency`, default 4, the config default), one forward per trajectory.
- BATCHED: `verifier.rm.batch_size = --batch-size` (default 32), `batch_timeout_s`
  0.01: `RmBatcher`, one forward per batch in the same thread pool (`max_padding = 1`).
- BATCHED_BUCKETS: the same with `verifier.rm.max_padding = --max-padding` (0.25): each
  batch sorted by length and cut where a forward would pad more than that.
- Same process, same model, same trajectories, both after one warm-up pass; the sides
  alternate `--repeats` times (so both see the same machine load), the median
  throughput (trajectories / s) of each is reported, with the load average. The batched
  rewards are checked against the unbatched ones (max abs difference reported; a
  difference above 1e-4 fails the run).
- Results: `bench/results/rm_serving.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_rm(root: Path, hidden: int, layers: int) -> Path:
    """A tiny one-label classifier exported as `rlbus train-rm` exports one."""
    from learner.rm import export, load_reward_model
    from rlbus.model.tiny_model import build_tiny_model

    base = build_tiny_model(root / "base", hidden_size=hidden, num_layers=layers, num_heads=4, tokenizer="bpe")
    model, tok = load_reward_model(base)
    return export(model, tok, root / "rm")


def trajectories(model_dir: Path, n: int, max_words: int = 124) -> list:
    from schemas import Trajectory

    words = "the answer is forty two because six times seven".split()
    out = []
    for i in range(n):
        text = " ".join(words[(i + k) % len(words)] for k in range(4 + (i * 37) % max(1, max_words - 3)))
        out.append(
            Trajectory(
                run_id="bench",
                task_id=f"t{i // 8}",
                task_msg_id=f"m{i // 8}",
                domain="judge",
                group_id=f"g{i // 8}",
                group_size=8,
                sample_index=i % 8,
                turns=[],
                verifier="model",
                verifier_params={"model_path": str(model_dir), "question": f"What is 6 x 7? (#{i})"},
                policy_version=0,
                final_text=text,
            )
        )
    return out


def run_side(
    trajs: list, batch_size: int, concurrency: int, max_padding: float = 1.0
) -> tuple[float, list[float], int]:
    """(seconds, rewards, batcher calls) of scoring every trajectory at once through a Scorer."""
    from schemas.config import VerifierSection
    from verifier_workers.worker import RetryPolicy, Scorer

    async def go():
        rm = {"batch_size": batch_size, "batch_timeout_s": 0.01, "max_padding": max_padding}
        vc = VerifierSection(concurrency=concurrency, rm=rm)
        s = Scorer(None, RetryPolicy(max_deliver=3), concurrency, limits=vc)
        t0 = time.perf_counter()
        rewards = await asyncio.gather(*(s._score(t, None) for t in trajs))
        seconds = time.perf_counter() - t0
        s.executor.shutdown()
        return seconds, [r.reward for r in rewards], (s.batcher.batches if s.batching else len(trajs))

    return asyncio.run(go())


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="an exported reward model (default: build a tiny one)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--trajectories", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-words", type=int, default=124, help="answers are 4..this many words")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-padding", type=float, default=0.25, help="the bucketed side's verifier.rm.max_padding")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench/results/rm_serving.json"))
    return p.parse_args(argv)


def measure(trajs: list, args: argparse.Namespace) -> dict:
    """Every side after a warm-up, interleaved `repeats` times: {side: figures and rewards}."""
    plan = (
        ("unbatched", 1, 1.0),
        ("batched", args.batch_size, 1.0),
        ("batched_buckets", args.batch_size, args.max_padding),
    )
    for _, bs, mp in plan:  # warm-up: load the model, first forwards
        run_side(trajs[:8], bs, args.concurrency, mp)
    runs: dict[str, list] = {name: [] for name, _, _ in plan}
    for _ in range(args.repeats):  # interleaved: every side sees the same machine load
        for name, bs, mp in plan:
            runs[name].append(run_side(trajs, bs, args.concurrency, mp))
    sides = {}
    for name, bs, mp in plan:
        secs = [r[0] for r in runs[name]]
        sides[name] = {
            "batch_size": bs,
            "max_padding": mp,
            "seconds_median": statistics.median(secs),
            "trajectories_per_s": len(trajs) / statistics.median(secs),
            "seconds_all": secs,
            "calls": runs[name][0][2],
            "rewards": runs[name][0][1],
        }
    return sides


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_rm(Path(tmp), args.hidden, args.layers)
        sides = measure(trajectories(model_dir, args.trajectories, args.max_words), args)
    base = sides["unbatched"]["rewards"]
    diff = max(abs(a - b) for side in ("batched", "batched_buckets") for a, b in zip(base, sides[side]["rewards"]))
    rate = {k: v["trajectories_per_s"] for k, v in sides.items()}
    result = {
        "trajectories": args.trajectories,
        "answer_words": [4, args.max_words],
        "concurrency": args.concurrency,
        "threads": args.threads,
        "loadavg_1m_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "model": args.model or f"tiny qwen2 classifier, hidden {args.hidden}, {args.layers} layers (bpe)",
        "max_abs_reward_diff": diff,
        "speedup": rate["batched"] / rate["unbatched"],
        "speedup_buckets": rate["batched_buckets"] / rate["unbatched"],
        **{k: {kk: vv for kk, vv in v.items() if kk != "rewards"} for k, v in sides.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if diff > 1e-4:
        print(f"FAIL: batched rewards differ from unbatched by {diff}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
