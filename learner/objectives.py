"""The GRPO loss family: GRPO, Dr. GRPO, DAPO, GSPO, and KL estimators k1 / k3.

Each objective is a config choice (``objective_loss(kind=...)``); the building
blocks (advantages, dynamic sampling, overlong shaping, KL) are separate pure
functions so a trainer can compose them.

Sources (read from the papers):

* GRPO -- Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical
  Reasoning in Open Language Models", arXiv:2402.03300, eq. 3 (per-sequence
  token mean ``1/|o_i|``, then mean over the ``G`` sequences) and sec. 4.1.2
  (std-normalised group advantages, see :func:`learner.losses.group_advantages`).
* Dr. GRPO -- Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective", arXiv:2503.20783, sec. 3.2: drop the ``1/|o_i|`` length
  normalisation and the ``std`` division; the token sum is divided by a
  constant (the generation budget ``max_len``) so no length bias appears.
* DAPO -- Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
  System at Scale", arXiv:2503.14476: clip-higher (``eps_low`` /
  ``eps_high``, sec. 3.1), dynamic sampling (drop groups whose rewards are
  all equal, sec. 3.2, eq. 11 constraint ``0 < |{correct}| < G``),
  token-level policy-gradient loss (``1 / sum_i |o_i|``, sec. 3.3, eq. 12),
  overlong reward shaping (soft punishment, sec. 3.4, eq. 13).
* GSPO -- Zheng et al. 2025, "Group Sequence Policy Optimization",
  arXiv:2507.18071, eq. 5-7: sequence-level importance ratio
  ``s_i = exp(1/|y_i| * sum_t (log pi_new - log pi_old))`` (length-normalised
  geometric mean of token ratios), clipped at the sequence level, objective
  averaged over the sequences of the group.
* KL estimators -- J. Schulman, "Approximating KL Divergence" (2020): k1 =
  ``log pi_new - log pi_ref`` (unbiased, may be negative per token), k3 =
  ``(r - 1) - log r`` with ``r = pi_ref / pi_new`` (unbiased, ``>= 0``, the
  GRPO choice). Both estimate ``KL(pi_new || pi_ref)`` on tokens sampled from
  the policy.

Guarantees (the same as :func:`learner.losses.policy_loss`): pure, vectorised,
gradients only into ``logp_new``; masked-out tokens (even ``inf`` / ``NaN``)
affect neither loss nor gradient; ``beta == 0`` never reads ``logp_ref``;
``stats.loss == stats.pg_loss + beta * stats.kl``.
"""

from __future__ import annotations

from typing import Literal

import torch

from learner.losses import (
    LossStats,
    MaskedTokens,
    check_loss_inputs,
    clipped_objective,
    group_advantages,
    kl_k3,
    policy_loss,
)

__all__ = [
    "KINDS",
    "KL_ESTIMATORS",
    "aggregate_tokens",
    "LossStats",
    "compute_advantages",
    "dr_grpo_advantages",
    "dynamic_sampling_mask",
    "kl_k1",
    "objective_loss",
    "overlong_penalty",
]

Kind = Literal["grpo", "dr_grpo", "dapo", "gspo"]
KINDS: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


# --------------------------------------------------------------------------- KL


