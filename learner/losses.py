"""GRPO / PPO-clip losses as pure torch functions.

Guarantees
----------
* Pure: no module state, no I/O, no in-place modification of any argument.
* Vectorised: no Python loop over samples, sequences or tokens; every
  reduction is a tensor op (``index_add`` / ``scatter_reduce`` / masked sums).
* Group advantages: a group of size 1, or a group whose rewards are all equal,
  gets advantage exactly 0 (never NaN, never ``residue / eps``).
* ``kl_k3`` is elementwise and ``>= 0`` (it is computed with ``expm1`` for
  accuracy near 0 and clamped at 0 against rounding).
* ``policy_loss``:
    - gradients flow only into ``logp_new``; ``logp_behavior``,
      ``advantages`` and ``logp_ref`` are treated as constants (detached);
    - tokens outside ``mask`` influence neither the loss nor its gradient,
      even if they hold ``inf`` / ``NaN`` (they are replaced before any
      ``exp``), and their gradient is exactly 0;
    - a token whose clipped branch is selected contributes gradient exactly 0
      through the policy-gradient term;
    - sequences with no masked token are left out of the mean; if no sequence
      has a masked token the loss is a graph-connected 0 (zero gradient,
      no NaN);
    - ``beta == 0`` never reads ``logp_ref`` (it may be ``None``);
    - ``stats.loss == stats.pg_loss + beta * stats.kl`` (up to rounding),
      all stats are detached Python numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossStats", "group_advantages", "kl_k3", "policy_loss"]


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages of GRPO.

    Source: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
    Mathematical Reasoning in Open Language Models", arXiv:2402.03300,
    sec. 4.1.2 (outcome supervision: ``A_i = (r_i - mean(r)) / std(r)`` over
    the group of completions sampled for one prompt).

    Args:
        rewards: ``[N]`` float rewards.
        group_ids: ``[N]`` integer ids (arbitrary values, need not be
            contiguous or sorted); samples of one group share an id.
        normalize_std: divide by ``std(group, unbiased=False) + eps``.
        eps: added to the std before dividing.

    Returns:
        ``[N]`` advantages ``r_i - mean(group)`` (optionally std-normalised).
        Groups of size 1 and groups with all-equal rewards get exactly 0.

    Vectorised with ``torch.unique`` + ``index_add`` / ``scatter_reduce``.
    """
    if rewards.dim() != 1 or group_ids.dim() != 1:
        raise ValueError(f"rewards and group_ids must be 1-D, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if rewards.shape[0] != group_ids.shape[0]:
        raise ValueError(f"rewards ({rewards.shape[0]}) and group_ids ({group_ids.shape[0]}) must have the same length")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    if r.numel() == 0:
        return r.clone()

    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max().item()) + 1
    zeros = r.new_zeros(n_groups)

    counts = zeros.index_add(0, inv, torch.ones_like(r))
    mean = zeros.index_add(0, inv, r) / counts
    centered = r - mean[inv]

    gmax = torch.full_like(zeros, float("-inf")).scatter_reduce(0, inv, r, reduce="amax", include_self=True)
    gmin = torch.full_like(zeros, float("inf")).scatter_reduce(0, inv, r, reduce="amin", include_self=True)
    degenerate = (counts < 2) | (gmax == gmin)

    adv = centered
    if normalize_std:
        var = zeros.index_add(0, inv, centered * centered) / counts  # biased
        adv = centered / (var.sqrt()[inv] + eps)
    return torch.where(degenerate[inv], torch.zeros_like(adv), adv)


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi_new || pi_ref)``.

    Source: J. Schulman, "Approximating KL Divergence" (blog note, 2020),
    estimator k3 = ``(r - 1) - log r`` with ``r = pi_ref / pi_new`` evaluated
    on tokens sampled from ``pi_new``; used as the KL penalty in GRPO
    (Shao et al. 2024, arXiv:2402.03300, eq. 4).

    Returns ``exp(ref - new) - (ref - new) - 1`` elementwise (same shape as
    the broadcast inputs), unbiased for the KL and ``>= 0``.
    """
    d = logp_ref - logp_new
    return (torch.expm1(d) - d).clamp_min(0.0)


@dataclass
class LossStats:
    """Detached diagnostics of one ``policy_loss`` call.

    ``pg_loss`` and ``kl`` use the same aggregation as ``loss`` (per-sequence
    token mean, then mean over sequences), so ``loss == pg_loss + beta * kl``.
    ``kl`` is 0.0 when ``beta == 0`` (the KL term is not computed then).
    ``clip_frac`` and the ratio stats are over masked tokens (token level);
    ratio stats are NaN when ``tokens == 0``.
    """

    loss: float
    pg_loss: float
    kl: float
    clip_frac: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    tokens: int
    is_weight_mean: float = float("nan")
    """Off-policy correction only (learner/offpolicy.py): mean untruncated importance weight."""
    is_weight_max: float = float("nan")
    """Off-policy correction only: max untruncated importance weight."""
    is_truncated_frac: float = 0.0
    """Off-policy correction only: fraction of masked tokens whose weight hit the cap."""

    @classmethod
    def collect(cls, loss, pg_loss, kl: float, ratio, selected, clipped, tokens: int) -> "LossStats":
        """Detached stats: ratio mean/min/max and the clipped fraction over `selected`
        positions (NaN ratios and 0 clipped when none are selected)."""
        with torch.no_grad():
            n = int(selected.sum().item())
            if n > 0:
                r = ratio.detach()[selected]
                mean, low, high = float(r.mean()), float(r.min()), float(r.max())
                clip_frac = float(clipped.sum().item()) / n
            else:
                mean = low = high = float("nan")
                clip_frac = 0.0
            return cls(
                loss=float(loss.detach()),
                pg_loss=float(pg_loss.detach()),
                kl=kl,
                clip_frac=clip_frac,
                ratio_mean=mean,
                ratio_min=low,
                ratio_max=high,
                tokens=tokens,
            )


def check_loss_inputs(
    logp_new, logp_behavior, advantages, mask, *, clip_low: float, clip_high: float, beta: float, logp_ref
) -> bool:
    """Validate the shared inputs of the policy losses; return whether the KL term is on."""
    shape = logp_new.shape
    if logp_behavior.shape != shape:
        raise ValueError(f"logp_behavior shape {tuple(logp_behavior.shape)} != logp_new shape {tuple(shape)}")
    if mask.shape != shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logp_new shape {tuple(shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B] = [{shape[0]}], got shape {tuple(advantages.shape)}")
    if not logp_new.is_floating_point():
        raise ValueError(f"logp_new must be a floating tensor, got {logp_new.dtype}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    use_kl = beta > 0.0
    if use_kl:
        if logp_ref is None:
            raise ValueError(
                f"beta={beta} > 0 needs logp_ref (reference-policy log-probs, "
                "shape [B, T]); pass logp_ref or set beta=0"
            )
        if logp_ref.shape != shape:
            raise ValueError(f"logp_ref shape {tuple(logp_ref.shape)} != logp_new shape {tuple(shape)}")
    return use_kl


class MaskedTokens:
    """The masked-token bookkeeping every loss of the GRPO family shares (`policy_loss`,
    `learner.objectives.objective_loss`), for ``logp_new`` / ``logp_behavior`` / ``mask``
    of shape ``[B, T]``.

    ``m`` is the bool mask, ``mf`` it in ``logp_new``'s dtype, ``zero`` a scalar 0.
    ``log_ratio`` is ``logp_new - logp_behavior`` on masked tokens and exactly 0 elsewhere,
    so inf/NaN padding never reaches ``exp`` nor the gradient (``torch.where`` routes 0 grad
    there); gradients flow only into ``logp_new``. ``has_tok`` marks the sequences with at
    least one masked token, ``denom_tok`` their token counts (>= 1), ``n_seq`` their number (>= 1).
    """

    def __init__(self, logp_new: torch.Tensor, logp_behavior: torch.Tensor, mask: torch.Tensor) -> None:
        self.dtype = dtype = logp_new.dtype
        self.m = m = mask != 0  # bool [B, T]
        self.mf = mf = m.to(dtype)
        self.zero = zero = torch.zeros((), dtype=dtype, device=logp_new.device)
        self.log_ratio = torch.where(m, logp_new - logp_behavior.detach().to(dtype), zero)
        n_tok = mf.sum(dim=1)  # [B]
        self.has_tok = n_tok > 0
        self.denom_tok = n_tok.clamp_min(1.0)
        self.n_seq = self.has_tok.to(dtype).sum().clamp_min(1.0)

    def seq_then_batch_mean(self, tok: torch.Tensor) -> torch.Tensor:
        """Mean over each sequence's tokens, then over sequences with >= 1 token (GRPO eq. 3);
        ``tok`` must be 0 on unmasked entries."""
        seq = tok.sum(dim=1) / self.denom_tok
        return torch.where(self.has_tok, seq, self.zero).sum() / self.n_seq

    def kl_tokens(self, estimator, logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
        """``estimator(logp_new, logp_ref)`` per masked token, 0 elsewhere (padding never read)."""
        m, zero = self.m, self.zero
        new_s = torch.where(m, logp_new, zero)
        ref_s = torch.where(m, logp_ref.detach().to(self.dtype), zero)
        return torch.where(m, estimator(new_s, ref_s), zero)


def clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float, select: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``min(ratio * adv, clip(ratio, 1 - clip_low, 1 + clip_high) * adv)`` and where,
    among ``select``, the clipped branch is strictly smaller (so it is chosen, with no gradient)."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    is_clipped = (clipped < unclipped) & select
    return torch.where(is_clipped, clipped, unclipped), is_clipped


def policy_loss(
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GRPO loss: PPO-clipped surrogate plus optional k3 KL penalty.

    Sources: PPO clipped objective, Schulman et al. 2017, "Proximal Policy
    Optimization Algorithms", arXiv:1707.06347, eq. 7; GRPO objective and
    its aggregation, Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300,
    eq. 3; KL estimator k3, J. Schulman, "Approximating KL Divergence", 2020.
    Asymmetric bounds (``clip_high != clip_low``) as in "clip-higher".

    Args:
        logp_new: ``[B, T]`` log-probs of the sampled tokens under the policy
            being trained (the only input gradients flow into).
        logp_behavior: ``[B, T]`` log-probs under the policy that sampled them.
        advantages: ``[B]`` one advantage per sequence.
        mask: ``[B, T]`` float or bool; nonzero on tokens the policy generated.
        clip_low, clip_high: ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        beta: KL coefficient; ``0`` disables the KL term.
        logp_ref: ``[B, T]`` reference-policy log-probs; required iff ``beta > 0``,
            never read when ``beta == 0``.

    Per token: ``ratio = exp(logp_new - logp_behavior)``,
    ``objective = min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``,
    ``loss_t = -objective + beta * kl_k3(logp_new, logp_ref)``.
    Aggregation: mean over each sequence's masked tokens, then mean over the
    sequences that have at least one masked token.

    Returns:
        ``(loss, stats)``: a scalar tensor and a :class:`LossStats`.
        ``clip_frac`` is the fraction of masked tokens where the clipped value
        is strictly smaller than the unclipped one (so the clipped branch is
        selected and passes no gradient).
    """
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, T], got shape {tuple(logp_new.shape)}")
    use_kl = check_loss_inputs(
        logp_new, logp_behavior, advantages, mask, clip_low=clip_low, clip_high=clip_high, beta=beta, logp_ref=logp_ref
    )

    mt = MaskedTokens(logp_new, logp_behavior, mask)
    m = mt.m
    ratio = torch.exp(mt.log_ratio)
    adv = advantages.detach().to(mt.dtype).unsqueeze(1)  # [B, 1]
    objective, is_clipped = clipped_objective(ratio, adv, clip_low, clip_high, m)
    pg_loss = mt.seq_then_batch_mean(torch.where(m, -objective, mt.zero))
    if use_kl:
        assert logp_ref is not None
        kl = mt.seq_then_batch_mean(mt.kl_tokens(kl_k3, logp_new, logp_ref))
        loss = pg_loss + beta * kl
        kl_val = float(kl.detach())
    else:
        loss = pg_loss
        kl_val = 0.0

    stats = LossStats.collect(loss, pg_loss, kl_val, ratio, m, is_clipped, tokens=int(m.sum().item()))
    return loss, stats
