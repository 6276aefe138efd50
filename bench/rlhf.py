"""The RLHF example's two sides (issue 32 item 5): RM score vs hidden-rule score per version,
without and with the KL term, from two finished `rlbus up examples/rlhf.toml` runs.

Usage (the runs as docs/architecture.md, "The RLHF example", makes them; same seed, same
SFT steps, same max_steps, only `learner.beta` differs):

    python bench/rlhf.py runs/rlhf-beta0 runs/rlhf-kl01 --out bench/results/rlhf

What it writes: `rlhf.json` (per side: beta, the aligned points (version, RM score, rule
score), `rm_divergence` and its reason as `rlbus.report.rlhf` computes them, the first and
last points, the rule's best, the version of the RM's best, and the first version whose rule
score is at most half of v0's with the RM score there: how far the KL term holds the fall off) and `rm_vs_rule.png` (one
panel per side, RM and rule on one chart each, divergence marked). Reads only each run's
SQL store (`<run>/run.db`); needs no NATS server. A run folder without a store is an error
naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def side(run: Path) -> dict:
    """One run's curves and divergence."""
    from rlbus.report.rlhf import rlhf_curves, rlhf_domains
    from scheduler.store import open_store
    from scheduler.store_rows import EvalResultRow, RewardRow, RunRow

    if not (run / "run.db").exists():
        raise SystemExit(f"bench/rlhf.py: {run / 'run.db'} does not exist: pass finished run folders")
    store = open_store(None, run)
    try:
        runs = store.rows(RunRow, run.name)
        rewards = store.rows(RewardRow, run.name)
        evals = store.rows(EvalResultRow, run.name, "created_at")
    finally:
        store.close()
    config = runs[0].config if runs else {}
    domains = rlhf_domains(config)
    points, divergence, reason = rlhf_curves(rewards, evals, domains)
    best_rule = max(points, key=lambda p: p[2]) if points else None
    best_rm = max(points, key=lambda p: p[1]) if points else None
    return {
        "run": run.name,
        "beta": ((config or {}).get("learner") or {}).get("beta"),
        "seed": ((config or {}).get("run") or {}).get("seed"),
        "max_steps": ((config or {}).get("run") or {}).get("max_steps"),
        "points": [{"version": v, "rm_score": rm, "rule_score": rule, "rule_n": n} for v, rm, rule, n in points],
        "first": points[0][:3] if points else None,
        "last": points[-1][:3] if points else None,
        "best_rule": best_rule[:3] if best_rule else None,
        "best_rm_version": best_rm[0] if best_rm else None,
        "rule_halved_at": next((v for v, _, rule, _ in points if points and rule <= points[0][2] / 2), None),
        "rm_at_rule_halved": next((rm for _, rm, rule, _ in points if points and rule <= points[0][2] / 2), None),
        "rm_divergence": divergence,
        "rm_divergence_reason": reason,
    }


def plot(path: Path, sides: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sides), figsize=(5 * len(sides), 3.6), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], sides):
        vs = [p["version"] for p in s["points"]]
        ax.plot(vs, [p["rm_score"] for p in s["points"]], "o-", ms=3, label="RM score (the reward)")
        ax.plot(vs, [p["rule_score"] for p in s["points"]], "s-", ms=3, label="hidden rule (eval only)")
        if s["rm_divergence"]:
            at = s["rm_divergence"]["at_version"]
            ax.axvline(at, color="gray", ls="--", label=f"rm_divergence v{at}")
        ax.set_title(f"{s['run']}: learner.beta = {s['beta']}")
        ax.set_xlabel("policy version")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(loc="lower left", fontsize=8)
    axes[0][0].set_ylabel("score")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished run folders (<run-dir>/<run_id>)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/rlhf"))
    args = ap.parse_args()
    sides = [side(r.resolve()) for r in args.runs]
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    (args.out / "rlhf.json").write_text(json.dumps({"load_avg": load, "sides": sides}, indent=1))
    plot(args.out / "rm_vs_rule.png", sides)
    for s in sides:
        div = s["rm_divergence"]
        print(
            f"{s['run']} beta={s['beta']}: first {s['first']} last {s['last']} "
            f"rule halved at v{s['rule_halved_at']} "
            f"divergence {'none' if div is None else 'v' + str(div['at_version'])} ({s['rm_divergence_reason']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
