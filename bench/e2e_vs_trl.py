"""End-to-end benchmark: accuracy gained in a fixed wall-clock budget, ours vs TRL GRPOTrainer.

What it measures (`python bench/e2e_vs_trl.py [--minutes 4] [--seeds 3]`, about
seeds * 2 * (minutes + 0.5) + 1 min):

- START: the demo's tiny qwen2 (hidden 128, 4 layers, char tokenizer) built with
  `rlbus.model.tiny_model`, then `learner.sft.run_sft` on difficulty-3 arith (held-out problems
  excluded) for a fixed budget (`--sft-seconds`, `--sft-steps`). Both sides start from
  this same checkpoint directory, for every seed.
- EVAL: greedy accuracy on the scheduler's fixed held-out set
  (`producers.domains.arith.heldout_set(1234, --eval-n, 3)`, default 1000 problems, never
  trained on by either side), scored by the same `greedy_accuracy` (HFEngine,
  temperature 0, 6 new tokens) for the start and for every final model.
- OURS: `rlbus up` (a subprocess, embedded NATS, every role its own process) on a
  generated config equal to `examples/demo.toml` where it matters (G=8, 16 groups per
  step, `--lr`, beta 0, temperature 1, 6 tokens, max staleness 4), with `model.path` =
  the start checkpoint, SFT off, `run.seed` = the seed, and `learner.skip_zero_variance`
  on (DAPO's dynamic sampling: groups whose rewards are all equal carry no signal and are
  not trained; `--no-dynamic-sampling` turns it off; TRL has no equivalent). The
  launcher stops the run so that sampling stops `--minutes` after `rlbus up` started
  (set-up included; no drain, so no training happens after the budget beyond the step
  in flight). The final policy is the learner's checkpoint written at stop. In-run
  evaluation is pushed out (`scheduler.eval.every_versions` huge) so it does not steal CPU.
  Weights go through a `file://` store in the bench's temp dir, as on any single
  machine (written once per version, mapped by the rollout worker; removed after each
  run); `--ours-weights nats` sends them through the NATS object store instead.
  `--ours-set KEY=VALUE` overrides any other field (scouting).
- PEER: TRL `GRPOTrainer` in one process with the arith reward function (exact integer
  match, the same as our `arith` verifier), the same hyper-parameters (16 prompts x
  G=8 per step, `--lr` constant, beta 0, loss_type "grpo", clip 0.2/0.28, grad clip 1,
  temperature 1, 6 completion tokens), seed = the seed, `torch` threads = all CPUs; a
  callback stops training once `--minutes` have passed since the trainer was constructed.
- CURVES (`--curve 30,60,...`): each side's policy as it stood at those seconds into its
  budget is evaluated after the run, the same way as the final one (ours: the newest
  version the learner had logged by then, every version kept for the run; TRL: a copy of
  the weights taken after the last optimizer step that ended before the mark). Written
  per run as `ours_curve` / `peer_curve` and plotted next to the JSON (`.png`). They show
  whether a budget ends on a plateau, where the ratio measures noise, or on a slope.
  `curve_mean_gain` averages each run's curve points (marks and end) minus the start:
  a time-averaged gain, less at the mercy of one checkpoint than the end point.
- Figures: per seed, final accuracy - start accuracy (points, as fractions); `ours` and
  `peer` are the means over seeds, `ratio` = ours/peer (design target >= 1.0), and
  `gains_per_seed` keeps every run. Samples trained and steps are recorded per run.

The machine may be shared with other processes: the two sides run one after the other,
alternating which goes first (ours first for even seeds, TRL first for odd ones; `order` per
run), so load drifting during a seed does not always favour one side; `load_avg` is recorded
before each side.

This script runs the seeds and writes the result; the settings, start and evaluation are in
`bench/e2e_shared.py`, the two training runs in `bench/e2e_runs.py`, the curve figures and the
plot in `bench/e2e_curves.py`.
"""

from __future__ import annotations

import argparse
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

