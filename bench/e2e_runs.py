"""The two training runs of `bench/e2e_vs_trl.py`: ours (`rlbus up` in a subprocess) and the
peer (TRL `GRPOTrainer` in this process), each for a fixed wall-clock budget from the same start.

Guarantees:
- `run_ours` writes a config from `OURS_CONFIG` (the demo's settings where they matter, SFT
  off, in-run evaluation pushed out) and runs `rlbus up` on it; sampling stops `seconds`
  after it started (set-up included). It raises `RuntimeError` with the log's tail when
  `rlbus up` fails, and removes the run's weight files before it returns.
- `run_trl` uses the same hyper-parameters (`bench.e2e_shared`), stops after the first
  optimizer step that ends past `seconds`, and saves the final model.
- With `marks`, each side keeps the policy as it stood at each mark: ours the newest
  version the learner had logged by then (`curve_blobs`; version 0, the start, when none
  was), TRL the weights after the last step that ended before it.
- `step_events` / `step_means` skip log lines that do not parse.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script (`make bench` runs every bench/*.py): find `bench`
    sys.path.insert(0, str(ROOT))

from bench.e2e_shared import DIFFICULTY, EVAL_N, GROUP, LR, MAX_TOKENS, PROMPTS_PER_STEP, TEMPERATURE, heldout


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
