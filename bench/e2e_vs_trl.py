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

The machine may be shared with other processes: the two sides run one after the other
(ours, then TRL, per seed), so load differences between the windows enter the result;
`load_avg` is recorded before each side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "e2e_vs_trl.json"
EVAL_SEED, DIFFICULTY, MAX_TOKENS = 1234, 3, 6  # MAX_TOKENS: the default of --max-tokens
GROUP, PROMPTS_PER_STEP, TEMPERATURE = 8, 16, 1.0
EVAL_N, LR = (
    1000,
    3e-5,
)  # defaults of --eval-n and --lr (3e-4 degraded both sides in scouting; 1e-4 gains about the same)


# ---------------------------------------------------------------------------- shared
def heldout(n: int | None = None) -> list:
    """The held-out problems (`producers.domains.arith.heldout_set`); both sides never train on them."""
    from producers.domains import arith

    return arith.heldout_set(EVAL_SEED, n or EVAL_N, DIFFICULTY)


def prepare_start(
    tmp: Path, sft_seconds: float, sft_steps: int, eval_n: int, seed: int = 0, hidden: int = 128, layers: int = 4
) -> tuple[Path, dict]:
    """Tiny model + SFT warm start (held-out problems excluded); returns (dir, sft summary)."""
    from learner.sft import run_sft
    from producers.demos import batches_of
    from producers.domains import arith
    from rlbus.model.tiny_model import build_tiny_model

    base = build_tiny_model(tmp / "base", arch="qwen2", hidden_size=hidden, num_layers=layers, num_heads=4, seed=seed)
    held = {p.expression for p in heldout(eval_n)}

    def demo(rng):
        while True:
            p = arith.generate(rng, DIFFICULTY)
            if p.expression not in held:
                return p.prompt, p.completion

    stats = run_sft(
        base,
        tmp / "start",
        batches_of(demo, seed, 64),
        seconds=sft_seconds,
        max_steps=sft_steps,
        lr=3e-3,
        seed=seed,
        threads=os.cpu_count() or 2,
        progress=False,
    )
    return tmp / "start", stats


def accuracy(
    model_dir: Path,
    eval_n: int,
    state_dict=None,
    threads: int = 2,
    blob: bytes | None = None,
    max_tokens: int = MAX_TOKENS,
) -> float:
    """Greedy held-out accuracy of a model dir (optionally with another state dict, or a
    published weight blob, loaded)."""
    from bus.weight_blobs import load_state_bytes
    from producers.domains import arith
    from rollout_workers.engines.hf_engine import HFEngine
    from scheduler.evaluation import greedy_accuracy

    engine = HFEngine(str(model_dir), "cpu", threads)
    if state_dict is not None:
        engine.model.load_state_dict(state_dict)
    if blob is not None:
        load_state_bytes(engine.model, blob)
    if state_dict is not None or blob is not None:
        engine.model.eval()
    return greedy_accuracy(engine, arith.fixed_eval_set(EVAL_SEED, eval_n or EVAL_N, DIFFICULTY, max_tokens=max_tokens))


def arith_reward(completions, answer, **_) -> list[float]:
    """TRL reward function: 1.0 when the completion is exactly the integer answer."""
    from schemas.answers import arith_answer

    return [float(arith_answer(c) == int(a)) for c, a in zip(completions, answer)]


def trl_dataset(n: int, seed: int, eval_n: int):
    """Training prompts for TRL: difficulty-3 arith, held-out problems excluded."""
    from datasets import Dataset

    from producers.domains import arith

    rng, held = random.Random(f"trl-{seed}"), {p.expression for p in heldout(eval_n)}
    rows = {"prompt": [], "answer": []}
    while len(rows["prompt"]) < n:
        p = arith.generate(rng, DIFFICULTY)
        if p.expression not in held:
            rows["prompt"].append(p.prompt)
            rows["answer"].append(str(p.answer))
    return Dataset.from_dict(rows)


