"""Plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def reward_curve(path: Path, steps: list[tuple[int, float]], evals, title: str) -> Path:
    """Training reward per learner step and greedy eval score per evaluated step, one PNG.

    `evals` is a list of (step, score), or a dict domain -> such a list (one line each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6), dpi=110)
    top = 0.0
    if steps:
        xs, ys = zip(*sorted(steps))
        ax.plot(xs, ys, lw=0.8, alpha=0.5, label="train reward (batch mean)")
        k = max(1, len(ys) // 20)
        smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=2, label=f"train reward (moving avg {k})")
        top = max(top, max(smooth))
    per_domain = evals if isinstance(evals, dict) else {"": evals}
    for (domain, points), marker in zip(per_domain.items(), "osd^v"):
        if points:
            ex, ey = zip(*sorted(points))
            ax.plot(ex, ey, f"{marker}-", label=f"held-out greedy accuracy {domain}".rstrip())
            top = max(top, max(ey))
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / accuracy")
    # zoomed to the smoothed curves (raw batch means may spike past the top): a change of a
    # few points stays visible when scores are low
    ax.set_ylim(0.0, min(1.02, max(0.1, top * 1.4)))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize="small", ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
