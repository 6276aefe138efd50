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
        smooth = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
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


# -- many-domain plots (`rlbus report`) -------------------------------------------------------
TOP_LABELLED = 12
"""Domains drawn (and named in legends) one by one; the rest are summed or left unlabelled."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)


def heldout_vs_train(
    path: Path, heldout: dict[str, list[tuple[int, float]]], train_mean: list[tuple[int, float]], n_train: int
) -> Path:
    """Eval score per held-out (zero-shot) domain vs weight version, next to the mean eval score
    of the trained domains at each version; up to `TOP_LABELLED` held-out domains are named."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train_mean:
        ax.plot(
            [v for v, _ in train_mean],
            [s for _, s in train_mean],
            "k-o",
            lw=2,
            ms=3,
            label=f"trained domains, mean ({n_train})",
        )
    for i, (domain, pts) in enumerate(sorted(heldout.items())):
        ax.plot(
            [v for v, _ in pts],
            [s for _, s in pts],
            "--s",
            ms=3,
            lw=1,
            label=f"held out: {domain}" if i < TOP_LABELLED else None,
        )
    if not heldout:
        _empty(ax, "held-out evaluations")
    ax.set(
        xlabel="weight version",
        ylabel="eval score",
        title="held-out (zero-shot) vs trained domains",
        ylim=(-0.02, 1.02),
    )
    ax.grid(alpha=0.3)
    if heldout or train_mean:
        ax.legend(loc="best", fontsize="small")
    return _finish(fig, path)


