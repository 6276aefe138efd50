"""A run's report (`report.md`) and plots (`plots/*.png`) from its run store.

Guarantees:
- Reads only the SQL run store (`<run>/run.db`, or `--db-url`): the tables the recorder
  and the scheduler fill (`rewards`, `weight_versions`, `eval_results`,
  `curriculum_updates`, `gate_checks`, `dead_letters`, `runs`). It needs no NATS server
  and works on a running or a finished run; a table with no rows gives a plot that says
  "no data" rather than an error.
- Plots (matplotlib, Agg): `reward_per_domain.png` (mean training reward per domain per
  learner step of the policy version that generated it), `capability_cost.png` (eval
  score per domain vs cumulative cost: samples trained from `gate_checks` when present,
  else recorded tokens / CPU seconds, else learner step), `curriculum.png` (domain
  weights over time), `throughput_staleness.png` (scored samples per second, and the
  policy-version lag of training samples: newest published version when the sample was
  scored minus the version that generated it, a lower bound of its lag at training),
  `heldout_vs_train.png` (eval score of each held-out domain, `eval_results.purpose =
  heldout`, next to the trained domains' mean per version), `domain_heatmap.png` (domains x
  weight version -> mean training reward, domains sorted by mean reward, versions bucketed
  to at most `HEATMAP_COLUMNS` columns), `curriculum_weights.png` (stacked curriculum
  weights over time, from `curriculum_updates`), `capability_cost_curve.png` (the capability-cost
  curve: eval score per domain vs the cumulative cost recorded with each eval, one panel per
  measure: tokens, CPU seconds, sandbox seconds; a repo domain's score is its completion
  rate), and the long-context views (`rlbus.report.longctx`): `accuracy_vs_length.png` (eval accuracy
  per document length from `eval_results.groups`), `recall_heatmap.png` (recall accuracy per length
  x needle position bucket: the first eval, before RL, beside the newest), `tokens_vs_reward.png`
  (mean training reward vs tokens per episode,
  `rewards.tokens`: the per-episode capability-cost curve). With many domains, line plots name at most
  `rlbus.report.plots.TOP_LABELLED` of them.
- `report.md` is rewritten on every call (idempotent); it links the plots by relative
  path and lists evals (purpose, baseline, best, final), the released version, the plateau,
  one capability-cost line per evaluated domain (first and last score, the cost so far at
  the last) and one row per domain (tasks scored, rewards, mean reward, last curriculum level and weight).
- A run with `rlhf` domains also gets `rm_vs_rule.png` (RM score vs hidden-rule score per version),
  a report section, and `rm_divergence` in summary.json (`rlbus.report.rlhf`).
"""

from __future__ import annotations

import bisect
import os
from collections import defaultdict
from pathlib import Path

from rlbus.report.longctx import length_accuracy, longctx_lines, recall_grid, tokens_reward
from rlbus.report.plots import (
    TOP_LABELLED,
    accuracy_vs_length,
    capability_cost_curves,
    curriculum_area,
    domain_heatmap,
    heldout_vs_train,
    recall_heatmap,
    tokens_vs_reward,
)
from rlbus.report.rlhf import report_rlhf

HEATMAP_COLUMNS = 60


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    _plt().close(fig)
    return path


# -- series (pure functions of the rows) ------------------------------------------------------
def version_steps(versions) -> dict[int, int]:
    """version -> learner step (the newest announcement of a version wins)."""
    return {v.version: v.step for v in sorted(versions, key=lambda v: v.created_at)} | {0: 0}


def reward_by_domain(rewards, steps: dict[int, int]) -> dict[str, list[tuple[int, float, int]]]:
    """domain -> [(learner step of the generating version, mean reward, n)] over ok training samples."""
    acc: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in rewards:
        if r.purpose == "train" and r.status == "ok":
            acc[(r.domain, steps.get(r.policy_version, r.policy_version))].append(r.reward)
    out: dict[str, list] = defaultdict(list)
    for (domain, step), vals in sorted(acc.items()):
        out[domain].append((step, sum(vals) / len(vals), len(vals)))
    return dict(out)


