"""Learning-curve figures of `bench/e2e_vs_trl.py` results: time-averaged gains, time to a
target accuracy, and the plot.

Guarantees:
- Every function reads a result dict as `bench/e2e_vs_trl.py` writes it (`start_accuracy`,
  `runs` with `ours_curve` / `peer_curve` points `[seconds, version or step, accuracy]`); a
  point whose accuracy is None is skipped.
- `curve_gains` and `times_to_target` return None when no run has a curve.
- `retarget` only reads a recorded result; it writes nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path


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
