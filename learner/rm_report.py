"""What a reward-model run reports: `rm_report.json` and the score-distribution plot.

Guarantees:
- `accuracy` is the fraction of held-out pairs with r_chosen > r_rejected (ties count
  as wrong); `mean_margin` the mean of r_chosen - r_rejected.
- Calibration: the Bradley-Terry probability p = sigmoid(r_c - r_r) that chosen wins is
  bucketed into `BUCKETS` equal bins of [0, 1]; each pair is counted twice, as (p, won)
  and (1 - p, lost), so a bin's `observed` is the frequency with which the side it
  predicted at `predicted` (the bin's mean p) actually won. `ece` is the count-weighted
  mean |observed - predicted|.
- `write_report` writes `<out>/rm_report.json` (the run summary plus the held-out figures)
  and `<out>/rm_scores.png` (histograms of chosen and rejected held-out rewards, with
  matplotlib's Agg backend: no display needed); it returns the report dict.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BUCKETS = 10


def accuracy(rc: list[float], rr: list[float]) -> float:
    """Held-out pairwise accuracy (nan without pairs)."""
    return sum(c > r for c, r in zip(rc, rr)) / len(rc) if rc else float("nan")


def calibration(rc: list[float], rr: list[float], buckets: int = BUCKETS) -> list[dict]:
    """Reliability buckets of the pairwise win probability (module guarantees)."""
    bins = [[0, 0.0, 0] for _ in range(buckets)]  # count, sum of p, wins
    for c, r in zip(rc, rr):
        p = 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, c - r))))
        for prob, won in ((p, 1), (1.0 - p, 0)):
            b = bins[min(buckets - 1, int(prob * buckets))]
            b[0] += 1
            b[1] += prob
            b[2] += won
    return [
        {
            "lo": k / buckets,
            "hi": (k + 1) / buckets,
            "count": n,
            "predicted": s / n if n else None,
            "observed": w / n if n else None,
        }
        for k, (n, s, w) in enumerate(bins)
    ]


def heldout_figures(rc: list[float], rr: list[float]) -> dict:
    """Accuracy, margins, reward statistics and calibration of the held-out pairs."""
    if not rc:
        return {"heldout_pairs": 0, "heldout_accuracy": None, "mean_margin": None, "calibration": [], "ece": None}
    cal = calibration(rc, rr)
    total = sum(b["count"] for b in cal)
    ece = sum(b["count"] * abs(b["observed"] - b["predicted"]) for b in cal if b["count"]) / total
    return {
        "heldout_pairs": len(rc),
        "heldout_accuracy": accuracy(rc, rr),
        "mean_margin": sum(c - r for c, r in zip(rc, rr)) / len(rc),
        "chosen_mean": sum(rc) / len(rc),
        "rejected_mean": sum(rr) / len(rr),
        "calibration": cal,
        "ece": ece,
    }


def plot_scores(rc: list[float], rr: list[float], path: Path) -> None:
    """Histograms of held-out chosen vs rejected rewards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if rc:
        lo, hi = min(rc + rr), max(rc + rr)
        bins = [lo + (hi - lo) * k / 30 for k in range(31)] if hi > lo else 10
        ax.hist(rc, bins=bins, alpha=0.6, label=f"chosen (mean {sum(rc) / len(rc):.3f})")
        ax.hist(rr, bins=bins, alpha=0.6, label=f"rejected (mean {sum(rr) / len(rr):.3f})")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no held-out pairs", ha="center")
    ax.set_xlabel("reward (logit)")
    ax.set_ylabel("held-out pairs")
    ax.set_title(f"held-out reward scores, accuracy {accuracy(rc, rr):.3f}" if rc else "held-out reward scores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out: Path, summary: dict, rc: list[float], rr: list[float]) -> dict:
    """`rm_report.json` and `rm_scores.png` under `out`; the report."""
    report = {**summary, **heldout_figures(rc, rr), "plot": str(out / "rm_scores.png")}
    plot_scores(rc, rr, out / "rm_scores.png")
    (out / "rm_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