from bench.e2e_curves import curve_gains, plot_curves, retarget, times_to_target
from bench.e2e_runs import run_ours, run_trl
from bench.e2e_shared import (
    DIFFICULTY,
    EVAL_N,
    EVAL_SEED,
    GROUP,
    LR,
    MAX_TOKENS,
    PROMPTS_PER_STEP,
    TEMPERATURE,
    accuracy,
    arith_reward,
    prepare_start,
)

RESULT = ROOT / "bench" / "results" / "e2e_vs_trl.json"


# ---------------------------------------------------------------------------- main
def _ours_detail(ours: dict, seconds: float) -> dict:
    s = ours["summary"]
    return {
        "steps": s.get("steps"),
        "trained_samples": s.get("trained_samples"),
        "trajectories": s.get("trajectories"),
        "filtered": s.get("filtered"),
        "weight_versions": s.get("weight_versions"),
        "dead_letters": s.get("dead_letters"),
        "lost": s.get("lost"),
        "stop_reason": s.get("stop_reason"),
        "rlbus_up_wall_s": ours["wall_s"],
        "learner_step_means": s.get("learner_step_means"),
        "cpu_seconds": s.get("cpu_seconds"),
        "samples_per_s": round((s.get("trained_samples") or 0) / seconds, 2),
        "learner_state": ours["learner_state"],
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget per side and seed")
    ap.add_argument("--sft-seconds", type=float, default=60.0)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--start", help="use this SFT checkpoint dir as the shared start (skips SFT)")
    ap.add_argument("--seeds", type=int, default=1, help="RL runs per side from the same start (seeds 0..N-1)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds run: first-seed .. first-seed + seeds - 1")
    ap.add_argument("--lr", type=float, default=LR, help="learning rate, both sides")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=MAX_TOKENS,
        help="completion tokens, both sides and the evaluation (12 for a start that shows its work, "
        "the demo's `(70+2)=72`)",
    )
    ap.add_argument("--eval-n", type=int, default=EVAL_N, help="held-out problems (excluded from all training)")
    ap.add_argument("--sides", default="ours,trl", help="which sides to run (scouting: one side)")
    ap.add_argument(
        "--no-dynamic-sampling",
        action="store_true",
        help="ours without learner.skip_zero_variance (DAPO dynamic sampling; TRL has none)",
    )
    ap.add_argument(
        "--ours-weights",
        choices=("file", "nats"),
        default="file",
        help="ours' weight store: a folder in the bench's temp dir (default: one machine) or the NATS object store",
    )
    ap.add_argument(
        "--ours-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of ours' config (rlbus up --set), e.g. learner.max_staleness=1; repeatable",
    )
    ap.add_argument("--hidden", type=int, default=128, help="the tiny model's hidden size (the demo's: 128)")
    ap.add_argument("--layers", type=int, default=4, help="the tiny model's layers (the demo's: 4)")
    ap.add_argument(
        "--curve",
        default="",
        metavar="S,S,...",
        help="also evaluate each side's policy as it stood at these seconds into its budget "
        "(e.g. 60,120,180): a learning curve per run, plotted next to the result JSON",
    )
    ap.add_argument(
        "--target-gain",
        default="0.02",
        metavar="G,G,...",
        help="with --curve: report each side's time to reach start + G (fraction; 0.02 = 2 points)",
    )
    ap.add_argument(
        "--retarget",
        metavar="RESULT_JSON",
        help="only print the time-to-target figures of a recorded result (its curves) and exit",
    )
    ap.add_argument("--out", default=str(RESULT), help="result JSON path")
    a = ap.parse_args()
    a.marks = tuple(sorted(float(x) for x in a.curve.split(",") if x.strip()))
    a.target_gains = [float(x) for x in a.target_gain.split(",") if x.strip()]
    if any(not 0 < m < a.minutes * 60 for m in a.marks):
        ap.error(f"--curve marks must lie inside the budget (0, {a.minutes * 60:g}) seconds")
    return a