def staleness(rewards, versions) -> list[tuple[float, int]]:
    """(scored at, lag) per ok training sample: newest version published by then - its policy version."""
    published = sorted((v.created_at, v.version) for v in versions)
    times = [t for t, _ in published]
    newest, best = [], -1
    for _, v in published:
        best = max(best, v)
        newest.append(best)
    out = []
    for r in sorted(rewards, key=lambda r: r.created_at):
        if r.purpose != "train" or r.status != "ok":
            continue
        i = bisect.bisect_right(times, r.created_at) - 1
        current = newest[i] if i >= 0 else 0
        out.append((r.created_at, max(0, current - r.policy_version)))
    return out


def throughput(rewards, bucket_s: float) -> list[tuple[float, float]]:
    """(bucket start, scored samples per second) for every bucket from the first to the last reward."""
    ts = sorted(r.created_at for r in rewards)
    if not ts:
        return []
    t0, counts = ts[0], defaultdict(int)
    for t in ts:
        counts[int((t - t0) // bucket_s)] += 1
    return [(t0 + k * bucket_s, counts.get(k, 0) / bucket_s) for k in range(max(counts) + 1)]


def capability_cost(evals, gates, steps: dict[int, int]) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """(cost label, domain -> [(cost, score)]) with the best cost measure available."""
    cost_of = {g.version: g.cost_samples for g in gates if g.cost_samples is not None}
    pick = [
        ("samples trained", lambda e: cost_of.get(e.version)),
        ("tokens", lambda e: e.cost_tokens),
        ("CPU seconds", lambda e: e.cost_cpu_seconds),
        ("learner step", lambda e: steps.get(e.version, e.step)),
    ]
    for label, cost in pick:
        if evals and all(cost(e) is not None for e in evals):
            out: dict[str, list] = defaultdict(list)
            for e in sorted(evals, key=lambda e: (e.version, e.created_at)):
                out[e.domain].append((float(cost(e)), e.score))
            return label, dict(out)
    return "learner step", {}


COST_MEASURES = (
    ("tokens", "cost_tokens"),
    ("CPU seconds", "cost_cpu_seconds"),
    ("sandbox seconds", "cost_sandbox_seconds"),
)
"""(label, `eval_results` column) of the cumulative costs each eval row carries (`scheduler.store`)."""


def cost_curves(evals) -> dict[str, dict[str, list[tuple[float, float, int]]]]:
    """cost label -> domain -> [(cumulative cost when recorded, eval score, version)], in recording
    order. An eval recorded before anything of that measure was (its cost NULL: e.g. the
    version-0 baseline) is at cost 0; a measure no eval carries is left out."""
    ordered = sorted(evals, key=lambda e: (e.created_at, e.version))
    out: dict[str, dict[str, list]] = {}
    for label, column in COST_MEASURES:
        costs = [getattr(e, column, None) for e in ordered]
        if all(c is None for c in costs):
            continue
        first = next(i for i, c in enumerate(costs) if c is not None)
        per: dict[str, list] = defaultdict(list)
        for i, (e, cost) in enumerate(zip(ordered, costs)):
            if cost is not None or i < first:
                per[e.domain].append((float(cost or 0.0), e.score, e.version))
        out[label] = dict(per)
    return out


def _amount(x: float) -> str:
    return f"{x:,.0f}".replace(",", " ") if x >= 100 else f"{x:.1f}"


def cost_lines(evals) -> list[str]:
    """report.md's capability-cost lines: per domain, the first and the last eval score with the
    cost so far at the last one (every measure recorded)."""
    per: dict[str, list] = defaultdict(list)
    for e in sorted(evals, key=lambda e: (e.created_at, e.version)):
        per[e.domain].append(e)
    lines = []
    for domain, es in sorted(per.items()):
        first, last = es[0], es[-1]
        spent = [
            f"{_amount(float(v))} {label}"
            for label, column in COST_MEASURES
            if (v := getattr(last, column, None)) is not None
        ]
        lines.append(
            f"- {domain}: eval score {first.score:.3f} (v{first.version}) -> {last.score:.3f} "
            f"(v{last.version}) at " + (", ".join(spent) if spent else "no recorded cost")
        )
    return lines or ["no evaluations recorded"]


def purposes(evals) -> dict[str, str]:
    """domain -> `heldout` or `train` (a domain counts as held out once any of its evals says so)."""
    out: dict[str, str] = {}
    for e in evals:
        if getattr(e, "purpose", "train") == "heldout":
            out[e.domain] = "heldout"
        else:
            out.setdefault(e.domain, "train")
    return out


def heldout_and_train_mean(
    evals, trained: set[str] | None = None
) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, float]], int]:
    """(held-out domain -> [(version, score)], [(version, mean score of the trained domains
    evaluated at that version)], number of trained domains). `trained`, when given (the run
    config's sampler domains), keeps extra sets such as the forgetting guard's general set out
    of the mean."""
    kind = purposes(evals)
    held: dict[str, dict[int, float]] = defaultdict(dict)
    train: dict[int, dict[str, float]] = defaultdict(dict)
    for e in sorted(evals, key=lambda e: (e.version, e.created_at)):  # the newest score of a version wins
        if kind[e.domain] == "heldout":
            held[e.domain][e.version] = e.score
        elif trained is None or e.domain in trained:
            train[e.version][e.domain] = e.score
    names = {d for per in train.values() for d in per}
    return (
        {d: sorted(per.items()) for d, per in held.items()},
        [(v, sum(per.values()) / len(per)) for v, per in sorted(train.items())],
        len(names),
    )


