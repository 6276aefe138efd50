"""Learner at real sizes: tokens/s and peak RSS, ours (1 and 2 ranks) vs TRL GRPOTrainer, one run.

`python bench/learner_scale.py` (`--quick`, `--sizes`, `--steps`; about 10 minutes on a quiet
2-core machine, 24 at load 7-15).

- Models: Qwen2-shaped, random init, the BPE tokenizer rlbus ships (vocab 2 048), head_dim
  64: `10m` (hidden 256, 9 layers), `50m` (512, 12), `150m` (768, 16); `tiny` for tests.
- Batch per size: G completions per group of mixed lengths spread evenly over 64..512
  tokens (shuffled), prompts of 16..48 tokens shared within a group, synthetic token ids
  (generation is excluded on both sides), binary rewards with both values in every group,
  behaviour log-probs -ln(vocab) (a random-init model's are close, so ratios stay near 1).
  It is written once to a file that every side reads: the SAME batch on both sides.
- Sides (`bench/scale_sides.py`), each its own process, so each side's peak RSS
  (`ru_maxrss`) is its own: ours at 1 rank (`learner.step.train_step`, the whole thread
  budget); ours at 2 ranks (FSDP2 `learner.distributed.shard_model`, gloo, 2 processes,
  1 thread each: the same budget; RSS summed over both ranks); TRL `GRPOTrainer.training_step`
  (+ clip, AdamW step, scheduler step, zero_grad) on the same samples, left-padded prompts
  and right-padded completions, one training_step for the batch, as
  `bench/learner_vs_trl.py` does. The sides of a size take their timed steps in
  alternating rounds (ours, TRL, ours, ...) so load hits all alike; ours at 2 ranks runs in
  the same rounds when the memory estimate fits in half the free memory, else in a second
  phase against the same, still-running TRL process (its row uses TRL's steps of that phase).
- Every side gets the same environment, `OMP_WAIT_POLICY=PASSIVE` included (`--omp-wait-policy`;
  libgomp's default spinning threads burn 3-5x the CPU of the work on a loaded machine).
- tokens = real prompt + completion tokens of the batch; tokens/s = tokens / median step.
  Also `ratio_cpu_s` (process CPU seconds per step, TRL / ours), which load moves less.
  `padding_fraction` = padded positions / all positions run (ours: its micro-batches; TRL:
  its one padded batch, `trl_padding_fraction`).
- Ours runs with `learner.micro_batch_tokens` = `--micro-batch-tokens` (default 768):
  with the default 0 the batch is one micro-batch padded to its longest sample (40 %
  padding on 64..512 mixed lengths; `padding_fraction_default_config` in the JSON).

Writes bench/results/learner_scale.json (`--out`): `rows` (one per size and rank count),
`ratio_geomean` (1-rank rows; target >= 1.0, none < 0.9) and memory targets (<= 1.1x).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "learner_scale.json"
SIDES = ROOT / "bench" / "scale_sides.py"
# name -> (hidden, layers, heads); head_dim 64
SIZES = {"tiny": (64, 2, 1), "10m": (256, 9, 4), "50m": (512, 12, 8), "150m": (768, 16, 12)}
# name -> (groups, group size, timed steps per side, full-batch warm-up steps)
PLANS = {"tiny": (2, 4, 2, 1), "10m": (4, 4, 5, 1), "50m": (3, 4, 3, 1), "150m": (2, 4, 2, 1)}
QUICK = {"tiny": (2, 4, 1, 0), "10m": (2, 4, 1, 0), "50m": (2, 4, 1, 0), "150m": (2, 4, 1, 0)}
LENGTHS, PROMPT = (64, 512), (16, 48)


def build_model(size: str, out: Path) -> tuple[Path, dict]:
    """The size's Qwen2-shaped model (BPE tokenizer, random init) and its rlbus_model.json."""
    from rlbus.model.tiny_model import build_tiny_model

    hidden, layers, heads = SIZES[size]
    model_dir = build_tiny_model(
        out,
        arch="qwen2",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=1024,
        seed=0,
        tokenizer="bpe",
    )
    return model_dir, json.loads((model_dir / "rlbus_model.json").read_text())