def ours_side(a, run: dict, start: Path, tmp: Path, acc0: float, threads: int) -> None:
    """One seed of ours: train for the budget, then its accuracy, curve and details into `run`."""
    seed, seconds, marks = run["seed"], a.minutes * 60, a.marks
    run["load_avg"]["before_ours"] = os.getloadavg()
    ours = run_ours(
        start,
        tmp,
        seconds,
        f"e2e{seed}x{int(time.time())}",
        lr=a.lr,
        eval_n=a.eval_n,
        seed=seed,
        skip_zero_variance=not a.no_dynamic_sampling,
        overrides=tuple(a.ours_set),
        weights=a.ours_weights,
        marks=marks,
        max_tokens=a.max_tokens,
    )
    run["ours_accuracy"] = accuracy(start, a.eval_n, ours["state_dict"], threads, max_tokens=a.max_tokens)
    if marks:
        run["ours_curve"] = []
        for mark, (weight_version, blob) in ours["blobs"].items():
            if weight_version == 0:
                acc = acc0  # nothing published yet: the start
            else:  # None when the version's file was gone
                acc = accuracy(start, a.eval_n, threads=threads, blob=blob, max_tokens=a.max_tokens) if blob else None
            run["ours_curve"].append([mark, weight_version, acc])
        run["ours_curve"].append([seconds, "final", run["ours_accuracy"]])
    run["ours_detail"] = _ours_detail(ours, seconds)
    print(
        f"seed {seed} ours: accuracy {run['ours_accuracy']:.3f}, {run['ours_detail']['trained_samples']} samples",
        flush=True,
    )


def trl_side(a, run: dict, start: Path, tmp: Path, threads: int) -> None:
    """One seed of TRL: train for the budget, then its accuracy, curve and details into `run`."""
    seed, seconds, marks = run["seed"], a.minutes * 60, a.marks
    run["load_avg"]["before_trl"] = os.getloadavg()
    peer = run_trl(
        start,
        tmp / f"trl{seed}",
        seconds,
        arith_reward,
        threads,
        lr=a.lr,
        eval_n=a.eval_n,
        seed=seed,
        marks=marks,
        max_tokens=a.max_tokens,
    )
    run["peer_accuracy"] = accuracy(Path(peer["final_dir"]), a.eval_n, threads=threads, max_tokens=a.max_tokens)
    if marks:
        run["peer_curve"] = [
            [mark, step, accuracy(start, a.eval_n, state, threads, max_tokens=a.max_tokens)]
            for mark, (step, state) in sorted(peer.pop("snapshots").items())
        ]
        run["peer_curve"].append([seconds, "final", run["peer_accuracy"]])
    peer.pop("snapshots", None)
    run["peer_detail"] = {k: v for k, v in peer.items() if k != "final_dir"} | {
        "samples_per_s": round(peer["samples_trained"] / seconds, 2)
    }
    print(f"seed {seed} TRL: accuracy {run['peer_accuracy']:.3f}, {peer['samples_trained']} samples", flush=True)


def command_line(a) -> str:
    """The command that reproduces this result."""
    return (
        f"python bench/e2e_vs_trl.py --minutes {a.minutes:g} --sft-seconds {a.sft_seconds:g} "
        f"--sft-steps {a.sft_steps} --seeds {a.seeds} --lr {a.lr:g} --eval-n {a.eval_n}"
        + (f" --first-seed {a.first_seed}" if a.first_seed else "")
        + (f" --max-tokens {a.max_tokens}" if a.max_tokens != MAX_TOKENS else "")
        + (f" --start {a.start}" if a.start else "")
        + (" --no-dynamic-sampling" if a.no_dynamic_sampling else "")
        + (" --ours-weights nats" if a.ours_weights == "nats" else "")
        + "".join(f" --ours-set {kv}" for kv in a.ours_set)
        + (f" --hidden {a.hidden} --layers {a.layers}" if (a.hidden, a.layers) != (128, 4) else "")
        + (f" --curve {a.curve} --target-gain {a.target_gain}" if a.marks else "")
        + (f" --sides {a.sides}" if set(a.sides.split(",")) != {"ours", "trl"} else "")
    )


