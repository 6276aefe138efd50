"""Off-policy correction for stale samples: truncated IS and decoupled PPO.

The rollout workers sample with an older policy version ``mu`` (the *behaviour*
policy, whose log-probs travel in each trajectory). Samples more than
``max_staleness`` versions old are dropped before this module is reached
(:func:`learner.groups.split_stale`, fate reason ``stale``); the rest are corrected
here. Three modes (``learner.off_policy.mode``):

* ``none`` -- the GRPO-family loss of :mod:`learner.objectives` with the PPO ratio
  taken directly against the behaviour log-probs.
* ``tis`` -- truncated importance sampling. Source: Espeholt et al. 2018, "IMPALA",
  arXiv:1802.01561, sec. 4.1 (truncated weights ``rho_bar``) and Yao et al. 2025,
  "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS, cap
  ``C``). Per token ``w = min(pi_prox / mu, C)`` (detached) and the surrogate
  ``-w * A * pi_theta / sg(pi_theta)``: value ``-w A``, gradient ``-w A grad log pi``.
  No PPO clip: the learner takes one optimizer step per batch, so the ratio of the
  policy being trained to the proximal policy is exactly 1 and the clip never binds.
* ``decoupled`` -- decoupled PPO. Source: Hilton et al. 2022, "Batch
  size-invariance for policy optimization", arXiv:2110.00641, eq. 2 (the proximal
  policy separates the clipping centre from the behaviour policy); as in AReaL (Fu et
  al. 2025, arXiv:2505.24298, eq. 5) the proximal policy is the current policy before
  the step, computed without gradients, and the behaviour->proximal weight is
  truncated at ``C``. Per token, ``r = pi_theta / pi_prox``::

      loss_t = -w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  w = min(pi_prox / mu, C)

Guarantees: pure functions; gradients flow only into ``logp_new``; ``w``, ``A`` and
``logp_prox`` are constants; masked-out tokens (even ``inf`` / ``NaN``) affect neither
loss nor gradient; the per-token terms are reduced exactly as the chosen objective
reduces them (:func:`learner.objectives.aggregate_tokens`), so micro-batch scaling and
KL handling match the ``none`` path; ``beta == 0`` never reads ``logp_ref``; the stats
report the untruncated weights (mean, max) and the fraction of tokens truncated.
Sequence-level GSPO has no token weights and is rejected.
"""

from __future__ import annotations

from typing import Literal

import torch

from learner.losses import LossStats, check_loss_inputs, kl_k3
from learner.objectives import aggregate_tokens, kl_k1

__all__ = ["MODES", "importance_weights", "offpolicy_loss"]

MODES: tuple[str, ...] = ("none", "tis", "decoupled")


def importance_weights(
    logp_prox: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, rho, truncated)``: ``rho = exp(logp_prox - logp_behavior)`` on masked tokens
    (1 elsewhere), ``w = min(rho, cap)``, ``truncated = rho > cap`` on masked tokens. Detached."""
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    m = mask != 0
    with torch.no_grad():
        zero = torch.zeros((), dtype=logp_prox.dtype, device=logp_prox.device)
        rho = torch.exp(torch.where(m, logp_prox.detach() - logp_behavior.to(logp_prox.dtype), zero))
        return rho.clamp(max=cap), rho, (rho > cap) & m


def offpolicy_loss(
    mode: Literal["tis", "decoupled"],
    kind: str,
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    kl: str = "k3",
    logp_ref: torch.Tensor | None = None,
    logp_prox: torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Off-policy-corrected loss of a token-level GRPO-family objective (see module docstring).

    ``logp_prox`` defaults to ``logp_new.detach()``: with one optimizer step per batch
    the policy before the step *is* the current policy. Pass it explicitly when taking
    several steps on one batch (compute it once, under ``no_grad``, before the first).
    ``kind`` picks the reduction (``grpo``, ``dr_grpo``, ``dapo``); the KL term (when
    ``beta > 0``) is the unweighted k1/k3 estimate reduced the same way.
    Returns ``(loss, stats)``; ``stats.ratio_*`` / ``clip_frac`` describe ``r`` (always
    1 / 0 for ``tis``), ``stats.is_*`` the weights ``pi_prox / mu``.
    """
    if mode not in ("tis", "decoupled"):
        raise ValueError(f"unknown off-policy mode {mode!r}; expected 'tis' or 'decoupled'")
    if kind == "gspo":
        raise ValueError("off_policy tis/decoupled needs a token-level objective (grpo, dr_grpo, dapo), not gspo")
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, T], got shape {tuple(logp_new.shape)}")
    use_kl = check_loss_inputs(
        logp_new, logp_behavior, advantages, mask, clip_low=clip_low, clip_high=clip_high, beta=beta, logp_ref=logp_ref
    )
    m = mask != 0
    dtype = logp_new.dtype
    zero = torch.zeros((), dtype=dtype, device=logp_new.device)
    prox = (logp_new if logp_prox is None else logp_prox).detach().to(dtype)
    w, rho, truncated = importance_weights(
        torch.where(m, prox, zero), torch.where(m, logp_behavior.to(dtype), zero), m, cap
    )
    ratio = torch.exp(torch.where(m, logp_new - prox, zero))  # pi_theta / pi_prox
    adv = advantages.detach().to(dtype).unsqueeze(1)
    if mode == "tis":
        objective = ratio * adv
        is_clipped = torch.zeros_like(m)
    else:
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
        is_clipped = (clipped < unclipped) & m
        objective = torch.where(is_clipped, clipped, unclipped)
    pg_loss = aggregate_tokens(kind, torch.where(m, -w * objective, zero), m, max_len)
    loss, kl_val = pg_loss, 0.0
    if use_kl:
        est = kl_k3 if kl == "k3" else kl_k1
        kl_tok = torch.where(
            m, est(torch.where(m, logp_new, zero), torch.where(m, logp_ref.detach().to(dtype), zero)), zero
        )
        kl_term = aggregate_tokens(kind, kl_tok, m, max_len)
        loss, kl_val = pg_loss + beta * kl_term, float(kl_term.detach())
    stats = LossStats.collect(loss, pg_loss, kl_val, ratio, m, is_clipped, tokens=int(m.sum().item()))
    n = int(m.sum().item())
    if n:
        stats.is_weight_mean, stats.is_weight_max = float(rho[m].mean()), float(rho[m].max())
        stats.is_truncated_frac = float(truncated.sum().item()) / n
    return loss, stats
