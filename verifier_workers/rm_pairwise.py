"""Pairwise judging within a GRPO group: each sample's reward is its mean win rate against
the group's other samples under the reward model (issue 32, item 7).

A task asks for it with `verifier_params.mode = "pairwise"` (default `"pointwise"`); the
`model` verifier scores each sample as usual, then `verifier_workers.rm_serving` holds the
group's members until all `group_size` are in (or `verifier.rm.group_timeout_s` passes) and
replaces each `score` with its win rate.

Source: Bradley & Terry 1952 (P(i beats j) = sigma(r_i - r_j)), the model the reward
model was trained under (`learner.rm.bt_loss`).

Guarantees:
- `strength(verdict)`: the Bradley-Terry strength of a sample: the classifier's raw
  `logit` when it has one, else the log-odds of its `score` (the causal judge's
  P(yes)), clipped to [-LOGIT_CLIP, LOGIT_CLIP].
- `win_rates(strengths)`: w_i = mean over j != i of sigma(s_i - s_j). It depends only on
  the multiset of the others (a permutation of the group permutes the result the same
  way), each w_i is in (0, 1), and sum_i w_i = n / 2 exactly up to rounding (the pair
  (i, j) contributes sigma(d) + sigma(-d) = 1 over n - 1 rows). A group of one gets 0.5
  (nothing to compare with).
- `apply_pairwise(verdicts, group_ids)`: the verdicts with `score` replaced by the win
  rate among the same group_id's verdicts in the list, and the count compared with in
  the details; `correct` and `logit` unchanged; a non-Verdict (an exception) is left as
  it is and is not compared with.
"""

from __future__ import annotations

import math

from verifier_workers.verdict import Verdict

MODES = ("pointwise", "pairwise")
LOGIT_CLIP = 30.0


def is_pairwise(params: dict) -> bool:
    """Whether the task's (controlled-side) params ask for pairwise judging."""
    return params.get("mode", "pointwise") == "pairwise"


def strength(v: Verdict) -> float:
    """Bradley-Terry strength of a scored sample (module guarantees)."""
    if "logit" in v.components:
        x = float(v.components["logit"])
    else:
        p = min(max(float(v.components["score"]), 1e-12), 1 - 1e-12)
        x = math.log(p / (1 - p))
    return max(-LOGIT_CLIP, min(LOGIT_CLIP, x))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def win_rates(strengths: list[float]) -> list[float]:
    """Each sample's mean Bradley-Terry win probability against the others."""
    n = len(strengths)
    if n < 2:
        return [0.5] * n
    return [sum(_sigmoid(s - t) for j, t in enumerate(strengths) if j != i) / (n - 1) for i, s in enumerate(strengths)]


def apply_pairwise(verdicts: list, group_ids: list[str]) -> list:
    """`verdicts` with each Verdict's score its win rate within its group (module guarantees)."""
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(verdicts):
        if isinstance(v, Verdict):
            groups.setdefault(group_ids[i], []).append(i)
    out = list(verdicts)
    for idx in groups.values():
        rates = win_rates([strength(verdicts[i]) for i in idx])
        for i, w in zip(idx, rates):
            v = verdicts[i]
            out[i] = Verdict(
                {**v.components, "score": w},
                v.status,
                f"{v.details} pairwise win_rate={w:.4f} vs {len(idx) - 1} others",
                dict(v.weights),
                v.sandbox_s,
            )
    return out
