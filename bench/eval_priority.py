"""Eval beside training: how long a pipeline eval round takes while training runs, with the eval
priority class (`rollout.priority.enabled = true`, the default) against first come, first served
(`false`), side by side in one run.

What it measures (run with no arguments: `python bench/eval_priority.py`; about 2 minutes):

Two runs of the REAL worker processes (`rlbus worker sampler|rollout|verifier|learner`, one
embedded nats-server each; rollout engine `sleep`: a training batch takes its tasks' 0.2 s,
verifier `constant`, learner `policy="null"`), with a training backlog in TASKS (the sampler's
in-flight bound at 64 tasks). Once the learner steps, this process runs `ROUNDS` pipeline eval
rounds of 16 greedy `arith` problems (`scheduler.pipeline_eval.PipelineEval`, published in the
class the run's config gives it, as the scheduler does) and records per round: its seconds from
publish to the last reward, the learner steps during it, and training rewards/s during it.

Writes bench/results/eval_priority.json: `ours` = mean round seconds with priority, `peer` =
FCFS, `ratio` = peer / ours (how many times sooner a round completes); and the learner steps
during rounds in both (the learner never waits for a round: it steps on in both).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import start_roles, stop_procs
from bus.conn import connect, ensure_topology
from bus.kv import LEARNER_PROGRESS, get_json
from bus.server import EmbeddedNats
from bus.subjects import Registry
from scheduler.evaluation import EvalSuite
from scheduler.pipeline_eval import PipelineEval
from schemas.config import load_config

ROUNDS, TASK_S = 3, 0.2
TRAINING = f"""
[sampler]
group_size = 2
max_inflight_tasks = 64
publish_batch = 16
[sampler.domains.quick]
kind = "sleep"
params = {{ seconds = {TASK_S} }}
[rollout]
engine = "sleep"
batch_tasks = 2
[rollout.priority]
enabled = ENABLED
[verifier]
concurrency = 0
[learner]
policy = "null"
groups_per_step = 2
step_window_s = 0.5
max_staleness = 100000
checkpoint_every = 1000000
"""
EVAL = """
[sampler]
max_tokens = 4
[scheduler.eval]
n = 16
difficulty = 1
mode = "pipeline"
timeout_s = 120
"""


async def measure(url: str, reg: Registry, suite: EvalSuite, priority: str) -> list[dict]:
    """`ROUNDS` eval rounds once the learner steps: seconds, learner steps and training rewards/s during each."""
    nc = await connect(url, name="bench-eval-priority")
    js = nc.jetstream(timeout=10)
    try:
        await ensure_topology(js, reg)

        async def progress() -> tuple[int, int]:
            p = await get_json(js, reg, LEARNER_PROGRESS) or {}
            return int(p.get("step", 0)), int(p.get("samples_trained", 0))

        deadline = time.monotonic() + 120
        while (await progress())[0] < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("the learner did not step within 120 s")
            await asyncio.sleep(0.5)
        pe = PipelineEval(js, reg, suite, timeout_s=120, priority=priority)
        await pe.start()
        rounds = []
        try:
            for _ in range(ROUNDS):
                (s0, n0), t0 = await progress(), time.monotonic()
                await pe.evaluate()
                (s1, n1), dt = await progress(), time.monotonic() - t0
                rounds.append(
                    {
                        "seconds": round(dt, 2),
                        "rewards": pe.last["rewards"],
                        "tasks": pe.last["tasks"],
                        "learner_steps_during": s1 - s0,
                        "train_samples_per_s_during": round((n1 - n0) / dt, 2),
                    }
                )
                await asyncio.sleep(2.0)
        finally:
            await pe.stop()
        return rounds
    finally:
        await nc.close()


def run_scenario(name: str, enabled: bool, tmp: Path, suite: EvalSuite) -> list[dict]:
    run_id = f"evp{name}{os.getpid()}"
    cfg_path = tmp / f"{name}.toml"
    cfg_path.write_text(TRAINING.replace("ENABLED", str(enabled).lower()))
    server = EmbeddedNats(tmp / f"nats-{name}").start()
    procs = []
    try:
        procs += start_roles(cfg_path, server.url, run_id, tmp / "runs", tmp / name)
        return asyncio.run(measure(server.url, Registry(run_id), suite, "eval" if enabled else "train"))
    finally:
        stop_procs(procs)
        server.stop()


def main() -> int:
    results = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-evalprio-") as tmp:
        eval_cfg = Path(tmp) / "eval.toml"
        eval_cfg.write_text(EVAL)
        suite = EvalSuite.from_config(load_config(eval_cfg))
        for name, enabled in (("priority", True), ("fcfs", False)):
            results[name] = run_scenario(name, enabled, Path(tmp), suite)
            print(name, results[name], flush=True)
    mean = {k: sum(r["seconds"] for r in v) / len(v) for k, v in results.items()}
    out = {
        "benchmark": "eval_priority",
        "unit": "seconds per 16-problem pipeline eval round during training",
        "ours": round(mean["priority"], 2),
        "peer": round(mean["fcfs"], 2),
        "ratio": round(mean["fcfs"] / mean["priority"], 2),
        "ratio_means": "peer / ours: how many times sooner a round completes with the eval class",
        "learner_steps_during_rounds": {k: [r["learner_steps_during"] for r in v] for k, v in results.items()},
        "scenarios": results,
        "training_task_s": TASK_S,
        "min_share": load_config(None, []).rollout.priority.min_share,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = ROOT / "bench" / "results" / "eval_priority.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("ours", "peer", "ratio", "learner_steps_during_rounds", "machine")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