def make_batch(n_groups: int, group: int, vocab: int, seed: int = 0) -> dict:
    """Group-structured synthetic batch: completion lengths spread evenly over LENGTHS, shuffled."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = n_groups * group
    lengths = np.linspace(*LENGTHS, n).round().astype(int)
    rng.shuffle(lengths)
    prompts, comps, rewards, groups = [], [], [], []
    for g in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(PROMPT[0], PROMPT[1] + 1))).tolist()
        r = rng.integers(0, 2, size=group)
        r[0], r[1] = 1, 0  # both values in every group: non-zero advantages
        for k in range(group):
            prompts.append(prompt)
            comps.append(rng.integers(3, vocab, size=int(lengths[g * group + k])).tolist())
            rewards.append(float(r[k]))
            groups.append(g)
    return {
        "prompts": prompts,
        "completions": comps,
        "rewards": rewards,
        "groups": groups,
        "group_size": group,
        "behavior_logp": -math.log(vocab),
    }


def padding_stats(spec: dict, micro_batch_tokens: int, micro_batch_size: int) -> dict:
    """Tokens of the batch; padding of TRL's padded batch and of ours with the default config."""
    from learner.step import padding_fraction, plan_micro_batches

    plens = [len(p) for p in spec["prompts"]]
    clens = [len(c) for c in spec["completions"]]
    tokens = sum(plens) + sum(clens)
    lengths = [p + c for p, c in zip(plens, clens)]
    trl_positions = len(lengths) * (max(plens) + max(clens))
    return {
        "tokens_per_step": tokens,
        "samples_per_step": len(lengths),
        "completion_lengths": {"min": min(clens), "max": max(clens), "mean": round(statistics.mean(clens), 1)},
        "trl_padding_fraction": round(1 - tokens / trl_positions, 4),
        "padding_fraction_default_config": round(padding_fraction(lengths, plan_micro_batches(lengths, 0, 0)), 4),
        "planned_padding_fraction": round(
            padding_fraction(lengths, plan_micro_batches(lengths, micro_batch_tokens, micro_batch_size)), 4
        ),
    }


