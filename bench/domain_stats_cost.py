"""What the per-domain machinery costs per step at 10 and at 100 domains (a benchmark, not a test).

Measured in one run, side by side for K = 10 and K = 100 domains (`python bench/domain_stats_cost.py`):

- `pcgrad`: combining K per-domain gradients of the demo-sized tiny model (`rlbus.model.tiny_model`
  defaults) with `learner.pcgrad.pcgrad` (Gram-matrix form), next to the textbook loop it
  replaced (K(K-1) sequential dot products and updates over the parameters; its result is
  checked equal), ms per call.
- `train_step`: one learner step (`learner.step.train_step`, GRPO, fp32, CPU) on the same
  batch (100 groups x 2 samples, groups spread round-robin over the K domains), with
  `learner.pcgrad` on and off, ms per step (median of a few).
- `curriculum`: `Curriculum.weights()` (softmax + water-filling) and the KV value
  (`scheduler.curriculum_service.kv_value`, JSON) at K domains with 6 levels each: ms per
  publish and bytes.
- `domain_stats`: `scheduler.domain_stats.domain_stats` (the per-domain reward statistics SQL) over
  20 000 training rewards spread over K domains in a SQLite store, ms per call.

Writes bench/results/domain_stats_cost.json. The machine may be shared: figures are medians.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

RESULT = ROOT / "bench" / "results" / "domain_stats_cost.json"
KS = (10, 100)


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


def pcgrad_loop(flat: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The textbook PCGrad loop (Yu et al. 2020, Algorithm 1, fixed order): the reference."""
    sq = [float(torch.dot(g, g)) for g in flat]
    total, n = torch.zeros_like(flat[0]), 0
    for i, g in enumerate(flat):
        gi = g.clone()
        for j, gj in enumerate(flat):
            if j != i and sq[j] > 0:
                dot = torch.dot(gi, gj)
                if float(dot) < 0:
                    gi, n = gi - (dot / sq[j]) * gj, n + 1
        total = total + gi
    return total, n


def bench_pcgrad(n_params: int) -> dict:
    from learner.pcgrad import pcgrad

    out = {}
    gen = torch.Generator().manual_seed(0)
    for k in KS:
        # a shared direction, followed or opposed (half the pairs conflict), plus noise
        shared = torch.randn(n_params, generator=gen)
        flat = [(0.3 if i % 2 else -0.3) * shared + torch.randn(n_params, generator=gen) for i in range(k)]
        new, n_new = pcgrad(flat)
        old, n_old = pcgrad_loop(flat)
        out[str(k)] = {
            "gram_ms": median_ms(lambda f=flat: pcgrad(f), 3),
            "loop_ms": median_ms(lambda f=flat: pcgrad_loop(f), 1 if k > 10 else 3),
            "conflicts": n_new,
            "same_conflicts_as_loop": n_new == n_old,
            "max_rel_diff_vs_loop": round(float((new - old).abs().max() / old.abs().max()), 8),
        }
    return out


def batch_over(k: int, n_groups: int = 100, size: int = 2) -> list:
    from learner.groups import PooledSample
    from schemas import Reward, Trajectory, Turn, pack_f32, pack_i32

    rng, out = random.Random(0), []
    for g in range(n_groups):
        prompt = [rng.randrange(4, 90) for _ in range(rng.randrange(4, 12))]
        for i in range(size):
            comp = [rng.randrange(4, 90) for _ in range(rng.randrange(2, 12))]
            traj = Trajectory(
                run_id="b",
                task_id=f"t{g}",
                task_msg_id=f"tm{g}",
                domain=f"d{g % k:03d}",
                group_id=f"g{g}",
                group_size=size,
                sample_index=i,
                verifier="arith",
                policy_version=0,
                turns=[
                    Turn(role="prompt", text="p", token_ids=pack_i32(prompt)),
                    Turn(
                        role="assistant",
                        text="c",
                        token_ids=pack_i32(comp),
                        logprobs=pack_f32([-4.5] * len(comp)),
                        trainable=True,
                        policy_version=0,
                    ),
                ],
            )
            out.append(PooledSample(Reward(run_id="b", trajectory=traj, reward=float(rng.random())), raw=None))
    return out


