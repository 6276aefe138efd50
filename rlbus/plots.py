"""Plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def reward_curve(path: Path, steps: list[tuple[int, float]], evals: list[tuple[int, float]], title: str) -> Path:
    """Training reward per learner step and greedy eval score per evaluated step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if steps:
        xs, ys = zip(*sorted(steps))
        ax.plot(xs, ys, lw=0.8, alpha=0.5, label="train reward (batch mean)")
        k = max(1, len(ys) // 20)
        smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=2, label=f"train reward (moving avg {k})")
    if evals:
        ex, ey = zip(*sorted(evals))
        ax.plot(ex, ey, "o-", color="black", label="held-out greedy accuracy")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
