"""Per-answer cost of the answer pool: reasoning-gym scoring in a pool job vs in-process, one run.

`python bench/answer_pool.py [--n 200]`: for each of a few datasets (bare-eval and sympy
ones among them), the same drawn entries' gold and wrong answers are scored (1) in this
process by the dataset's own `score_answer` (what the verifier did before issue 27) and
(2) through `verify_reasoning_gym` (every call in an `answer_pool` job: template fork, limits,
JSON back), interleaved so machine load hits both alike. Reports p50 / p99 ms per answer
of each and the template's start-up once. Writes bench/results/answer_pool.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "answer_pool.json"
DATASETS = ["string_insertion", "spiral_matrix", "countdown", "polynomial_multiplication", "chain_sum"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="answers scored each way")
    args = ap.parse_args(argv)
    from producers.domains import make_sources
    from schemas import Trajectory, Turn
    from schemas import rg_family as rg
    from schemas.config import load_config
    from verifier_workers import answer_pool
    from verifier_workers.verifiers.reasoning_gym import verify_reasoning_gym

    cfg = load_config(None, ["sampler.domain_sets.reasoning_gym.include=" + json.dumps(DATASETS)])
    sources, _ = make_sources("bench", cfg)
    entries = [src.make_task(random.Random(0), 1, i) for src in sources.values() for i in range(8)]
    t0 = time.perf_counter()
    answer_pool.call("os:getpid")
    startup = time.perf_counter() - t0
    inproc, pooled = [], []
    for k in range(args.n):
        d = entries[k % len(entries)]
        answer = d.hidden["answer"] if k % 2 == 0 else "surely not it"
        entry = {
            "question": d.hidden["question"],
            "answer": rg.unpack(d.hidden["answer"]),
            "metadata": rg.unpack(d.hidden["metadata"]),
        }
        ds = rg.build(d.hidden["dataset"], 1, "inclusive", {}, seed=0, size=1)
        t = time.perf_counter()
        ds.score_answer(answer, entry)
        inproc.append(time.perf_counter() - t)
        traj = Trajectory.from_task(d.task, 0, [Turn(role="assistant", text=f"<answer>{answer}</answer>")])
        t = time.perf_counter()
        verify_reasoning_gym(traj, d.hidden)
        pooled.append(time.perf_counter() - t)
    result = {
        "n": args.n,
        "datasets": DATASETS,
        "template_start_s": round(startup, 2),
        "isolation": answer_pool.pool().isolation,
        "in_process_ms": {
            "p50": round(pct(inproc, 0.5), 3),
            "p99": round(pct(inproc, 0.99), 3),
            "mean": round(statistics.mean(inproc) * 1000, 3),
        },
        "pool_ms": {
            "p50": round(pct(pooled, 0.5), 2),
            "p99": round(pct(pooled, 0.99), 2),
            "mean": round(statistics.mean(pooled) * 1000, 2),
        },
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 1) for x in os.getloadavg()],
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