def reward_grid(rewards, max_columns: int = HEATMAP_COLUMNS) -> tuple[list[str], list[str], list[list[float | None]]]:
    """(domains sorted by mean reward, highest first (ties by name); column labels; grid of
    mean ok training reward per domain and version bucket, None where a domain has none).
    Versions are bucketed into at most `max_columns` equal ranges."""
    ok = [r for r in rewards if r.purpose == "train" and r.status == "ok" and r.policy_version >= 0]
    if not ok:
        return [], [], []
    top = max(r.policy_version for r in ok)
    width = max(1, -(-(top + 1) // max_columns))  # versions per column
    cells: dict[tuple[str, int], list[float]] = defaultdict(list)
    overall: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        cells[(r.domain, r.policy_version // width)].append(r.reward)
        overall[r.domain].append(r.reward)
    domains = sorted(overall, key=lambda d: (-sum(overall[d]) / len(overall[d]), d))
    n_cols = top // width + 1
    labels = [str(c * width) if width == 1 else f"{c * width}-{min(top, (c + 1) * width - 1)}" for c in range(n_cols)]
    grid = [[(sum(v) / len(v)) if (v := cells.get((d, c))) else None for c in range(n_cols)] for d in domains]
    return domains, labels, grid


def domain_table(rewards, updates) -> list[str]:
    """report.md's per-domain rows: tasks scored, ok training rewards, mean, and the last
    curriculum level and weight; sorted by weight, then name."""
    tasks: dict[str, set] = defaultdict(set)
    vals: dict[str, list[float]] = defaultdict(list)
    for r in rewards:
        if r.purpose == "train":
            tasks[r.domain].add(r.task_msg_id)
            if r.status == "ok":
                vals[r.domain].append(r.reward)
    last = updates[-1] if updates else None
    weights, levels = (last.weights, last.levels) if last else ({}, {})
    names = sorted(set(tasks) | set(weights), key=lambda d: (-float(weights.get(d, 0.0)), d))
    if not names:
        return ["no training rewards recorded"]
    lines = ["| domain | tasks | rewards | mean reward | level | weight |", "|---|---|---|---|---|---|"]
    for d in names:
        v = vals.get(d, [])
        lines.append(
            f"| {d} | {len(tasks.get(d, ()))} | {len(v)} | {f'{sum(v) / len(v):.3f}' if v else '-'} | "
            f"{levels.get(d, '-')} | {f'{weights[d]:.4f}' if d in weights else '-'} |"
        )
    return lines


def curriculum_series(updates, t0: float) -> tuple[list[float], dict[str, list[float]]]:
    """(seconds since start per update, domain -> its weight at each update; 0 where absent)."""
    times = [u.created_at - t0 for u in updates]
    domains = sorted({d for u in updates for d in u.weights})
    return times, {d: [float(u.weights.get(d, 0.0)) for u in updates] for d in domains}


# -- plots ------------------------------------------------------------------------------------
def plot_rewards(path: Path, series: dict[str, list]) -> Path:
    """Mean training reward per domain vs learner step."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, (domain, pts) in enumerate(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=2, label=domain if i < TOP_LABELLED else None)
    if not series:
        _no_data(ax, "training rewards")
    ax.set(xlabel="learner step of the generating policy", ylabel="mean reward", title="training reward per domain")
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="best")
    return _save(fig, path)


def plot_capability_cost(path: Path, label: str, series: dict[str, list], plateau: dict | None) -> Path:
    """Eval score per domain vs cumulative cost, with the plateau marked when detected."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for domain, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=domain)
    if plateau and plateau.get("cost") is not None:
        ax.axvline(plateau["cost"], color="gray", ls="--", label=f"plateau (v{plateau['at_version']})")
    if not series:
        _no_data(ax, "evaluations")
    ax.set(xlabel=f"cumulative cost ({label})", ylabel="eval score", title="capability vs cost", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    if series:
        ax.legend(loc="best")
    return _save(fig, path)


def plot_curriculum(path: Path, updates, t0: float) -> Path:
    """Curriculum weight of each domain over time."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    domains = sorted({d for u in updates for d in u.weights})
    for i, d in enumerate(domains):
        ax.step(
            [u.created_at - t0 for u in updates],
            [u.weights.get(d, 0.0) for u in updates],
            where="post",
            label=d if i < TOP_LABELLED else None,
        )
    if not updates:
        _no_data(ax, "curriculum updates")
    ax.set(xlabel="seconds since start", ylabel="sampling weight", title="curriculum weights", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    if domains:
        ax.legend(loc="best")
    return _save(fig, path)


def plot_throughput_staleness(path: Path, rate: list, lags: list, t0: float) -> Path:
    """Scored samples per second (top) and policy-version lag of training samples (bottom)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=110, sharex=True)
    if rate:
        a1.plot([t - t0 for t, _ in rate], [r for _, r in rate], "-")
    else:
        _no_data(a1, "rewards")
    a1.set(ylabel="samples/s", title="throughput (scored samples)")
    if lags:
        a2.plot([t - t0 for t, _ in lags], [lag for _, lag in lags], ".", ms=2, alpha=0.5)
    else:
        _no_data(a2, "training samples")
    a2.set(xlabel="seconds since start", ylabel="versions behind", title="staleness (policy version lag)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    return _save(fig, path)


# -- the report -------------------------------------------------------------------------------
def _eval_table(evals) -> list[str]:
    per: dict[str, list] = defaultdict(list)
    for e in sorted(evals, key=lambda e: (e.version, e.created_at)):
        per[e.domain].append(e)
    kind = purposes(evals)
    lines = ["| domain | purpose | n | baseline | best (version) | final (version) |", "|---|---|---|---|---|---|"]
    for domain, es in sorted(per.items(), key=lambda kv: (kind[kv[0]] != "heldout", kv[0])):
        base = next((e.score for e in es if e.version == 0), None)
        best = max(es, key=lambda e: e.score)
        last = es[-1]
        lines.append(
            f"| {domain} | {kind[domain]} | {last.n} | {'-' if base is None else f'{base:.3f}'} | "
            f"{best.score:.3f} (v{best.version}) | {last.score:.3f} (v{last.version}) |"
        )
    return lines if per else ["no evaluations recorded"]


def _plateau(gates, cost_label: str) -> dict | None:
    hit = next((g for g in gates if g.plateau), None)
    if hit is None:
        return None
    return {
        "at_version": hit.version,
        "gain_per_unit": hit.gain_per_unit,
        "cost": hit.cost_samples if cost_label == "samples trained" else None,
    }


def build_report(run_path: Path, db_url: str | None = None, run_id: str | None = None, bucket_s: float = 10.0) -> Path:
    """Write `<run>/report.md` and `<run>/plots/*.png`; returns the report's path."""
    from scheduler.store import DB_URL_ENV, open_store
    from scheduler.store_rows import (
        CurriculumUpdateRow,
        DeadLetterRow,
        EvalResultRow,
        GateCheckRow,
        RewardRow,
        RunRow,
        WeightVersionRow,
    )

    run_path = Path(run_path).resolve()
    run_id = run_id or run_path.name
    if not (db_url or os.environ.get(DB_URL_ENV)) and not (run_path / "run.db").exists():
        raise FileNotFoundError(
            f"{run_path / 'run.db'} does not exist: pass the run folder (<run-dir>/<run_id>) or --db-url"
        )
    store = open_store(db_url, run_path)
    try:
        runs = store.rows(RunRow, run_id)
        rewards = store.rows(RewardRow, run_id)
        versions = store.rows(WeightVersionRow, run_id, "created_at")
        evals = store.rows(EvalResultRow, run_id, "created_at")
        updates = store.rows(CurriculumUpdateRow, run_id, "created_at")
        gates = store.rows(GateCheckRow, run_id, "version")
        dead = store.count(DeadLetterRow, run_id)
    finally:
        store.close()
    times = [r.created_at for r in rewards] + [v.created_at for v in versions] + [u.created_at for u in updates]
    t0 = runs[0].started_at if runs else min(times, default=0.0)
    steps = version_steps(versions)
    plots = run_path / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    label, cap = capability_cost(evals, gates, steps)
    plateau = _plateau(gates, label)
    plot_rewards(plots / "reward_per_domain.png", reward_by_domain(rewards, steps))
    plot_capability_cost(plots / "capability_cost.png", label, cap, plateau)
    plot_curriculum(plots / "curriculum.png", updates, t0)
    lags = staleness(rewards, versions)
    plot_throughput_staleness(plots / "throughput_staleness.png", throughput(rewards, bucket_s), lags, t0)
    config_domains = set(((runs[0].config or {}).get("sampler") or {}).get("domains") or {}) if runs else set()
    heldout_vs_train(plots / "heldout_vs_train.png", *heldout_and_train_mean(evals, config_domains or None))
    domain_heatmap(plots / "domain_heatmap.png", *reward_grid(rewards))
    curriculum_area(plots / "curriculum_weights.png", *curriculum_series(updates, t0))
    capability_cost_curves(plots / "capability_cost_curve.png", cost_curves(evals))
    by_length, grids, per_episode = length_accuracy(evals), recall_grid(evals), tokens_reward(rewards)
    accuracy_vs_length(plots / "accuracy_vs_length.png", by_length)
    recall_heatmap(plots / "recall_heatmap.png", grids, recall_grid(evals, first=True))  # before RL beside after
    tokens_vs_reward(plots / "tokens_vs_reward.png", per_episode)
    rlhf_lines = report_rlhf(run_path, runs[0].config if runs else None, rewards, evals)  # rm_divergence

    released = max((g.version for g in gates if g.released), default=None)
    trained = [r for r in rewards if r.purpose == "train"]
    mean_lag = sum(lag for _, lag in lags) / len(lags) if lags else None
    md = [
        f"# Run {run_id}",
        "",
        f"- status: {runs[0].status if runs else 'unknown'}",
        f"- training samples scored: {len(trained)} ({sum(r.status == 'ok' for r in trained)} ok), "
        f"dead letters: {dead}",
        f"- weight versions: {len({v.version for v in versions})}, newest step: {max(steps.values(), default=0)}",
        f"- released version: {'none' if released is None else released} (release gate, `scheduler.gates`)",
        "- plateau: "
        + (
            f"detected at v{plateau['at_version']} (gain {plateau['gain_per_unit']:.4g} per 1000 samples)"
            if plateau
            else "not detected"
        ),
        f"- forgetting guard trips: {sum(g.forgetting for g in gates)}",
        f"- mean policy-version lag of training samples: {'-' if mean_lag is None else f'{mean_lag:.2f}'}",
        "",
        "## Evaluation",
        "",
        *_eval_table(evals),
        "",
        "## Plots",
        "",
        "![reward per domain](plots/reward_per_domain.png)",
        "",
        f"![capability vs cost](plots/capability_cost.png) (cost: {label})",
        "",
        "![curriculum weights](plots/curriculum.png)",
        "",
        "![throughput and staleness](plots/throughput_staleness.png)",
        "",
        "![held-out vs trained domains](plots/heldout_vs_train.png)",
        "",
        "![mean reward by domain and version](plots/domain_heatmap.png)",
        "",
        "![curriculum weights, stacked](plots/curriculum_weights.png)",
        "",
        "## Capability vs cost",
        "",
        "![eval score vs cumulative tokens, CPU and sandbox seconds](plots/capability_cost_curve.png)",
        "",
        *cost_lines(evals),
        "",
        "## Long context",
        "",
        "![eval accuracy vs document length](plots/accuracy_vs_length.png)",
        "",
        "![recall by length and needle position](plots/recall_heatmap.png)",
        "",
        "![training reward vs tokens per episode](plots/tokens_vs_reward.png)",
        "",
        *longctx_lines(by_length, grids, per_episode),
        "",
        "## Domains",
        "",
        *domain_table(rewards, updates),
        "",
        *rlhf_lines,
    ]
    out = run_path / "report.md"
    out.write_text("\n".join(md))
    return out
