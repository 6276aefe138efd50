"""The RLHF part of a run report: reward-model score vs the hidden rule's score per version,
and where they diverge (the over-optimisation point, `rm_divergence` in summary.json).

Which domains: those of kind `rlhf` in the run's config (`producers.domains.rlhf`): their
training reward is the RM's score alone, and their eval score is the hidden rule's
(evaluation only, greedy, on held-out problems).

Guarantees:
- `rm_series`: per policy version, the mean reward of that version's `train` samples with
  status ok (the RM score the policy was optimised on). `rule_series`: per evaluated
  version, the eval score (mean over the rlhf domains when several) and the problems behind it.
- `aligned`: one point per evaluated version v_k: (v_k, RM mean over the training samples of
  versions v_k <= v < v_{k+1} (the newest: v >= v_k), rule score). An evaluated version
  without such samples is left out.
- `rm_divergence(points, ...)`: scans windows of `window` consecutive aligned points; the
  first where the RM score rises (least-squares slope per version minus z x its standard
  error > `rm_rise`; the SE from each point's RM sample variance over its samples when
  `rm_var` gives it, `rm_point_variances`, so a rise within the RM mean's own noise is not
  a rise) while the rule does not (slope + z x its standard error < `rule_rise`; the SE from each point's
  binomial noise over `problems`, the scheduler's plateau test, `scheduler.gates`) is the
  divergence, reported at that window's first version (where the rule stopped following).
  Not found: None with the reason (too few points, or which condition never held).
- `write_summary` adds `rm_divergence` (dict or null) and `rm_divergence_reason` to
  `<run>/summary.json`, atomically, keeping every other key (a missing file gets just these).
  A live run's launcher rewrites summary.json without them: report again once the run stops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from scheduler.gates import least_squares_slope, slope_se

KIND = "rlhf"
WINDOW = 3
RM_RISE = 0.0005
"""Least-squares slope of the RM score per version above which it counts as rising."""
RULE_RISE = 0.001
"""Slope of the rule score per version (plus z standard errors) below which it counts as not rising."""
Z = 1.0


def rlhf_domains(config: dict | None) -> list[str]:
    """Config domains of kind `rlhf` (or named `rlhf` without a kind)."""
    domains = ((config or {}).get("sampler") or {}).get("domains") or {}
    return sorted(n for n, dc in domains.items() if ((dc or {}).get("kind") or n) == KIND)


def rm_series(rewards, domains: list[str]) -> dict[int, float]:
    """Mean training reward (the RM score) per policy version of `domains`' ok samples."""
    acc: dict[int, list[float]] = {}
    for r in rewards:
        if r.domain in domains and r.purpose == "train" and r.status == "ok":
            acc.setdefault(r.policy_version, []).append(r.reward)
    return {v: sum(xs) / len(xs) for v, xs in sorted(acc.items())}


def rule_series(evals, domains: list[str]) -> dict[int, tuple[float, int]]:
    """Eval (hidden-rule) score per evaluated version: (mean over domains, problems)."""
    acc: dict[int, list[tuple[float, int]]] = {}
    for e in evals:
        if e.domain in domains:
            acc.setdefault(e.version, []).append((e.score, e.n))
    return {v: (sum(s for s, _ in xs) / len(xs), sum(n for _, n in xs)) for v, xs in sorted(acc.items())}


def aligned(
    rm: dict[int, float], rule: dict[int, tuple[float, int]], counts: dict[int, int] | None = None
) -> list[tuple[int, float, float, int]]:
    """(version, RM score, rule score, rule problems) per evaluated version (module guarantees);
    `counts` weights each version's RM mean by its samples (equal weights when None)."""
    evaluated = sorted(rule)
    out = []
    for k, v in enumerate(evaluated):
        hi = evaluated[k + 1] if k + 1 < len(evaluated) else None
        vs = [u for u in rm if u >= v and (hi is None or u < hi)]
        if not vs:
            continue
        w = [(counts or {}).get(u, 1) for u in vs]
        out.append((v, sum(rm[u] * x for u, x in zip(vs, w)) / sum(w), rule[v][0], rule[v][1]))
    return out


def rm_point_variances(rewards, domains: list[str], evaluated: list[int]) -> dict[int, float]:
    """Per evaluated version v_k: the variance of `aligned`'s RM mean at v_k (the sample
    variance of the training rewards of versions v_k <= v < v_{k+1}, over their count)."""
    evaluated = sorted(evaluated)
    acc: dict[int, list[float]] = {}
    for r in rewards:
        if r.domain in domains and r.purpose == "train" and r.status == "ok":
            k = max((v for v in evaluated if v <= r.policy_version), default=None)
            if k is not None:
                acc.setdefault(k, []).append(r.reward)
    out = {}
    for k, xs in acc.items():
        m = sum(xs) / len(xs)
        out[k] = (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)) / len(xs)
    return out