class Child:
    """A side's process, spoken to in `@@`-prefixed JSON lines (see bench/scale_sides.py)."""

    def __init__(self, argv: list[str], env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(SIDES), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
            cwd=ROOT,
        )

    def recv(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"side {self.proc.args[2:4]} exited ({self.proc.wait()}):\n{tail}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


class Side:
    """One measured side: one process, or one per rank (all get every command)."""

    def __init__(self, name: str, kind: str, world: int, common: list[str], threads: int, tmp: Path, omp_wait: str):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        if omp_wait:
            env["OMP_WAIT_POLICY"] = omp_wait
        self.name, self.world, self.children = name, world, []
        port = free_port()
        for rank in range(world):
            renv = (
                env
                if world == 1
                else {
                    **env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            )
            self.children.append(Child([kind, *common, "--threads", str(threads)], renv, tmp / f"{name}.{rank}.log"))
        self.loaded = [c.recv() for c in self.children]
        self.ready = [c.recv() for c in self.children]
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.padding: list[float] = []

    def run(self, steps: int) -> None:
        for c in self.children:
            c.send(f"run {steps}")
        replies = [c.recv() for c in self.children]
        self.times += [max(ts) for ts in zip(*(r["times"] for r in replies))]  # a step ends when every rank is done
        self.cpu += [sum(cs) for cs in zip(*(r["cpu"] for r in replies))]
        self.padding += [statistics.mean(ps) for ps in zip(*(r["padding"] for r in replies)) if None not in ps]

    def kill(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.kill()

    def close(self) -> dict:
        for c in self.children:
            c.send("quit")
        ends = [c.recv() for c in self.children]
        for c in self.children:
            c.proc.wait(timeout=60)
        return {
            "peak_rss_mb": round(sum(e["peak_rss_mb"] for e in ends), 1),
            "baseline_rss_mb": round(sum(x["baseline_rss_mb"] for x in self.loaded), 1),
            "ready_rss_mb": round(sum(x["rss_mb"] for x in self.ready), 1),
            "threads": [x["threads"] for x in self.loaded],
            "params": self.loaded[0]["params"],
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(size: str, a, tmp: Path) -> dict:
    """Build the size's model and batch file; the context every row of the size shares."""
    n_groups, group, steps, warmup = (QUICK if a.quick else PLANS)[size]
    model_dir, meta = build_model(size, tmp / size)
    spec = make_batch(n_groups, group, meta["vocab_size"])
    batch_file = tmp / f"{size}.batch.json"
    batch_file.write_text(json.dumps(spec))
    pads = padding_stats(spec, a.micro_batch_tokens, a.micro_batch_size)
    print(
        f"{size}: {meta['params'] / 1e6:.2f}M params (hidden {meta['hidden_size']}, {meta['num_layers']} layers, "
        f"{meta['num_heads']} heads), {pads['samples_per_step']} samples, {pads['tokens_per_step']} tokens/step",
        flush=True,
    )
    common = [
        "--model",
        str(model_dir),
        "--batch",
        str(batch_file),
        "--lr",
        str(a.lr),
        "--warmup",
        str(warmup),
        "--micro-batch-tokens",
        str(a.micro_batch_tokens),
        "--micro-batch-size",
        str(a.micro_batch_size),
    ]
    return {
        "common": common,
        "meta": meta,
        "steps": a.steps or steps,
        "warmup": warmup,
        "pads": pads,
        "trl_positions": pads["samples_per_step"] * (PROMPT[1] + LENGTHS[1]),
    }


def estimated_peak_gb(meta: dict, positions: int, world: int = 1) -> float:
    """Rough peak RSS of a side (sum over ranks): imports + fp32 weights, grads and AdamW
    state (sharded over ranks; a full copy at load and unsharded grads per rank) + activations."""
    p, act = meta["params"] * 4 / 2**30, positions * meta["num_layers"] * 40 * meta["hidden_size"] * 4 / 2**30
    return world * 0.35 + 4 * p + (world - 1) * 2 * p + world * act


def cpu_pressure() -> float | None:
    """Share of the last 60 s some task waited for a CPU (/proc/pressure/cpu `some avg60`, %)."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[2].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def mem_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def run_rounds(sides: dict, steps: int) -> None:
    """`steps` rounds, one step per side per round, in order: load hits every side alike."""
    for _ in range(steps):
        for side in sides.values():
            side.run(1)


def measure_size(size: str, a, tmp: Path) -> list[dict]:
    """Every side of one size, alternating rounds; one row per rank count. Ours at N ranks
    runs alongside ours at 1 rank and TRL when the estimate fits in half the free memory,
    else in a second phase against the same (still-running) TRL process."""
    ctx = prepare(size, a, tmp)
    meta, common, steps, worlds = ctx["meta"], ctx["common"], ctx["steps"], [w for w in a.ranks if w > 1]
    mbt = a.micro_batch_tokens or ctx["trl_positions"]
    need = (
        estimated_peak_gb(meta, ctx["trl_positions"])
        + estimated_peak_gb(meta, mbt)
        + sum(estimated_peak_gb(meta, mbt, w) for w in worlds)
    )
    together = need < 0.5 * mem_available_gb()
    load0, psi0, t0, sides = os.getloadavg(), cpu_pressure(), time.perf_counter(), {}
    try:
        sides["ours"] = Side("ours", "ours", 1, common, a.threads, tmp, a.omp_wait_policy)
        sides["trl"] = Side("trl", "trl", 1, common, a.threads, tmp, a.omp_wait_policy)
        for w in worlds if together else []:
            sides[f"ours{w}"] = Side(f"ours{w}", "sharded", w, common, max(1, a.threads // w), tmp, a.omp_wait_policy)
        run_rounds(sides, steps)
        ends, trl_steps = {"ours": sides["ours"].close()}, {1: (0, steps)}
        for w in worlds if not together else []:
            n0 = len(sides["trl"].times)
            sides[f"ours{w}"] = Side(f"ours{w}", "sharded", w, common, max(1, a.threads // w), tmp, a.omp_wait_policy)
            run_rounds({"trl": sides["trl"], f"ours{w}": sides[f"ours{w}"]}, steps)
            ends[f"ours{w}"] = sides[f"ours{w}"].close()
            trl_steps[w] = (n0, n0 + steps)
        ends.update({k: s.close() for k, s in sides.items() if k not in ends})
    finally:
        for s in sides.values():
            s.kill()
    shared = {
        "size": size,
        "hidden_size": meta["hidden_size"],
        "num_layers": meta["num_layers"],
        "num_heads": meta["num_heads"],
        "vocab_size": meta["vocab_size"],
        "steps_timed_per_side": steps,
        "warmup_full_steps": ctx["warmup"],
        "ranks_alongside_1_rank": together,
        "load_avg_start": [round(x, 2) for x in load0],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "cpu_pressure_avg60_start": psi0,
        "cpu_pressure_avg60_end": cpu_pressure(),
        "wall_s": round(time.perf_counter() - t0, 1),
        **ctx["pads"],
    }
    trl = sides["trl"]
    return [
        make_row(shared, meta, w, sides[name], ends[name], trl, ends["trl"], trl_steps.get(w, (0, steps)), a.threads)
        for w, name in [(1, "ours"), *((w, f"ours{w}") for w in worlds)]
    ]


def make_row(
    ctx: dict, meta: dict, world: int, ours, ours_end: dict, trl, trl_end: dict, trl_span: tuple, threads: int
) -> dict:
    tokens = ctx["tokens_per_step"]
    trl_times, trl_cpu = trl.times[slice(*trl_span)], trl.cpu[slice(*trl_span)]
    med_o, med_t = statistics.median(ours.times), statistics.median(trl_times)
    step_s = lambda ts: {
        "median": round(statistics.median(ts), 3),
        "min": round(min(ts), 3),
        "all": [round(t, 3) for t in ts],
    }
    return {
        "params": meta["params"],
        "world_size": world,
        "ours_tok_s": round(tokens / med_o, 1),
        "trl_tok_s": round(tokens / med_t, 1),
        "ratio": round(med_t / med_o, 3),
        "ratio_of_min_steps": round(min(trl_times) / min(ours.times), 3),
        "ratio_cpu_s": round(statistics.median(trl_cpu) / statistics.median(ours.cpu), 3),
        "ours_peak_rss_mb": ours_end["peak_rss_mb"],
        "trl_peak_rss_mb": trl_end["peak_rss_mb"],
        "mem_ratio": round(ours_end["peak_rss_mb"] / trl_end["peak_rss_mb"], 3),
        "padding_fraction": round(statistics.mean(ours.padding), 4),
        "ours_step_s": step_s(ours.times),
        "trl_step_s": step_s(trl_times),
        "ours_cpu_s": step_s(ours.cpu),
        "trl_cpu_s": step_s(trl_cpu),
        "ours_baseline_rss_mb": ours_end["baseline_rss_mb"],
        "trl_baseline_rss_mb": trl_end["baseline_rss_mb"],
        "threads": {"budget": threads, "ours_per_rank": ours_end["threads"], "trl": trl_end["threads"]},
        **ctx,
    }


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(rows: list[dict], a, wall: float) -> dict:
    from importlib.metadata import version

    import torch

    one = [r for r in rows if r["world_size"] == 1]
    ratio = geomean([r["ratio"] for r in one])
    return {
        "name": "learner_scale",
        "unit": "tokens/s per optimizer step (prompt+completion tokens, generation excluded)",
        "ratio_geomean": round(ratio, 3),
        "ratio_min": min(r["ratio"] for r in one),
        "ratio_geomean_by_world_size": {
            str(w): round(geomean([r["ratio"] for r in rows if r["world_size"] == w]), 3)
            for w in sorted({r["world_size"] for r in rows})
        },
        "mem_ratio_max": max(r["mem_ratio"] for r in one),
        "targets": {"ratio_geomean": 1.0, "ratio_min": 0.9, "mem_ratio_max": 1.1, "padding_fraction_max": 0.10},
        "targets_met": {
            "ratio_geomean": ratio >= 1.0,
            "ratio_min": min(r["ratio"] for r in one) >= 0.9,
            "mem_ratio_max": max(r["mem_ratio"] for r in one) <= 1.1,
            "padding_fraction_max": max(r["padding_fraction"] for r in rows) <= 0.10,
        },
        "targets_note": "ratio and memory targets on the 1-rank rows (one process each side); 2-rank rows sum both ranks' RSS",
        "command": " ".join(["python bench/learner_scale.py", *sys.argv[1:]]),
        "rows": rows,
        "settings": {
            "threads": a.threads,
            "omp_wait_policy": a.omp_wait_policy,
            "micro_batch_tokens": a.micro_batch_tokens,
            "micro_batch_size": a.micro_batch_size,
            "lr": a.lr,
            "quick": a.quick,
            "beta": 0.0,
            "loss": "grpo (token-level clipped ratio, eps 0.2/0.28)",
            "optimizer": "AdamW, clip 1.0",
            "dtype": "fp32",
            "completion_lengths": list(LENGTHS),
            "prompt_lengths": list(PROMPT),
        },
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "trl": version("trl"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(wall, 1),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(result: dict) -> None:
    head = (
        f"{'size':>6} {'params':>8} {'ranks':>5} {'ours tok/s':>10} {'TRL tok/s':>10} {'ratio':>6} "
        f"{'ours MiB':>9} {'TRL MiB':>8} {'mem':>5} {'pad':>6} {'TRL pad':>7} {'steps':>5} {'load':>5}"
    )
    print(head)
    for r in result["rows"]:
        print(
            f"{r['size']:>6} {r['params'] / 1e6:>7.1f}M {r['world_size']:>5} {r['ours_tok_s']:>10.1f} "
            f"{r['trl_tok_s']:>10.1f} {r['ratio']:>6.3f} {r['ours_peak_rss_mb']:>9.0f} {r['trl_peak_rss_mb']:>8.0f} "
            f"{r['mem_ratio']:>5.2f} {r['padding_fraction']:>6.3f} {r['trl_padding_fraction']:>7.3f} "
            f"{r['steps_timed_per_side']:>5} {r['load_avg_start'][0]:>5.2f}"
        )
    print(
        f"tokens/s ratio ours/TRL: geometric mean {result['ratio_geomean']} (1 rank; target >= 1.0), "
        f"min {result['ratio_min']} (>= 0.9); peak RSS ratio max {result['mem_ratio_max']} (<= 1.1)"
    )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10m,50m,150m", help=f"comma-separated, of {','.join(SIZES)}")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per side (0: per-size default)")
    ap.add_argument("--ranks", default="1,2", help="rank counts for ours (1 is always run)")
    ap.add_argument("--threads", type=int, default=2, help="torch thread budget per side (split over ranks)")
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=768,
        help="ours: learner.micro_batch_tokens (0 = the default config: one padded micro-batch)",
    )
    ap.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY for every side ('' = libgomp's default, spinning threads)",
    )
    ap.add_argument("--micro-batch-size", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--quick", action="store_true", help="small batches, 1 timed step, no full warm-up")
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args(argv)
    a.ranks = sorted({1, *(int(x) for x in a.ranks.split(","))})
    return a


def main(argv=None) -> dict:
    from bench import skip_unless

    skip_unless(__file__, modules=("trl", "datasets"), hint="pip install -e '.[bench]'")
    a = parse_args(argv)
    t0, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-scale-") as d:
        for size in a.sizes.split(","):
            rows += measure_size(size, a, Path(d))
    result = summarize(rows, a, time.perf_counter() - t0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {a.out} in {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