def domain_heatmap(path: Path, domains: list[str], columns: list[str], grid: list[list[float | None]]) -> Path:
    """Mean training reward per domain (rows, in the given order) and weight-version bucket
    (columns); empty cells blank. The figure grows with the rows and the labels shrink, so a
    hundred domains stay readable."""
    import numpy as np

    plt = _pyplot()
    rows = max(1, len(domains))
    fig, ax = plt.subplots(figsize=(8, min(30.0, 2.0 + 0.13 * rows)), dpi=110)
    if not domains or not columns:
        _empty(ax, "training rewards")
        return _finish(fig, path)
    data = np.array([[np.nan if x is None else x for x in row] for row in grid], dtype=float)
    img = ax.imshow(
        np.ma.masked_invalid(data),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=0.0,
        vmax=max(1.0, float(np.nanmax(data)) if np.isfinite(data).any() else 1.0),
    )
    small = 4 if rows > 60 else 6 if rows > 25 else 8
    ax.set_yticks(range(rows), domains, fontsize=small)
    step = max(1, len(columns) // 20)
    ax.set_xticks(range(0, len(columns), step), columns[::step], fontsize=6, rotation=90)
    ax.set(xlabel="weight version of the generating policy", title="mean training reward by domain and version")
    fig.colorbar(img, ax=ax, fraction=0.04, pad=0.02, label="mean reward")
    return _finish(fig, path)


def curriculum_area(path: Path, times: list[float], weights: dict[str, list[float]]) -> Path:
    """Stacked curriculum weights over time: the `TOP_LABELLED` domains with the largest mean
    weight one by one, every other domain summed into one grey band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    if not times:
        _empty(ax, "curriculum updates")
        return _finish(fig, path)
    ranked = sorted(weights, key=lambda d: (-sum(weights[d]) / len(times), d))
    top, rest = ranked[:TOP_LABELLED], ranked[TOP_LABELLED:]
    bands = [weights[d] for d in top]
    labels = list(top)
    if rest:
        bands.append([sum(weights[d][i] for d in rest) for i in range(len(times))])
        labels.append(f"{len(rest)} other domains")
    colors = [plt.cm.tab20(i % 20) for i in range(len(top))] + (["0.75"] if rest else [])
    ax.stackplot(times, *bands, labels=labels, colors=colors, step="post")
    ax.set(
        xlabel="seconds since start",
        ylabel="sampling weight (stacked)",
        title="curriculum weights",
        ylim=(0.0, 1.0),
        xlim=(times[0], times[-1] if times[-1] > times[0] else times[0] + 1),
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="x-small", frameon=False)
    return _finish(fig, path)


def capability_cost_curves(path: Path, curves: dict[str, dict[str, list[tuple[float, float, int]]]]) -> Path:
    """The capability-cost curve: one panel per cost measure (`rlbus.report.build.cost_curves`), eval
    score per domain vs the cumulative cost recorded with each eval; up to `TOP_LABELLED` domains
    named. No measure recorded: one panel saying so."""
    plt = _pyplot()
    panels = max(1, len(curves))
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels + 1.0, 4), dpi=110, squeeze=False)
    if not curves:
        _empty(axes[0][0], "evaluations with a cost")
        axes[0][0].set(xlabel="cumulative cost", ylabel="eval score", title="capability vs cost")
        return _finish(fig, path)
    for ax, (label, per) in zip(axes[0], curves.items()):
        for i, (domain, pts) in enumerate(sorted(per.items())):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, label=domain if i < TOP_LABELLED else None)
        ax.set(xlabel=f"cumulative {label}", ylabel="eval score", title=f"capability vs {label}", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    return _finish(fig, path)


# -- long context (`rlbus.report.longctx`) -----------------------------------------------------
def accuracy_vs_length(path: Path, series: dict[str, tuple[int, list[tuple[float, float]]]]) -> Path:
    """Eval accuracy per document length (log2 axis), one line per domain (its newest eval with
    length groups); up to `TOP_LABELLED` domains named."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if not series:
        _empty(ax, "length groups")
    for i, (domain, (version, pts)) in enumerate(series.items()):
        ax.plot(
            [x for x, _ in pts],
            [y for _, y in pts],
            "-o",
            ms=4,
            label=f"{domain} (v{version})" if i < TOP_LABELLED else None,
        )
    if series:
        ax.set_xscale("log", base=2)
        ax.legend(loc="best", fontsize="small")
    ax.set(xlabel="document length (tokens)", ylabel="eval accuracy", title="accuracy vs length", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    return _finish(fig, path)


def recall_heatmap(path: Path, grids: dict, before: dict | None = None) -> Path:
    """Recall accuracy per (document length, needle position bucket), one panel per domain (its
    newest eval with joint groups), each cell annotated; empty cells blank. With `before` (the
    domains' first such evals, `recall_grid(evals, first=True)`), a domain whose first eval is an
    older version gets that panel first: before and after RL side by side."""
    import numpy as np

    plt = _pyplot()
    shown = []
    for domain, grid in grids.items():
        old = (before or {}).get(domain)
        if old is not None and old[0] != grid[0]:
            shown.append((domain, old))
        shown.append((domain, grid))
    panels = max(1, min(4, len(shown)))
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.8), dpi=110, squeeze=False)
    if not grids:
        _empty(axes[0][0], "recall cells (length x position)")
        return _finish(fig, path)
    for ax, (domain, (version, lengths, buckets, grid)) in zip(axes[0], shown[:panels]):
        data = np.array([[np.nan if x is None else x for x in row] for row in grid], dtype=float)
        img = ax.imshow(np.ma.masked_invalid(data), aspect="auto", cmap="RdYlGn", vmin=0.0, vmax=1.0, origin="lower")
        for (r, c), v in np.ndenumerate(data):
            if np.isfinite(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(len(buckets)), buckets, fontsize=6, rotation=45)
        ax.set_yticks(range(len(lengths)), lengths, fontsize=7)
        ax.set(
            xlabel="needle position (% of the document)",
            ylabel="length (tokens)",
            title=f"{domain}: accuracy by length x position (v{version})",
        )
        fig.colorbar(img, ax=ax, fraction=0.05, pad=0.02)
    return _finish(fig, path)


def tokens_vs_reward(path: Path, series: dict[str, list[tuple[float, float, int]]]) -> Path:
    """The per-episode capability-cost curve: mean training reward vs tokens per episode (log
    axis, shared log-spaced bins), one line per domain; marker size grows with the bin's samples."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if not series:
        _empty(ax, "episode tokens")
    for i, (domain, pts) in enumerate(sorted(series.items())):
        line = ax.plot(
            [x for x, _, _ in pts], [y for _, y, _ in pts], "-", lw=1, label=domain if i < TOP_LABELLED else None
        )
        ax.scatter(
            [x for x, _, _ in pts],
            [y for _, y, _ in pts],
            s=[8 + 4 * min(n, 30) for _, _, n in pts],
            color=line[0].get_color(),
        )
    if series:
        ax.set_xscale("log")
        ax.legend(loc="best", fontsize="small")
    ax.set(
        xlabel="tokens per episode",
        ylabel="mean training reward",
        title="reward vs tokens per episode",
        ylim=(-0.02, 1.02),
    )
    ax.grid(alpha=0.3)
    return _finish(fig, path)