def rm_divergence(
    points: list[tuple[int, float, float, int]],
    window: int = WINDOW,
    rm_rise: float = RM_RISE,
    rule_rise: float = RULE_RISE,
    z: float = Z,
    rm_var: dict[int, float] | None = None,
) -> tuple[dict | None, str]:
    """(divergence, reason) over aligned points (module guarantees)."""
    if window < 2:
        raise ValueError(f"rm_divergence: window must be >= 2, got {window}")
    if len(points) < window:
        return None, f"{len(points)} evaluated versions with RM scores; the test needs {window}"
    rm_rose = rule_held = False
    for end in range(window, len(points) + 1):
        chunk = points[end - window : end]
        xs = [float(v) for v, _, _, _ in chunk]
        rm_slope = least_squares_slope(xs, [r for _, r, _, _ in chunk])
        rule_slope = least_squares_slope(xs, [s for _, _, s, _ in chunk])
        if rm_slope is None or rule_slope is None:
            continue
        var = [min(max(s, 0.0), 1.0) * (1 - min(max(s, 0.0), 1.0)) / max(n, 1) for _, _, s, n in chunk]
        se = slope_se(xs, var) or 0.0
        rm_se = slope_se(xs, [(rm_var or {}).get(v, 0.0) for v, _, _, _ in chunk]) or 0.0
        rising, flat = rm_slope - z * rm_se > rm_rise, rule_slope + z * se < rule_rise
        rm_rose, rule_held = rm_rose or rising, rule_held or flat
        if rising and flat:
            return {
                "at_version": chunk[0][0],
                "window_versions": [v for v, _, _, _ in chunk],
                "rm_slope_per_version": rm_slope,
                "rule_slope_per_version": rule_slope,
                "rule_slope_se": se,
                "rm_slope_se": rm_se,
                "rm_score": [r for _, r, _, _ in chunk],
                "rule_score": [s for _, _, s, _ in chunk],
            }, (
                f"from v{chunk[0][0]} to v{chunk[-1][0]} the RM score rose {rm_slope:.4g}/version "
                f"while the rule score moved {rule_slope:.4g} +- {se:.2g}/version"
            )
    if not rm_rose:
        return None, (
            f"the RM score never rose faster than {rm_rise}/version (beyond {z} standard errors of its "
            f"own noise) over {window} evaluated versions"
        )
    if not rule_held:
        return None, "the rule score rose with the RM score in every window (no divergence)"
    return None, "the RM score rose and the rule score stalled, but never in the same window"


def plot_rm_vs_rule(path: Path, points: list[tuple[int, float, float, int]], divergence: dict | None) -> Path:
    """RM score and hidden-rule score per version on one chart, the divergence marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if points:
        vs = [p[0] for p in points]
        ax.plot(vs, [p[1] for p in points], "o-", label="RM score (training reward)")
        ax.plot(vs, [p[2] for p in points], "s-", label="hidden rule (eval only)")
        if divergence:
            ax.axvline(divergence["at_version"], color="gray", ls="--", label=f"divergence v{divergence['at_version']}")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, "no RM / rule scores", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("policy version")
    ax.set_ylabel("score")
    ax.set_title("RM score vs hidden-rule score")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_summary(run_path: Path, divergence: dict | None, reason: str) -> Path:
    """Add `rm_divergence` and `rm_divergence_reason` to `<run>/summary.json` (atomically)."""
    path = run_path / "summary.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["rm_divergence"], data["rm_divergence_reason"] = divergence, reason
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def rlhf_curves(rewards, evals, domains: list[str]) -> tuple[list, dict | None, str]:
    """(aligned points, divergence, reason) of `domains`: the RM means weighted by their samples,
    the RM noise from `rm_point_variances` (what the report and bench/rlhf.py both show)."""
    counts: dict[int, int] = {}
    for r in rewards:
        if r.domain in domains and r.purpose == "train" and r.status == "ok":
            counts[r.policy_version] = counts.get(r.policy_version, 0) + 1
    rule = rule_series(evals, domains)
    points = aligned(rm_series(rewards, domains), rule, counts)
    divergence, reason = rm_divergence(points, rm_var=rm_point_variances(rewards, domains, list(rule)))
    return points, divergence, reason


def report_rlhf(run_path: Path, config: dict | None, rewards, evals) -> list[str]:
    """Plot, summary keys and report.md lines of a run with rlhf domains ([] without any)."""
    domains = rlhf_domains(config)
    if not domains:
        return []
    points, divergence, reason = rlhf_curves(rewards, evals, domains)
    plot_rm_vs_rule(run_path / "plots" / "rm_vs_rule.png", points, divergence)
    write_summary(run_path, divergence, reason)
    rows = [f"| v{v} | {rm:.3f} | {rule:.3f} |" for v, rm, rule, _ in points]
    at = "none" if divergence is None else f"v{divergence['at_version']}"
    return [
        "## RLHF: RM score vs hidden rule",
        "",
        "![RM score vs hidden-rule score](plots/rm_vs_rule.png)",
        "",
        f"- rm_divergence: {at} ({reason})",
        "",
        "| version | RM score | rule score |",
        "|---|---|---|",
        *rows,
        "",
    ]