def bench_train_step(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from learner.step import train_step
    from schemas.config import LearnerSection

    out = {}
    for k in KS:
        batch = batch_over(k)
        row = {}
        for pc in (False, True):
            model = AutoModelForCausalLM.from_pretrained(model_dir).train()
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            lc = LearnerSection(pcgrad=pc, micro_batch_size=64)
            metrics = {}

            def step(model=model, opt=opt, lc=lc, batch=batch, metrics=metrics):
                metrics.update(train_step(model, None, opt, batch, 0, lc))

            step()  # warm-up
            row["pcgrad_ms" if pc else "plain_ms"] = median_ms(step, 3)
            if pc:
                row["pcgrad_conflict_frac"] = round(metrics.get("pcgrad_conflict_frac", 0.0), 4)
            row["micro_batches" + ("_pcgrad" if pc else "")] = int(metrics["micro_batches"])
        row["domains_in_batch"] = len({s.reward.trajectory.domain for s in batch})
        row["pcgrad_over_plain"] = round(row["pcgrad_ms"] / row["plain_ms"], 2)
        out[str(k)] = row
    return out


def bench_curriculum() -> dict:
    from scheduler.curriculum import Curriculum, DomainSpec
    from scheduler.curriculum_service import kv_value

    out = {}
    for k in KS:
        names = [f"d{i:03d}" for i in range(k)]
        cur = Curriculum(
            {d: DomainSpec(target_reward=None, levels=(1, 6)) for d in names},
            window=64,
            min_share=0.1 / k,
            max_share=min(1.0, 10.0 / k),
        )
        rng = random.Random(0)
        for _ in range(40 * k):
            d = rng.choice(names)
            cur.observe(d, cur.level(d), [float(rng.random() < 0.5) for _ in range(8)], version=rng.randrange(3))
        out[str(k)] = {
            "weights_ms": median_ms(cur.weights, 20),
            "kv_value_ms": median_ms(lambda c=cur: json.dumps(kv_value(c, 1)), 5),
            "kv_value_bytes": len(json.dumps(kv_value(cur, 1))),
        }
    return out


def bench_domain_stats() -> dict:
    from scheduler.domain_stats import domain_stats
    from scheduler.store import open_store
    from scheduler.store_rows import RewardRow

    out = {}
    for k in KS:
        with tempfile.TemporaryDirectory() as d:
            store = open_store(None, Path(d))
            rng, t0 = random.Random(0), 1_700_000_000.0
            rows = [
                {
                    "msg_id": f"r{i}",
                    "run_id": "b",
                    "domain": f"d{i % k:03d}",
                    "difficulty": 1,
                    "purpose": "train",
                    "reward": float(rng.random() < 0.5),
                    "status": "ok",
                    "policy_version": i // 1000,
                    "task_msg_id": f"t{i // 4}",
                    "created_at": t0 + i * 0.01,
                }
                for i in range(20_000)
            ]
            store.insert_ignore(RewardRow, rows)
            out[str(k)] = {
                "domain_stats_ms": median_ms(lambda s=store: domain_stats(s, "b", 10.0), 5),
                "rows_out": len(domain_stats(store, "b", 10.0)),
                "rewards": len(rows),
            }
            store.close()
    return out


def main() -> dict:
    from rlbus.model.tiny_model import build_tiny_model

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_tiny_model(Path(d) / "m")
        from transformers import AutoModelForCausalLM

        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        result = {
            "name": "domain_stats_cost",
            "command": "python bench/domain_stats_cost.py",
            "domains": list(KS),
            "model_params": n_params,
            "pcgrad": bench_pcgrad(n_params),
            "train_step": bench_train_step(model_dir),
            "curriculum": bench_curriculum(),
            "domain_stats": bench_domain_stats(),
        }
    result.update(
        seconds=round(time.monotonic() - t_start, 1),
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        cpus=os.cpu_count(),
        load_avg=os.getloadavg(),
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k in ("pcgrad", "train_step", "curriculum", "domain_stats")}, indent=1
        )
    )
    print(f"wrote {RESULT.relative_to(ROOT)} in {result['seconds']}s")
    return result


if __name__ == "__main__":
    main()