def run_trl(
    start: Path,
    out: Path,
    seconds: float,
    reward_fn,
    threads: int,
    *,
    lr: float,
    eval_n: int,
    seed: int = 0,
    marks: tuple[float, ...] = (),
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """TRL GRPOTrainer from `start` for `seconds` of wall time; saves the model to `out`.

    `marks` (seconds since the trainer was constructed): the policy as it stood at each
    mark (after the last step that ended before it) is kept in memory, for a learning curve."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)

    class WallClock(TrainerCallback):
        """Stop training once the budget is spent (checked after every optimizer step)."""

        def __init__(self, t0: float):
            self.t0, self.steps, self.snapshots, self.pending = t0, 0, {}, sorted(marks)

        def on_step_end(self, args, state, control, model=None, **kw):
            self.steps = state.global_step
            elapsed = time.monotonic() - self.t0
            while self.pending and elapsed >= self.pending[0]:  # the policy of the previous step stood at the mark
                mark = self.pending.pop(0)
                self.snapshots[mark] = (state.global_step - 1, self.previous)
            self.previous = (
                {k: v.detach().clone() for k, v in model.state_dict().items()}
                if self.pending and model is not None
                else None
            )
            if elapsed >= seconds:
                control.should_training_stop = True
            return control

    t0 = time.monotonic()
    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
        num_generations=GROUP,
        max_completion_length=max_tokens,
        temperature=TEMPERATURE,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        epsilon_high=0.28,
        max_grad_norm=1.0,
        weight_decay=0.0,
        optim="adamw_torch",
        num_iterations=1,
        max_steps=10**6,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=10,
        save_strategy="no",
        disable_tqdm=True,
        seed=seed,
    )
    model = AutoModelForCausalLM.from_pretrained(start)
    tok = AutoTokenizer.from_pretrained(start)
    clock = WallClock(t0)
    clock.previous = {k: v.detach().clone() for k, v in model.state_dict().items()} if marks else None
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=args,
        train_dataset=trl_dataset(200_000, seed, eval_n),
        processing_class=tok,
        callbacks=[clock],
    )
    trainer.train()
    wall = time.monotonic() - t0
    trainer.model.save_pretrained(out / "final")
    tok.save_pretrained(out / "final")
    steps = trainer.state.global_step
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "steps": steps,
        "samples_trained": steps * PROMPTS_PER_STEP * GROUP,
        "wall_s": round(wall, 1),
        "reward_curve": rewards,
        "final_dir": str(out / "final"),
        "snapshots": clock.snapshots,
    }


OURS_CONFIG = """
[run]
run_id = "{run_id}"
run_dir = "{run_dir}"
max_minutes = {max_minutes}
drain_seconds = 0.0
seed = {seed}

[model]
path = "{start}"

[sft]
enabled = false

[sampler]
domain = "arith"
difficulty = 3
group_size = {group}
max_tokens = {max_tokens}
temperature = {temperature}
max_inflight_tasks = 48

[sampler.domains.arith]
min_level = 3
max_level = 3
start_level = 3
{verifier_line}

[rollout]
engine = "hf"
batch_tasks = 16

[verifier]
{verifier_section}

[learner]
lr = {lr}
beta = 0.0
groups_per_step = {groups}
skip_zero_variance = {skip_zero_variance}
max_staleness = 4
checkpoint_every = 1000000
weight_store = "{weight_store}"

[scheduler.curriculum]
enabled = false

[scheduler.eval]
n = {eval_n}
difficulty = 3
every_versions = 1000000
"""


def run_ours(
    start: Path,
    tmp: Path,
    seconds: float,
    run_id: str,
    *,
    lr: float = LR,
    eval_n: int = EVAL_N,
    seed: int = 0,
    skip_zero_variance: bool = False,
    verifier: str = "",
    verifier_section: str = "",
    env: dict | None = None,
    overrides: tuple[str, ...] = (),
    weights: str = "file",
    marks: tuple[float, ...] = (),
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """`rlbus up` from `start` for `seconds` of sampling (`overrides`: `--set KEY=VALUE` each);
    returns the summary and final state dict.

    `marks` (seconds since `rlbus up` started; needs `weights="file"`): the weight blob of
    the newest version the learner had published at each mark, for a learning curve (the
    run keeps every version: `learner.keep_versions = 0`)."""
    import torch

    reserve = 25.0  # the launcher stops sampling this long before max_minutes (drain_seconds = 0)
    # one machine: weights go through a folder (written once, mapped by the rollout worker)
    # rather than through the NATS object store (chunked through the server, ~4 MB a step)
    weight_dir = tmp / f"weights-{run_id}"
    weight_store = f"file://{weight_dir}" if weights == "file" else "nats"
    cfg = OURS_CONFIG.format(
        run_id=run_id,
        run_dir=tmp / "runs",
        max_minutes=round((seconds + reserve) / 60, 4),
        start=start,
        group=GROUP,
        max_tokens=max_tokens,
        temperature=TEMPERATURE,
        lr=lr,
        groups=PROMPTS_PER_STEP,
        eval_n=eval_n,
        seed=seed,
        skip_zero_variance=str(skip_zero_variance).lower(),
        verifier_line=f'verifier = "{verifier}"' if verifier else "",
        verifier_section=verifier_section,
        weight_store=weight_store,
    )
    path = tmp / f"{run_id}.toml"
    path.write_text(cfg)
    if marks:
        if weights != "file":
            raise ValueError("learning-curve marks need the file:// weight store")
        overrides = (*overrides, "learner.keep_versions=0")
    t0, t0_wall = time.monotonic(), time.time()
    log = open(tmp / f"{run_id}.log", "wb")
    sets = [arg for kv in overrides for arg in ("--set", kv)]
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "up", str(path), *sets],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env or dict(os.environ),
        timeout=seconds + 600,
    )
    wall = time.monotonic() - t0
    run_path = tmp / "runs" / run_id
    if proc.returncode != 0:
        raise RuntimeError(
            f"rlbus up failed ({proc.returncode}); see {tmp / f'{run_id}.log'}:\n"
            + (tmp / f"{run_id}.log").read_text(errors="replace")[-3000:]
        )
    summary = json.loads((run_path / "summary.json").read_text())
    summary["learner_step_means"] = step_means(run_path / "logs" / "learner.log")
    payload = torch.load(run_path / "checkpoints" / "learner.pt", map_location="cpu", weights_only=False)
    blobs = curve_blobs(run_path / "logs" / "learner.log", weight_dir, t0_wall, marks)
    shutil.rmtree(weight_dir, ignore_errors=True)  # every version's file (~4 MB each, >1000 a run)
    return {
        "summary": summary,
        "state_dict": payload["model"],
        "wall_s": round(wall, 1),
        "learner_state": {k: v for k, v in payload["state"].items() if k != "trained"},
        "blobs": blobs,
    }


def curve_blobs(learner_log: Path, weight_dir: Path, t0_wall: float, marks: tuple[float, ...]) -> dict:
    """{mark: (version, blob)}: the newest version whose `learner.step` event was logged by
    `t0_wall + mark` (version 0, the start, when none was)."""
    from datetime import datetime

    from learner.retention import version_name

    published: list[tuple[float, int]] = []
    for event in step_events(learner_log):
        try:
            published.append((datetime.fromisoformat(event["timestamp"]).timestamp(), int(event["version"])))
        except (ValueError, KeyError, TypeError):
            continue
    out = {}
    for mark in marks:
        versions = [v for t, v in published if t <= t0_wall + mark]
        version = max(versions, default=0)
        path = weight_dir / version_name(version)
        out[mark] = (version, path.read_bytes() if version and path.exists() else None)
    return out


def step_events(learner_log: Path):
    """The run's `learner.step` events (JSON log lines; unparsable lines are skipped)."""
    text = learner_log.read_text(errors="replace") if learner_log.exists() else ""
    for line in text.splitlines():
        if '"learner.step"' in line:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def step_means(
    learner_log: Path, fields=("clip_frac", "ratio_mean", "staleness_mean", "grad_norm", "adv_abs_mean", "reward_mean")
) -> dict[str, float]:
    """Means over the run's `learner.step` events (JSON log lines) of the given metrics (off-policy health)."""
    sums = dict.fromkeys(fields, 0.0)
    counts = dict.fromkeys(fields, 0)
    for event in step_events(learner_log):
        for key in fields:
            if isinstance(event.get(key), (int, float)):
                sums[key] += float(event[key])
                counts[key] += 1
    return {k: round(sums[k] / counts[k], 4) for k in fields if counts[k]}


def curve_gains(result: dict) -> dict | None:
    """Time-averaged gain: per run, the mean over the curve's points (the marks and the end)
    of accuracy - start, then the mean over runs per side and their ratio. It weighs every
    point of a run's budget equally, so it rewards getting there sooner and is less at the
    mercy of one checkpoint than the end point alone (the figure the design target names)."""
    acc0, out = result["start_accuracy"], {}
    for side, key in (("ours", "ours_curve"), ("peer", "peer_curve")):
        per_run = [
            round(statistics.fmean(a - acc0 for _, _, a in r[key] if a is not None), 4)
            for r in result["runs"]
            if r.get(key)
        ]
        out[side] = round(statistics.fmean(per_run), 4) if per_run else None
        out[f"{side}_per_seed"] = per_run
    if out["ours"] is None and out["peer"] is None:
        return None
    out["ratio"] = round(out["ours"] / out["peer"], 3) if out["ours"] is not None and out["peer"] else None
    return out


def time_to_target(curve: list, acc0: float, gain: float) -> float | None:
    """Seconds into the budget of the first curve point (marks, then the end) whose accuracy
    is at least `acc0 + gain`; None when no point of the run got there. Resolution is the
    spacing of the marks: the true crossing lies between the previous point and this one."""
    for seconds, _, acc in curve:
        if acc is not None and acc >= acc0 + gain - 1e-12:
            return float(seconds)
    return None


def times_to_target(result: dict, gain: float) -> dict | None:
    """Per side: each run's `time_to_target` at start + `gain` (None = not reached within the
    budget), how many runs reached it, and the median over runs counting a miss as never
    (None when half or more missed). Unlike a ratio of gains it stays meaningful when a side's
    gain is zero or negative. None without curves."""
    acc0 = result["start_accuracy"]
    out = {"target_gain": gain, "target_accuracy": round(acc0 + gain, 4)}
    for side, key in (("ours", "ours_curve"), ("peer", "peer_curve")):
        per_run = [time_to_target(r[key], acc0, gain) for r in result["runs"] if r.get(key)]
        ranked = sorted(per_run, key=lambda s: math.inf if s is None else s)
        median = statistics.median([math.inf if s is None else s for s in ranked]) if ranked else None
        out[side] = {
            "seconds_per_seed": per_run,
            "reached": sum(s is not None for s in per_run),
            "runs": len(per_run),
            "median_s": None if median in (None, math.inf) else median,
        }
    if not out["ours"]["runs"] and not out["peer"]["runs"]:
        return None
    return out


def retarget(path: Path, gains: list[float]) -> dict:
    """Time-to-target figures for a recorded result JSON (its runs' curves), per target gain."""
    result = json.loads(path.read_text())
    return {f"{g:g}": times_to_target(result, g) for g in gains}


def plot_curves(result: dict, path: Path) -> None:
    """Accuracy against seconds into the budget, one thin line per run, the mean bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    acc0 = result["start_accuracy"]
    for key, label, color in (("ours_curve", "rlbus", "tab:blue"), ("peer_curve", "TRL GRPOTrainer", "tab:orange")):
        curves = [[(0.0, acc0)] + [(m, a) for m, _, a in r[key] if a is not None] for r in result["runs"] if key in r]
        for c in curves:
            ax.plot(*zip(*c), color=color, alpha=0.3, lw=1)
        if curves and len({len(c) for c in curves}) == 1:
            xs = [x for x, _ in curves[0]]
            ax.plot(
                xs,
                [statistics.fmean(c[i][1] for c in curves) for i in range(len(xs))],
                color=color,
                lw=2.5,
                label=f"{label} (mean of {len(curves)})",
            )
    ax.set_xlabel("seconds into the budget (set-up included)")
    ax.set_ylabel("held-out greedy accuracy")
    model = result.get("model") or {}
    shape = (
        f"hidden {model['hidden_size']} x {model.get('layers', '?')} layers"
        if "hidden_size" in model
        else f"start {model.get('given', '?')}"
    )
    ax.set_title(f"e2e, {shape}: start {acc0:.1%}, lr {result.get('settings', {}).get('lr', '?')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
            if "ours" in sides:
                ours_side(a, run, start, tmp, acc0, threads)
            if "trl" in sides:
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
            "ours_config": "see OURS_CONFIG in this file",
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