def main() -> dict:
    from importlib.metadata import version

    a = parse_args()
    if a.retarget:
        figures = retarget(Path(a.retarget), a.target_gains)
        print(json.dumps(figures, indent=2))
        return figures
    sides = set(a.sides.split(","))
    dynamic = not a.no_dynamic_sampling
    threads = os.cpu_count() or 2
    marks = a.marks
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-e2e-") as d:
        tmp = Path(d)
        t = time.monotonic()
        start, sft = (
            (Path(a.start), {"given": a.start})
            if a.start
            else prepare_start(tmp, a.sft_seconds, a.sft_steps, a.eval_n, hidden=a.hidden, layers=a.layers)
        )
        acc0 = accuracy(start, a.eval_n, threads=threads, max_tokens=a.max_tokens)
        print(f"start accuracy {acc0:.3f} (n={a.eval_n}) after SFT {sft}", flush=True)
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            run: dict = {"seed": seed, "load_avg": {}}
            order = ("ours", "trl") if seed % 2 == 0 else ("trl", "ours")  # alternate: load drifts hit both
            run["order"] = [side for side in order if side in sides]
            for side in run["order"]:
                if side == "ours":
                    ours_side(a, run, start, tmp, acc0, threads)
                else:
                    trl_side(a, run, start, tmp, threads)
            runs.append(run)
        total = time.monotonic() - t

    def mean_gain(key: str) -> float | None:
        vals = [r[key] - acc0 for r in runs if key in r]
        return round(statistics.fmean(vals), 4) if vals else None

    gain_ours, gain_peer = mean_gain("ours_accuracy"), mean_gain("peer_accuracy")
    result = {
        "name": "e2e_vs_trl",
        "ours": gain_ours,
        "peer": gain_peer,
        "unit": "held-out greedy accuracy gain over the shared SFT start, mean over seeds (fraction; 0.01 = 1 point)",
        "ratio": round(gain_ours / gain_peer, 3) if gain_ours is not None and gain_peer else None,
        "ratio_note": "ours/peer mean gain; null when a side did not run or TRL gained nothing",
        "gains_per_seed": {
            "ours": [round(r["ours_accuracy"] - acc0, 4) for r in runs if "ours_accuracy" in r],
            "peer": [round(r["peer_accuracy"] - acc0, 4) for r in runs if "peer_accuracy" in r],
        },
        "target_ratio": 1.0,
        "peer_name": f"TRL {version('trl')} GRPOTrainer (HF generate on CPU), same hyper-parameters",
        "command": command_line(a),
        "budget_minutes_per_side": a.minutes,
        "model": {"arch": "qwen2", "hidden_size": a.hidden, "layers": a.layers} if not a.start else {"given": a.start},
        "curve_note": (
            "per run, [seconds into the budget, weight version (ours) or optimizer steps done (TRL), held-out "
            "accuracy]: the policy as it stood at that time (TRL: after the last step that ended before it)"
        )
        if marks
        else None,
        "start_accuracy": acc0,
        "eval": {
            "set": f"producers.domains.arith.heldout_set({EVAL_SEED}, {a.eval_n}, {DIFFICULTY})",
            "n": a.eval_n,
            "greedy": True,
            "max_tokens": a.max_tokens,
            "binomial_se_points": round(100 * (max(acc0, 0.01) * (1 - acc0) / a.eval_n) ** 0.5, 2),
        },
        "sft": sft,
        "runs": runs,
        "settings": {
            "group_size": GROUP,
            "prompts_per_step": PROMPTS_PER_STEP,
            "lr": a.lr,
            "beta": 0.0,
            "temperature": TEMPERATURE,
            "max_tokens": a.max_tokens,
            "difficulty": DIFFICULTY,
            "ours_dynamic_sampling": dynamic,
            "ours_overrides": a.ours_set,
            "ours_weights": a.ours_weights,
            "torch_threads_trl": threads,
            "ours_config": "see OURS_CONFIG in bench/e2e_runs.py",
        },
        "total_bench_s": round(total, 1),
        "torch": __import__("torch").__version__,
        "transformers": version("transformers"),
        "trl": version("trl"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if marks:
        result["curve_mean_gain"] = curve_gains(result)
        result["time_to_target"] = {f"{g:g}": times_to_target(result, g) for g in a.target_gains}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if marks:
        plot_curves(result, out.with_suffix(".png"))
    print(f"mean gain ours {gain_ours}, TRL {gain_peer}, ratio {result['ratio']} (target >= 1.0); wrote {out}")
    return result


if __name__ == "__main__":
    main()
