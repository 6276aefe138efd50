"""Unit tests for learner.losses against hand-computed numbers.

Every expected value below is a literal worked out by hand in the comments;
the tests never recompute the formula under test. float64 throughout.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import LossStats, group_advantages, kl_k3, policy_loss

F64 = torch.float64
LN2 = 0.6931471805599453


def t(x, **kw):
    return torch.tensor(x, dtype=F64, **kw)


def seq_from_ratios(ratios, base=-1.0):
    """Return (logp_new [requires grad], logp_behavior) with exp(new - behavior) == ratios.

    Input construction only: behavior is a constant ``base``, new = base + log(ratio).
    """
    r = t(ratios)
    beh = torch.full_like(r, base)
    new = (beh + torch.log(r)).detach().requires_grad_(True)
    return new, beh


def _flat(x):
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).tolist()
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _flat(item)]
    return [x]


def close(actual, expected, tol=1e-12):
    """Elementwise approx equality; nested lists / tensors are flattened."""
    if isinstance(actual, torch.Tensor):
        assert list(actual.shape) == list(torch.tensor(expected).shape)
    assert _flat(actual) == pytest.approx(_flat(expected), rel=tol, abs=tol)


# --------------------------------------------------------------------------
# group_advantages
# --------------------------------------------------------------------------

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
IDS = [7, 7, 7, 7, 3, 3, 3, 3]


def test_group_advantages_centered_only():
    # group 7: [1,0,0,1], mean 0.5   -> [0.5, -0.5, -0.5, 0.5]
    # group 3: [1,1,1,0], mean 0.75  -> [0.25, 0.25, 0.25, -0.75]
    a = group_advantages(t(REWARDS), torch.tensor(IDS), normalize_std=False)
    close(a, [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])


def test_group_advantages_std_normalised_eps0():
    # group 7: biased var = (4 * 0.25) / 4 = 0.25, std 0.5 -> [1, -1, -1, 1]
    # group 3: biased var = (3 * 0.0625 + 0.5625) / 4 = 0.1875,
    #          std = sqrt(3)/4 = 0.4330127018922193
    #          0.25 / (sqrt(3)/4) = 1/sqrt(3) = 0.5773502691896258
    #         -0.75 / (sqrt(3)/4) = -sqrt(3) = -1.7320508075688772
    a = group_advantages(t(REWARDS), torch.tensor(IDS), normalize_std=True, eps=0.0)
    close(a, [1.0, -1.0, -1.0, 1.0, 0.5773502691896258, 0.5773502691896258, 0.5773502691896258, -1.7320508075688772])


def test_group_advantages_std_normalised_default_eps():
    # group 7: 0.5 / (0.5 + 1e-6) = 1 / 1.000002 = 0.999998000003999992...
    # group 3: 0.25 / (0.4330127018922193 + 1e-6)  = 0.5773489358556...
    #   1/sqrt(3) * 1/(1 + 1e-6/0.4330127018922193)
    #   = 0.5773502691896258 * (1 - 2.3094010767585e-6 + 5.333e-12)
    #   = 0.5773489358580...  (checked to 1e-9 relative)
    #         -0.75 / (...) = -3 * the above = -1.732046807574...
    a = group_advantages(t(REWARDS), torch.tensor(IDS))
    g7 = 0.999998000004
    g3 = 0.57734893585806
    assert a.tolist() == pytest.approx([g7, -g7, -g7, g7, g3, g3, g3, -3 * g3], rel=1e-9)


def test_group_advantages_order_and_id_values_irrelevant():
    # interleaved, negative and huge ids: same per-sample results as above (eps=0)
    r = t([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    ids = torch.tensor([-5, 10**12, -5, 10**12, -5, 10**12, -5, 10**12])
    # group -5  : [1,0,0,1] -> [1,-1,-1,1]   at positions 0,2,4,6
    # group 1e12: [1,1,1,0] -> [s,s,s,-3s]   at positions 1,3,5,7, s = 1/sqrt(3)
    s = 0.5773502691896258
    a = group_advantages(r, ids, eps=0.0)
    close(a, [1.0, s, -1.0, s, -1.0, s, 1.0, -3 * s])


def test_group_advantages_singleton_is_zero():
    # ids 4 and 9 are singletons; group 1 = [2, 4], mean 3, std 1 -> [-1, 1]
    r = t([5.0, 2.0, -3.0, 4.0])
    ids = torch.tensor([4, 1, 9, 1])
    for norm in (True, False):
        a = group_advantages(r, ids, normalize_std=norm, eps=0.0)
        close(a, [0.0, -1.0, 0.0, 1.0])


def test_group_advantages_all_equal_group_is_zero_no_nan():
    # group 0: all 0.1 (mean not exactly representable) -> exactly 0, no residue/eps blowup
    # group 1: all 1.0 -> 0; group 2: [0, 2] -> centered [-1, 1], std 1 -> [-1, 1]
    r = t([0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 2.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    a = group_advantages(r, ids)  # default eps
    assert not torch.isnan(a).any()
    assert a[:5].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    # -1 / (1 + 1e-6) = -0.999999000001
    assert a[5:].tolist() == pytest.approx([-0.999999000001, 0.999999000001], rel=1e-11)


def test_group_advantages_float32_and_shape_errors():
    a = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([2, 2]), eps=0.0)
    assert a.dtype == torch.float32
    assert a.tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(3))  # float ids


def test_group_advantages_empty():
    a = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert a.shape == (0,)


# --------------------------------------------------------------------------
# kl_k3
# --------------------------------------------------------------------------


def test_kl_k3_known_values():
    new = t([math.log(0.5), math.log(0.25), 0.0, -2.0])
    ref = t([math.log(0.25), math.log(0.5), 1.0, -2.0])
    # d = ref - new:
    #  [0] d = -ln2 -> 0.5 + ln2 - 1 = 0.1931471805599453
    #  [1] d = +ln2 -> 2 - ln2 - 1   = 0.3068528194400547
    #  [2] d = 1    -> e - 1 - 1     = 0.7182818284590451
    #  [3] d = 0    -> 0
    close(kl_k3(new, ref), [0.1931471805599453, 0.3068528194400547, 0.7182818284590451, 0.0])


def test_kl_k3_zero_when_equal_and_nonneg():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, dtype=F64, generator=g)
    assert torch.equal(kl_k3(x, x), torch.zeros_like(x))
    y = x + 1e-9 * torch.randn(64, 32, dtype=F64, generator=g)  # tiny d: rounding regime
    z = x + 3 * torch.randn(64, 32, dtype=F64, generator=g)
    for other in (y, z):
        assert (kl_k3(x, other) >= 0).all()
        assert (kl_k3(other, x) >= 0).all()
    assert kl_k3(x, y).shape == (64, 32)


def test_kl_k3_small_difference_accurate():
    # d = 1e-8: exp(d) - d - 1 = d^2/2 + d^3/6 ~ 5e-17 (naive exp(d)-1 would round to 0 or garbage)
    out = kl_k3(t([0.0]), t([1e-8]))
    assert out.item() == pytest.approx(5e-17, rel=1e-6)


# --------------------------------------------------------------------------
# policy_loss
# --------------------------------------------------------------------------


def ones_mask(b, n):
    return torch.ones(b, n, dtype=F64)


def test_policy_loss_inside_clip_range():
    # ratios [1.1, 0.9] inside [0.8, 1.2], A = 2
    # objective = [2.2, 1.8], seq mean 2.0 -> loss -2.0
    # d loss / d logp_new_t = -(1/2) * ratio_t * A = [-1.1, -0.9]
    new, beh = seq_from_ratios([[1.1, 0.9]])
    loss, st = policy_loss(new, beh, t([2.0]), ones_mask(1, 2))
    assert isinstance(st, LossStats)
    close(loss, -2.0)
    assert st.loss == pytest.approx(-2.0) and st.pg_loss == pytest.approx(-2.0)
    assert st.kl == 0.0 and st.clip_frac == 0.0 and st.tokens == 2
    assert st.ratio_mean == pytest.approx(1.0)
    assert st.ratio_min == pytest.approx(0.9)
    assert st.ratio_max == pytest.approx(1.1)
    loss.backward()
    close(new.grad, [[-1.1, -0.9]])


def test_policy_loss_clipped_above_positive_advantage():
    # A = 1, ratios [1.5, 1.0], eps 0.2
    # token0: min(1.5, 1.2) = 1.2 (clipped, strictly smaller) ; token1: 1.0
    # loss = -(1.2 + 1.0)/2 = -1.1 ; clip_frac = 1/2
    # grad: token0 through clipped branch = 0 ; token1 = -(1/2)*1.0*1 = -0.5
    new, beh = seq_from_ratios([[1.5, 1.0]])
    loss, st = policy_loss(new, beh, t([1.0]), ones_mask(1, 2))
    close(loss, -1.1)
    assert st.clip_frac == 0.5
    loss.backward()
    close(new.grad, [[0.0, -0.5]])
    assert new.grad[0, 0].item() == 0.0


def test_policy_loss_high_ratio_negative_advantage_not_clipped():
    # A = -1, ratio 1.5: unclipped -1.5, clipped -1.2, min = -1.5 (unclipped)
    # loss = 1.5, clip_frac 0, grad = -ratio*A = 1.5
    new, beh = seq_from_ratios([[1.5]])
    loss, st = policy_loss(new, beh, t([-1.0]), ones_mask(1, 1))
    close(loss, 1.5)
    assert st.clip_frac == 0.0
    loss.backward()
    close(new.grad, [[1.5]])


def test_policy_loss_clipped_below_negative_advantage():
    # seq0: A = -2, ratio 0.5: unclipped -1.0, clipped 0.8 * -2 = -1.6 -> min -1.6 (clipped)
    #        seq loss 1.6, grad 0
    # seq1: A = +2, ratio 0.5: unclipped 1.0, clipped 1.6 -> min 1.0 (unclipped)
    #        seq loss -1.0, grad -(ratio*A) = -1.0
    # loss = (1.6 - 1.0)/2 = 0.3 ; grads scaled by 1/2 (two sequences): [0], [-0.5]
    # clip_frac = 1/2
    new, beh = seq_from_ratios([[0.5], [0.5]])
    loss, st = policy_loss(new, beh, t([-2.0, 2.0]), ones_mask(2, 1))
    close(loss, 0.3)
    assert st.clip_frac == 0.5
    loss.backward()
    close(new.grad, [[0.0], [-0.5]])
    assert new.grad[0, 0].item() == 0.0


def test_policy_loss_asymmetric_clip():
    # clip_low 0.1, clip_high 0.3 -> range [0.9, 1.3]
    # seq0 A = +1, ratios [1.25, 1.4] -> [1.25, 1.3 (clipped)]      seq loss -(2.55)/2 = -1.275
    # seq1 A = -1, ratios [0.85, 0.95] -> [-0.9 (clipped), -0.95]    seq loss  (1.85)/2 =  0.925
    # loss = (-1.275 + 0.925) / 2 = -0.175 ; clip_frac = 2/4
    # grads (scale 1/2 * 1/2 = 1/4 of -ratio*A, 0 if clipped):
    #   seq0: [-1.25/4, 0] = [-0.3125, 0] ; seq1: [0, 0.95/4] = [0, 0.2375]
    # (symmetric 0.2 would give -(1.2+1.2)/2=-1.2 and 0.9 -> -0.15: differs)
    new, beh = seq_from_ratios([[1.25, 1.4], [0.85, 0.95]])
    loss, st = policy_loss(new, beh, t([1.0, -1.0]), ones_mask(2, 2), clip_low=0.1, clip_high=0.3)
    close(loss, -0.175)
    assert st.clip_frac == 0.5
    assert st.ratio_min == pytest.approx(0.85) and st.ratio_max == pytest.approx(1.4)
    assert st.ratio_mean == pytest.approx((1.25 + 1.4 + 0.85 + 0.95) / 4)  # 1.1125
    loss.backward()
    close(new.grad, [[-0.3125, 0.0], [0.0, 0.2375]])


def test_policy_loss_masking_excludes_tokens():
    # ratios [1.1, 5.0, 0.9], mask [1, 0, 1], A = 1 -> the 5.0 token is ignored
    # loss = -(1.1 + 0.9)/2 = -1.0 ; tokens 2 ; ratio_max 1.1 ; grads [-0.55, 0, -0.45]
    new, beh = seq_from_ratios([[1.1, 5.0, 0.9]])
    mask = t([[1.0, 0.0, 1.0]])
    loss, st = policy_loss(new, beh, t([1.0]), mask)
    close(loss, -1.0)
    assert st.tokens == 2 and st.clip_frac == 0.0
    assert st.ratio_max == pytest.approx(1.1) and st.ratio_min == pytest.approx(0.9)
    loss.backward()
    close(new.grad, [[-0.55, 0.0, -0.45]])


def test_policy_loss_masked_positions_may_hold_nan_inf():
    # padding garbage at masked-out positions must not reach loss or grad
    new = t([[-1.0, float("nan"), float("inf")]], requires_grad=True)
    beh = t([[-1.0, float("-inf"), float("nan")]])
    ref = t([[-1.0, float("nan"), float("-inf")]])
    mask = torch.tensor([[True, False, False]])
    # token0: ratio 1, A = 3 -> loss -3 ; kl 0 ; grad -3
    loss, st = policy_loss(new, beh, t([3.0]), mask, beta=0.5, logp_ref=ref)
    close(loss, -3.0)
    assert st.kl == 0.0
    loss.backward()
    close(new.grad, [[-3.0, 0.0, 0.0]])


def test_policy_loss_bool_mask_equals_float_mask():
    new, beh = seq_from_ratios([[1.1, 5.0, 0.9]])
    l1, s1 = policy_loss(new, beh, t([1.0]), t([[1.0, 0.0, 1.0]]))
    l2, s2 = policy_loss(new, beh, t([1.0]), torch.tensor([[True, False, True]]))
    assert l1.item() == l2.item() == pytest.approx(-1.0)
    assert s1 == s2


def test_policy_loss_per_sequence_mean_aggregation():
    # seq0: 3 tokens, ratio 1, A = +1  -> seq loss -1
    # seq1: 1 masked token (of 3), ratio 1, A = -3 -> seq loss +3
    # seq2: no masked tokens, A = 100 -> excluded
    # GRPO: mean over seqs with tokens = (-1 + 3)/2 = 1.0
    # (token-level mean would give (-1-1-1+3)/4 = 0.0; including seq2 would give 2/3)
    # grads: seq0 tokens -(1/2)(1/3)(1) = -1/6 ; seq1 token -(1/2)(1)(-3) = 1.5 ; rest 0
    new, beh = seq_from_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    loss, st = policy_loss(new, beh, t([1.0, -3.0, 100.0]), mask)
    close(loss, 1.0)
    assert st.tokens == 4
    loss.backward()
    sixth = 1.0 / 6.0
    close(new.grad, [[-sixth, -sixth, -sixth], [1.5, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_policy_loss_no_masked_tokens_is_zero_and_finite():
    new, beh = seq_from_ratios([[1.3, 0.7]])
    loss, st = policy_loss(new, beh, t([1.0]), torch.zeros(1, 2, dtype=F64))
    assert loss.item() == 0.0 and st.tokens == 0 and st.clip_frac == 0.0
    assert math.isnan(st.ratio_mean)
    loss.backward()
    assert new.grad.tolist() == [[0.0, 0.0]]


def test_policy_loss_beta_adds_kl_exactly():
    # ratio 1 on both tokens; new = log[0.5, 0.25], ref = log[0.25, 0.5]
    # per-token k3 = [0.5 + ln2 - 1, 2 - ln2 - 1] = [0.19314718..., 0.30685281...]
    # seq-mean KL = 0.5 / 2 = 0.25 exactly.
    logp = t([[math.log(0.5), math.log(0.25)]])
    ref = t([[math.log(0.25), math.log(0.5)]])

    # (a) A = 0: pg = 0, loss = beta * 0.25 = 0.025
    new = logp.clone().requires_grad_(True)
    loss, st = policy_loss(new, logp.clone(), t([0.0]), ones_mask(1, 2), beta=0.1, logp_ref=ref)
    close(loss, 0.025)
    assert st.kl == pytest.approx(0.25) and st.pg_loss == 0.0

    # (b) A = 1: pg = -1, loss = -1 + 0.1 * 0.25 = -0.975
    # grad per token = (1/2) * [-(ratio*A) + beta * (1 - exp(ref - new))]
    #   token0: exp(ref-new) = 0.5 -> (-1 + 0.1*0.5)/2 = -0.475
    #   token1: exp(ref-new) = 2   -> (-1 - 0.1*1.0)/2 = -0.55
    new = logp.clone().requires_grad_(True)
    loss, st = policy_loss(new, logp.clone(), t([1.0]), ones_mask(1, 2), beta=0.1, logp_ref=ref)
    close(loss, -0.975)
    assert st.loss == pytest.approx(-0.975)
    assert st.pg_loss == pytest.approx(-1.0)
    assert st.kl == pytest.approx(0.25)
    loss.backward()
    close(new.grad, [[-0.475, -0.55]])


def test_policy_loss_kl_respects_mask_and_per_sequence_mean():
    # seq0 tokens: k3 [0.19314718..., 0.30685281...] both masked -> mean 0.25
    # seq1 token0: d = 1 -> e - 2 = 0.7182818284590451 ; token1 masked out (huge d ignored)
    # KL = (0.25 + 0.7182818284590451)/2 = 0.48414091422952255 ; A = 0, beta = 1 -> loss = KL
    new = t([[math.log(0.5), math.log(0.25)], [0.0, 0.0]], requires_grad=True)
    ref = t([[math.log(0.25), math.log(0.5)], [1.0, 50.0]])
    mask = t([[1, 1], [1, 0]])
    loss, st = policy_loss(new, new.detach().clone(), t([0.0, 0.0]), mask, beta=1.0, logp_ref=ref)
    close(loss, 0.48414091422952255)
    assert st.kl == pytest.approx(0.48414091422952255)


def test_policy_loss_beta_zero_ignores_ref():
    new, beh = seq_from_ratios([[1.1, 0.9]])
    l0, s0 = policy_loss(new, beh, t([2.0]), ones_mask(1, 2), beta=0.0, logp_ref=None)
    nan_ref = torch.full((1, 2), float("nan"), dtype=F64)
    l1, s1 = policy_loss(new, beh, t([2.0]), ones_mask(1, 2), beta=0.0, logp_ref=nan_ref)
    # not even read: an object with no tensor API is fine too
    l2, _ = policy_loss(new, beh, t([2.0]), ones_mask(1, 2), logp_ref=object())  # type: ignore[arg-type]
    assert l0.item() == l1.item() == l2.item() == pytest.approx(-2.0)
    assert s0 == s1 and s0.kl == 0.0


def test_policy_loss_beta_positive_without_ref_raises():
    new, beh = seq_from_ratios([[1.0]])
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(new, beh, t([1.0]), ones_mask(1, 1), beta=0.05)


def test_policy_loss_bad_arguments_raise():
    new, beh = seq_from_ratios([[1.0, 1.0]])
    m = ones_mask(1, 2)
    with pytest.raises(ValueError):
        policy_loss(new, beh, t([1.0, 2.0]), m)  # advantages wrong length
    with pytest.raises(ValueError):
        policy_loss(new, beh[:, :1], t([1.0]), m)  # behavior shape
    with pytest.raises(ValueError):
        policy_loss(new, beh, t([1.0]), m[:, :1])  # mask shape
    with pytest.raises(ValueError):
        policy_loss(new, beh, t([1.0]), m, beta=0.1, logp_ref=beh[:, :1])
    with pytest.raises(ValueError):
        policy_loss(new, beh, t([1.0]), m, clip_low=-0.1)
    with pytest.raises(ValueError):
        policy_loss(new, beh, t([1.0]), m, beta=-1.0)


def test_policy_loss_gradients_only_into_logp_new_and_stats_are_python():
    new, _ = seq_from_ratios([[1.5, 1.0]])
    beh = t([[-1.0, -1.0]], requires_grad=True)
    adv = t([1.0], requires_grad=True)
    ref = t([[-2.0, -0.5]], requires_grad=True)
    loss, st = policy_loss(new, beh, adv, ones_mask(1, 2), beta=0.1, logp_ref=ref)
    loss.backward()
    assert new.grad is not None
    assert beh.grad is None and adv.grad is None and ref.grad is None
    for name in ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "ratio_min", "ratio_max"):
        assert type(getattr(st, name)) is float, name
    assert type(st.tokens) is int


def test_policy_loss_float32():
    new = torch.zeros(2, 3, requires_grad=True)
    beh = torch.zeros(2, 3)
    loss, st = policy_loss(new, beh, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    # ratio 1 everywhere: seq losses -1 and +1 -> 0
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    assert st.ratio_mean == 1.0
