"""The long-context part of `rlbus report`: series from the run store's rows (pure functions).

Guarantees:
- `length_accuracy(evals)`: per domain whose evals carry `groups["length"]` (`EvalResult.groups`,
  `scheduler.pipeline_eval.group_scores`), the NEWEST such eval's (version, [(length, fraction
  correct)]) sorted by length; domains without length groups are left out.
- `recall_grid(evals)`: per domain whose evals carry the joint `"length|position_bucket"` group,
  the newest such eval's (version, lengths, buckets, grid[length][bucket] = fraction correct or
  None where that cell had no item), lengths and buckets in numeric order; `first=True`: the
  domain's FIRST such eval instead (lowest version: before RL), for the before/after heatmap.
- `tokens_reward(rewards, bins)`: per domain, ok training samples with recorded episode tokens
  (`rewards.tokens`) grouped into at most `bins` log-spaced token bins shared by all domains:
  [(geometric mean of the bin's tokens, mean reward, samples)], empty bins left out.
- `longctx_lines(...)`: report.md's lines for these (one per domain and view), or one line saying
  nothing was recorded.
"""

from __future__ import annotations

import math
from collections import defaultdict

JOINT = "length|position_bucket"


def _num(value: str) -> float:
    """Numeric order of a group value: `"4096"` -> 4096, `"10-20"` -> 10; non-numbers last."""
    head = str(value).split("-")[0]
    try:
        return float(head)
    except ValueError:
        return math.inf


def _newest(evals, param: str, oldest: bool = False) -> dict:
    """domain -> the newest (`oldest`: the first) eval row, by version then recording time,
    carrying group `param`."""
    out: dict = {}
    for e in sorted(evals, key=lambda e: (e.version, e.created_at), reverse=oldest):
        if (getattr(e, "groups", None) or {}).get(param):
            out[e.domain] = e
    return out


def length_accuracy(evals) -> dict[str, tuple[int, list[tuple[float, float]]]]:
    """domain -> (version, [(length, fraction correct)]) of its newest eval with length groups."""
    return {
        d: (e.version, sorted((_num(k), float(v)) for k, v in e.groups["length"].items()))
        for d, e in sorted(_newest(evals, "length").items())
    }


def recall_grid(evals, first: bool = False) -> dict[str, tuple[int, list[str], list[str], list[list[float | None]]]]:
    """domain -> (version, lengths, position buckets, grid[length][bucket]) of its newest (`first`:
    its first, the before-RL baseline) eval with the joint length x position-bucket groups."""
    out = {}
    for d, e in sorted(_newest(evals, JOINT, oldest=first).items()):
        cells = {tuple(k.split("|", 1)): float(v) for k, v in e.groups[JOINT].items() if "|" in k}
        lengths = sorted({a for a, _ in cells}, key=_num)
        buckets = sorted({b for _, b in cells}, key=_num)
        out[d] = (e.version, lengths, buckets, [[cells.get((a, b)) for b in buckets] for a in lengths])
    return out


def tokens_reward(rewards, bins: int = 8) -> dict[str, list[tuple[float, float, int]]]:
    """domain -> [(geometric-mean tokens of the bin, mean reward, samples)] over ok training
    samples with tokens > 0, in log-spaced bins shared by all domains."""
    rows = [r for r in rewards if r.purpose == "train" and r.status == "ok" and (getattr(r, "tokens", 0) or 0) > 0]
    if not rows:
        return {}
    lo, hi = math.log(min(r.tokens for r in rows)), math.log(max(r.tokens for r in rows))
    width = (hi - lo) / bins or 1.0
    acc: dict[tuple[str, int], list] = defaultdict(list)
    for r in rows:
        acc[(r.domain, min(bins - 1, int((math.log(r.tokens) - lo) / width)))].append(r)
    out: dict[str, list] = defaultdict(list)
    for (domain, _), group in sorted(acc.items()):
        mid = math.exp(sum(math.log(r.tokens) for r in group) / len(group))
        out[domain].append((mid, sum(r.reward for r in group) / len(group), len(group)))
    return dict(out)


def longctx_lines(lengths: dict, grids: dict, cost: dict) -> list[str]:
    """report.md's long-context lines (see the module guarantees)."""
    lines = []
    for d, (version, points) in lengths.items():
        shown = ", ".join(f"{int(x) if x != math.inf else '?'}: {y:.2f}" for x, y in points)
        lines.append(f"- {d} accuracy by length (v{version}): {shown}")
    for d, (version, lens, buckets, grid) in grids.items():
        worst = min(
            (
                (v, a, b)
                for a, row in zip(lens, grid, strict=True)
                for b, v in zip(buckets, row, strict=True)
                if v is not None
            ),
            default=None,
        )
        if worst is not None:
            lines.append(
                f"- {d} by length x needle position (v{version}): {len(lens)} lengths x {len(buckets)} buckets; "
                f"weakest cell length {worst[1]}, position {worst[2]}%: {worst[0]:.2f}"
            )
    for d, points in cost.items():
        n = sum(k for _, _, k in points)
        mean_tokens = math.exp(sum(math.log(x) * k for x, _, k in points) / n)
        mean_reward = sum(y * k for _, y, k in points) / n
        lines.append(
            f"- {d}: {n} episodes, {mean_tokens:.0f} tokens per episode (geometric mean), reward {mean_reward:.3f}"
        )
    return lines or ["no length groups, recall cells or episode tokens recorded"]