def kl_k1(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of ``KL(pi_new || pi_ref)``: ``logp_new - logp_ref``.

    Source: J. Schulman, "Approximating KL Divergence" (2020), estimator
    ``k1 = -log r`` with ``r = pi_ref / pi_new``. Unbiased on samples from
    ``pi_new`` but high-variance and negative on individual tokens where the
    reference is more likely than the policy. Elementwise, same shape as the
    broadcast inputs.
    """
    return logp_new - logp_ref


# ------------------------------------------------------------------ advantages


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO advantages ``A_i = r_i - mean(r of i's group)`` (no std division).

    Source: Liu et al. 2025, arXiv:2503.20783, sec. 3.2 (removing the
    ``std({R})`` normaliser, which up-weights questions of very low or very
    high difficulty). Delegates to :func:`learner.losses.group_advantages`
    with ``normalize_std=False``: groups of size 1 and all-equal groups get
    exactly 0.
    """
    return group_advantages(rewards, group_ids, normalize_std=False)


def compute_advantages(kind: Kind, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """The advantage each objective's paper uses.

    ``dr_grpo`` -> :func:`dr_grpo_advantages` (no std); ``grpo``, ``dapo``
    (DAPO eq. 10 keeps GRPO's ``(R - mean) / std``) and ``gspo`` (GSPO eq. 6,
    same group normalisation) -> std-normalised :func:`group_advantages`.
    """
    _check_kind(kind)
    if kind == "dr_grpo":
        return dr_grpo_advantages(rewards, group_ids)
    return group_advantages(rewards, group_ids, normalize_std=True)


# ------------------------------------------------------------ dynamic sampling


def dynamic_sampling_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DAPO dynamic sampling: keep only groups whose rewards are not all equal.

    Source: Yu et al. 2025, arXiv:2503.14476, sec. 3.2 and the constraint of
    eq. 11 (``0 < |{o_i | is_equivalent(a, o_i)}| < G``), generalised from a
    binary accuracy reward to "reward variance > 0": a group with zero
    variance has all advantages 0 and contributes no gradient, so it is
    dropped (the paper then over-samples to refill the batch; that is the
    caller's job). A group of size 1 has zero variance and is dropped too.
    Equality is exact (``max == min``), no tolerance.

    Args:
        rewards: ``[N]`` rewards.
        group_ids: ``[N]`` integer group ids (any values, any order).

    Returns:
        ``(keep_mask, n_dropped_groups)``: ``keep_mask`` is a ``[N]`` bool
        tensor, True for samples of kept groups; ``n_dropped_groups`` counts
        dropped *groups* (not samples).
    """
    if rewards.dim() != 1 or group_ids.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device), 0
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max().item()) + 1
    gmax = torch.full((n_groups,), float("-inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, reduce="amax", include_self=True
    )
    gmin = torch.full((n_groups,), float("inf"), dtype=r.dtype, device=r.device).scatter_reduce(
        0, inv, r, reduce="amin", include_self=True
    )
    keep_group = gmax != gmin
    return keep_group[inv], int((~keep_group).sum().item())


# ------------------------------------------------------------ overlong shaping


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    With ``L_max = max_len`` and ``L_cache = cache_len``::

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                    = -1                                 if L_max < |y|

    The value is *added* to the task reward by the caller. Returns a float
    tensor of the shape of ``lengths`` (default dtype unless ``lengths`` is
    floating).
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    n = lengths.detach()
    if not n.is_floating_point():
        n = n.to(torch.get_default_dtype())
    start = float(max_len - cache_len)
    ramp = (start - n) / float(cache_len)
    zero = torch.zeros_like(n)
    out = torch.where(n <= start, zero, ramp)
    return torch.where(n > float(max_len), torch.full_like(n, -1.0), out)


# ------------------------------------------------------------------ objectives


def aggregate_tokens(kind: Kind, tok: torch.Tensor, mask: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values ``[B, T]`` (0 outside ``mask``) to a scalar as ``kind`` does.

    ``grpo`` / ``gspo`` (its KL term): mean over each sequence's masked tokens, then mean
    over sequences with >= 1 token; ``dr_grpo``: sum / (``B * max_len``, ``max_len``
    defaulting to ``T``); ``dapo``: sum / number of masked tokens. Zero masked tokens
    give a graph-connected 0.
    """
    _check_kind(kind)
    m = (mask != 0).to(tok.dtype)
    if kind == "dr_grpo":
        const = float(tok.shape[0] * (max_len or tok.shape[1])) if tok.shape[0] > 0 else 1.0
        return tok.sum() / const
    if kind == "dapo":
        return tok.sum() / m.sum().clamp_min(1.0)
    n_tok = m.sum(dim=1)
    has_tok = n_tok > 0
    seq = tok.sum(dim=1) / n_tok.clamp_min(1.0)
    return torch.where(has_tok, seq, torch.zeros_like(seq)).sum() / has_tok.to(tok.dtype).sum().clamp_min(1.0)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown objective kind {kind!r}; expected one of {KINDS}")


def objective_loss(
    kind: Kind,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    kl: Literal["k3", "k1"] = "k3",
    logp_ref: torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """One loss of the GRPO family (see the module docstring for the papers).

    Shapes: ``logp_new`` / ``logp_behavior`` / ``mask`` / ``logp_ref`` are
    ``[B, T]``, ``advantages`` is ``[B]``. Gradients flow only into
    ``logp_new``. ``ratio`` is clipped to ``[1 - clip_low, 1 + clip_high]``
    (``clip_high > clip_low`` is DAPO's clip-higher). The KL term is
    ``beta * kl_tok`` with ``kl_tok`` = :func:`kl_k3` or :func:`kl_k1`, and is
    aggregated exactly like the policy-gradient term.

    Per kind (``o`` = objective ``min(ratio * A, clip(ratio) * A)``):

    * ``grpo``: token ratio; mean over each sequence's masked tokens, then
      mean over sequences with >= 1 token (GRPO eq. 3). With ``kl="k3"`` this
      delegates to :func:`learner.losses.policy_loss` unchanged.
    * ``dr_grpo``: token ratio; sum over all masked tokens divided by the
      constant ``B * max_len`` (Dr. GRPO sec. 3.2). ``max_len`` defaults to
      ``T = mask.shape[1]``; pass the generation budget for a constant that
      does not depend on the batch.
    * ``dapo``: token ratio; sum over all masked tokens divided by the number
      of masked tokens in the batch (DAPO eq. 12).
    * ``gspo``: sequence ratio ``s_i = exp(mean_t(logp_new - logp_behavior))``
      over masked tokens; ``o_i = min(s_i A_i, clip(s_i) A_i)``; mean over
      sequences with >= 1 token (GSPO eq. 5-7). GSPO's clip ranges are much
      smaller than token-level ones (the paper uses 3e-4 / 4e-4).

    ``max_len`` is ignored for kinds other than ``dr_grpo``. ``beta == 0``
    never reads ``logp_ref`` (it may be ``None``); ``beta > 0`` requires it.

    Returns ``(loss, stats)`` with a :class:`learner.losses.LossStats`:
    ``loss == pg_loss + beta * kl``; for token kinds ``clip_frac`` and the
    ratio stats are over masked tokens, for ``gspo`` over sequences with >= 1
    token (the sequence ratios ``s_i``); ``tokens`` is the masked-token count.
    ``clip_frac`` counts entries whose clipped branch is strictly selected
    (zero policy gradient). With no masked token the loss is a
    graph-connected 0 and ratio stats are NaN.
    """
    _check_kind(kind)
    if kl not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kl!r}; expected one of {KL_ESTIMATORS}")
    if kind == "grpo" and kl == "k3":
        return policy_loss(
            logp_new,
            logp_behavior,
            advantages,
            mask,
            clip_low=clip_low,
            clip_high=clip_high,
            beta=beta,
            logp_ref=logp_ref if beta > 0.0 else None,
        )

    # ---- validation (same contract as policy_loss)
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, T], got shape {tuple(logp_new.shape)}")
    shape = logp_new.shape
    use_kl = check_loss_inputs(
        logp_new, logp_behavior, advantages, mask, clip_low=clip_low, clip_high=clip_high, beta=beta, logp_ref=logp_ref
    )
    if kind == "dr_grpo":
        if max_len is None:
            max_len = int(shape[1])
        if max_len <= 0:
            raise ValueError(f"dr_grpo needs max_len > 0, got {max_len}")

    mt = MaskedTokens(logp_new, logp_behavior, mask)  # padding sanitised before exp (see there)
    m, zero, has_tok, log_ratio = mt.m, mt.zero, mt.has_tok, mt.log_ratio
    adv = advantages.detach().to(mt.dtype)
    total_tok = mt.mf.sum()

    if kind == "dr_grpo":
        const = float(shape[0] * max_len) if shape[0] > 0 else 1.0

        def aggregate(tok: torch.Tensor) -> torch.Tensor:
            return tok.sum() / const

    elif kind == "dapo":

        def aggregate(tok: torch.Tensor) -> torch.Tensor:
            return tok.sum() / total_tok.clamp_min(1.0)

    else:  # grpo (k1 path) and gspo's KL term
        aggregate = mt.seq_then_batch_mean

    if kind == "gspo":
        seq_log_ratio = torch.where(has_tok, log_ratio.sum(dim=1) / mt.denom_tok, zero)
        ratio = torch.exp(seq_log_ratio)  # [B]
        objective, is_clipped = clipped_objective(ratio, adv, clip_low, clip_high, has_tok)
        pg_loss = torch.where(has_tok, -objective, zero).sum() / mt.n_seq
        stat_sel = has_tok
    else:
        ratio = torch.exp(log_ratio)  # [B, T]
        objective, is_clipped = clipped_objective(ratio, adv.unsqueeze(1), clip_low, clip_high, m)
        pg_loss = aggregate(torch.where(m, -objective, zero))
        stat_sel = m

    if use_kl:
        assert logp_ref is not None
        est = kl_k3 if kl == "k3" else kl_k1
        kl_term = aggregate(mt.kl_tokens(est, logp_new, logp_ref))
        loss = pg_loss + beta * kl_term
        kl_val = float(kl_term.detach())
    else:
        loss = pg_loss
        kl_val = 0.0

    stats = LossStats.collect(loss, pg_loss, kl_val, ratio, stat_sel, is_clipped, tokens=int(m.sum().item()))
    return loss, stats
