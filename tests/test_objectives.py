"""Unit tests for learner.objectives and learner.pcgrad against hand-computed numbers.

Every expected value is a literal worked out by hand in the comments; the tests
never recompute the formula under test. float64 throughout.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import kl_k3, policy_loss
from learner.objectives import (
    compute_advantages,
    dr_grpo_advantages,
    dynamic_sampling_mask,
    kl_k1,
    objective_loss,
    overlong_penalty,
)
from learner.pcgrad import pcgrad

F64 = torch.float64


def t(x, **kw):
    return torch.tensor(x, dtype=F64, **kw)


def from_ratios(ratios, base=-1.0):
    """(logp_new [requires grad], logp_behavior) with exp(new - behavior) == ratios (input construction)."""
    r = t(ratios)
    beh = torch.full_like(r, base)
    new = (beh + torch.log(r)).detach().requires_grad_(True)
    return new, beh


def approx_list(x, expected, abs=1e-9):
    assert x.detach().reshape(-1).tolist() == pytest.approx(expected, abs=abs)


# --------------------------------------------------------------- advantages
# Rewards: group 7 = [1, 0, 0, 0] (mean 0.25), group 3 = [0.5, 0.5], group 9 = [2] (singleton).
REWARDS = [1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 2.0]
GIDS = [7, 7, 7, 7, 3, 3, 9]


def test_dr_grpo_advantages_no_std():
    # group 7: r - 0.25 = [0.75, -0.25, -0.25, -0.25]; group 3: [0, 0]; singleton: 0
    adv = dr_grpo_advantages(t(REWARDS), torch.tensor(GIDS))
    approx_list(adv, [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0])


def test_compute_advantages_per_kind():
    r, g = t(REWARDS), torch.tensor(GIDS)
    # std (biased) of group 7 = sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.75 / 4) = sqrt(0.1875)
    #   = 0.4330127; 0.75 / 0.4330127 = sqrt(3) = 1.7320508; -0.25 / 0.4330127 = -1/sqrt(3) = -0.5773503
    # (eps = 1e-6 in the denominator shifts these by ~4e-6, hence abs=1e-5)
    std_norm = [1.7320508, -0.5773503, -0.5773503, -0.5773503, 0.0, 0.0, 0.0]
    for kind in ("grpo", "dapo", "gspo"):
        approx_list(compute_advantages(kind, r, g), std_norm, abs=1e-5)
    approx_list(compute_advantages("dr_grpo", r, g), [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        compute_advantages("ppo", r, g)


# --------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_mask_counts_groups():
    # group 7 [1,0,0,1]: varied -> keep; group 3 [0.5,0.5]: equal -> drop;
    # group 9 [2]: singleton (zero variance) -> drop; group 4 [1,1,1]: equal -> drop.  3 dropped groups.
    rewards = t([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0, 1.0, 1.0, 1.0])
    gids = torch.tensor([7, 7, 7, 7, 3, 3, 9, 4, 4, 4])
    keep, dropped = dynamic_sampling_mask(rewards, gids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True] * 4 + [False] * 6
    assert dropped == 3


def test_dynamic_sampling_all_kept_and_unsorted_ids():
    # groups 5: [0, 1], 2: [1, 0], interleaved -> both varied, none dropped
    keep, dropped = dynamic_sampling_mask(t([0.0, 1.0, 1.0, 0.0]), torch.tensor([5, 2, 5, 2]))
    assert keep.tolist() == [True, True, True, True]
    assert dropped == 0


# ---------------------------------------------------------- overlong penalty


def test_overlong_penalty_dapo_eq13():
    # L_max = 20, L_cache = 4 -> interval (16, 20]; penalty = (16 - L) / 4 inside, -1 beyond.
    # L=10: 0 | L=16: 0 (boundary, <= 16) | L=17: (16-17)/4 = -0.25 | L=18: -2/4 = -0.5
    # L=20: -4/4 = -1.0 (still inside) | L=21: -1 | L=30: -1
    out = overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 21, 30]), max_len=20, cache_len=4)
    assert out.is_floating_point()
    approx_list(out, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_len=4, cache_len=5)


# ----------------------------------------------------------------- KL k1/k3


def test_kl_k1_vs_k3_values():
    new = t([-1.0, -2.0, -0.5])
    ref = t([-1.5, -1.0, -0.5])
    # k1 = new - ref = [0.5, -1.0, 0.0]  (negative where the reference is likelier)
    approx_list(kl_k1(new, ref), [0.5, -1.0, 0.0])
    # k3: d = ref - new = [-0.5, 1.0, 0]; exp(d) - d - 1
    #   = [0.6065307 + 0.5 - 1, 2.7182818 - 1 - 1, 0] = [0.1065307, 0.7182818, 0]
    approx_list(kl_k3(new, ref), [0.1065307, 0.7182818, 0.0], abs=1e-7)


# ---------------------------------------------------- token-level objectives
# 2x3 example. Ratios (exp(new - behavior)):
#   seq 0: [1.5, 0.5, 1.1], A = +1, all 3 tokens masked in
#   seq 1: [0.7, 1.3, pad], A = -2, token 2 is padding (ratio 9 there must be ignored)
RATIOS = [[1.5, 0.5, 1.1], [0.7, 1.3, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [1.0, -2.0]
# Per-token min(r*A, clip(r, 0.8, 1.2)*A), symmetric clip 0.2:
#   seq 0: r=1.5 -> min(1.5, 1.2) = 1.2 CLIPPED | r=0.5 -> min(0.5, 0.8) = 0.5 | r=1.1 -> 1.1
#          -objective = [-1.2, -0.5, -1.1], sum -2.8
#   seq 1: r=0.7 -> min(-1.4, 0.8*-2=-1.6) = -1.6 CLIPPED | r=1.3 -> min(-2.6, -2.4) = -2.6
#          -objective = [1.6, 2.6], sum 4.2
# clip_frac = 2/5 = 0.4; ratio mean = (1.5+0.5+1.1+0.7+1.3)/5 = 5.1/5 = 1.02, min 0.5, max 1.5


def _inputs():
    new, beh = from_ratios(RATIOS)
    return new, beh, t(ADV), torch.tensor(MASK)


def test_grpo_seq_mean_then_batch_mean():
    new, beh, adv, mask = _inputs()
    loss, st = objective_loss("grpo", new, beh, adv, mask, clip_low=0.2, clip_high=0.2)
    # seq means: -2.8/3 = -0.9333333, 4.2/2 = 2.1; batch mean = (-0.9333333 + 2.1)/2 = 7/12 = 0.5833333
    assert loss.item() == pytest.approx(0.5833333333, abs=1e-9)
    assert st.clip_frac == pytest.approx(0.4)
    assert (st.ratio_mean, st.ratio_min, st.ratio_max) == pytest.approx((1.02, 0.5, 1.5))
    assert st.tokens == 5 and st.kl == 0.0
    loss.backward()
    # d loss / d new[0,1] = -(1/2)(1/3) * A * r = -(1/6) * 0.5 = -0.0833333
    # clipped tokens [0,0], [1,0] and padding [1,2] get exactly 0.
    # [0,2]: -(1/6) * 1.1 = -0.1833333; [1,1]: -(1/2)(1/2) * (-2) * 1.3 = 0.65
    approx_list(new.grad, [0.0, -0.0833333333, -0.1833333333, 0.0, 0.65, 0.0])


def test_grpo_equals_policy_loss():
    new, beh, adv, mask = _inputs()
    a, _ = objective_loss("grpo", new, beh, adv, mask, clip_low=0.2, clip_high=0.28)
    b, _ = policy_loss(new, beh, adv, mask, clip_low=0.2, clip_high=0.28)
    assert a.item() == b.item()


def test_dr_grpo_sum_over_constant():
    new, beh, adv, mask = _inputs()
    # default max_len = T = 3: token sum (-2.8 + 4.2 = 1.4) / (B * max_len = 2 * 3 = 6) = 0.2333333
    loss, st = objective_loss("dr_grpo", new, beh, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(0.2333333333, abs=1e-9)
    assert st.clip_frac == pytest.approx(0.4)
    # max_len = 4: 1.4 / (2 * 4) = 0.175
    new, beh, adv, mask = _inputs()
    loss, _ = objective_loss("dr_grpo", new, beh, adv, mask, clip_low=0.2, clip_high=0.2, max_len=4)
    assert loss.item() == pytest.approx(0.175, abs=1e-12)
    loss.backward()
    # every token weighs 1/8 (no length normalisation): [0,1]: -(1/8)*0.5 = -0.0625;
    # [0,2]: -(1/8)*1.1 = -0.1375; [1,1]: -(1/8)*(-2)*1.3 = 0.325
    approx_list(new.grad, [0.0, -0.0625, -0.1375, 0.0, 0.325, 0.0])


def test_dapo_token_level_clip_higher():
    new, beh, adv, mask = _inputs()
    # clip range [0.8, 1.28]:
    #   seq 0: r=1.5 -> min(1.5, 1.28) = 1.28 CLIPPED | 0.5 -> 0.5 | 1.1 -> 1.1; -obj sum = -2.88
    #   seq 1: r=0.7 -> -1.6 CLIPPED | r=1.3 -> min(-2.6, 1.28*-2 = -2.56) = -2.6; -obj sum = 4.2
    # token-level: (-2.88 + 4.2) / 5 tokens = 1.32 / 5 = 0.264
    loss, st = objective_loss("dapo", new, beh, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(0.264, abs=1e-12)
    assert st.clip_frac == pytest.approx(0.4)
    loss.backward()
    # each token weighs 1/5: [0,1]: -0.5/5 = -0.1; [0,2]: -1.1/5 = -0.22; [1,1]: 2*1.3/5 = 0.52
    approx_list(new.grad, [0.0, -0.1, -0.22, 0.0, 0.52, 0.0])
    # symmetric clip 0.2: (-2.8 + 4.2) / 5 = 0.28
    new, beh, adv, mask = _inputs()
    loss, _ = objective_loss("dapo", new, beh, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(0.28, abs=1e-12)


def test_padding_nan_ignored():
    new, beh, adv, mask = _inputs()
    with torch.no_grad():
        new[1, 2] = float("nan")
    for kind in ("grpo", "dr_grpo", "dapo", "gspo"):
        x = new.detach().clone().requires_grad_(True)
        loss, _ = objective_loss(kind, x, beh, adv, mask)
        loss.backward()
        assert math.isfinite(loss.item())
        assert x.grad[1, 2].item() == 0.0


# ------------------------------------------------------------------- GSPO
# seq 0 ratios [2, 0.5, 1.331] (3 tokens): mean log-ratio = ln(2*0.5*1.331)/3 = ln(1.331)/3 -> s0 = 1.1
# seq 1 ratios [0.49, 1.0, pad]: mean log-ratio = ln(0.49)/2 -> s1 = 0.7
GSPO_RATIOS = [[2.0, 0.5, 1.331], [0.49, 1.0, 5.0]]


def test_gspo_sequence_ratio():
    new, beh = from_ratios(GSPO_RATIOS)
    adv, mask = t(ADV), torch.tensor(MASK)
    loss, st = objective_loss("gspo", new, beh, adv, mask, clip_low=0.2, clip_high=0.2)
    # seq 0: A=1, s=1.1 in [0.8, 1.2] -> o = 1.1
    # seq 1: A=-2, s=0.7 -> min(-1.4, 0.8*-2 = -1.6) = -1.6 CLIPPED
    # loss = (-1.1 + 1.6) / 2 = 0.25
    assert loss.item() == pytest.approx(0.25, abs=1e-12)
    # stats over sequences: clip 1/2; ratios {1.1, 0.7}: mean 0.9, min 0.7, max 1.1
    assert st.clip_frac == pytest.approx(0.5)
    assert (st.ratio_mean, st.ratio_min, st.ratio_max) == pytest.approx((0.9, 0.7, 1.1))
    assert st.tokens == 5
    loss.backward()
    # d loss / d new[0,t] = -(1/2) * A * s0 * (1/3) = -1.1/6 = -0.1833333 for all 3 tokens of seq 0
    # seq 1 clipped -> 0; padding -> 0
    approx_list(new.grad, [-0.1833333333] * 3 + [0.0, 0.0, 0.0])


def test_gspo_clip_high_binds():
    new, beh = from_ratios(GSPO_RATIOS)
    loss, st = objective_loss("gspo", new, beh, t(ADV), torch.tensor(MASK), clip_low=0.2, clip_high=0.05)
    # seq 0: s=1.1 -> min(1.1, 1.05) = 1.05 CLIPPED; seq 1: -1.6 CLIPPED
    # loss = (-1.05 + 1.6) / 2 = 0.275; clip_frac = 2/2 = 1
    assert loss.item() == pytest.approx(0.275, abs=1e-12)
    assert st.clip_frac == pytest.approx(1.0)


# --------------------------------------------------------------- KL terms
# logp_ref = logp_new - 0.5 on every token -> k1 per token = 0.5;
# k3: d = ref - new = -0.5 -> exp(-0.5) + 0.5 - 1 = 0.6065307 - 0.5 = 0.1065307


def _ref(new):
    return new.detach() - 0.5


@pytest.mark.parametrize(
    "kind,kl,pg,kl_val",
    [
        # dapo pg = 0.264 (clip 0.2/0.28); KL token-mean = per-token value
        ("dapo", "k1", 0.264, 0.5),
        ("dapo", "k3", 0.264, 0.1065306597),
        # grpo with clip 0.2/0.28 (r=1.5 clips at 1.28, see dapo test):
        #   seq 0: -2.88/3 = -0.96; seq 1: 4.2/2 = 2.1; mean = (-0.96 + 2.1)/2 = 1.14/2 = 0.57
        ("grpo", "k1", 0.57, 0.5),
        ("grpo", "k3", 0.57, 0.1065306597),
        # dr_grpo: (-2.88 + 4.2)/6 = 0.22; KL: 5 tokens * 0.5 / 6 = 0.4166667 (k1),
        #   5 * 0.1065307 / 6 = 0.0887755 (k3)
        ("dr_grpo", "k1", 0.22, 0.4166666667),
        ("dr_grpo", "k3", 0.22, 0.0887755498),
    ],
)
def test_kl_terms(kind, kl, pg, kl_val):
    new, beh, adv, mask = _inputs()
    loss, st = objective_loss(
        kind, new, beh, adv, mask, clip_low=0.2, clip_high=0.28, beta=0.1, kl=kl, logp_ref=_ref(new)
    )
    assert st.pg_loss == pytest.approx(pg, abs=1e-9)
    assert st.kl == pytest.approx(kl_val, abs=1e-9)
    # loss = pg + 0.1 * kl, e.g. dapo/k1: 0.264 + 0.05 = 0.314
    assert loss.item() == pytest.approx(pg + 0.1 * kl_val, abs=1e-9)


def test_gspo_with_kl():
    new, beh = from_ratios(GSPO_RATIOS)
    loss, st = objective_loss(
        "gspo", new, beh, t(ADV), torch.tensor(MASK), clip_low=0.2, clip_high=0.2, beta=0.1, kl="k1", logp_ref=_ref(new)
    )
    # pg = 0.25, kl = 0.5 -> 0.25 + 0.05 = 0.3
    assert st.kl == pytest.approx(0.5, abs=1e-12)
    assert loss.item() == pytest.approx(0.3, abs=1e-12)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("kl", ["k1", "k3"])
def test_beta_zero_needs_no_ref(kind, kl):
    new, beh, adv, mask = _inputs()
    loss, st = objective_loss(kind, new, beh, adv, mask, beta=0.0, kl=kl, logp_ref=None)
    assert math.isfinite(loss.item()) and st.kl == 0.0
    with pytest.raises(ValueError):
        objective_loss(kind, new, beh, adv, mask, beta=0.1, kl=kl, logp_ref=None)


def test_bad_kind_and_kl():
    new, beh, adv, mask = _inputs()
    with pytest.raises(ValueError):
        objective_loss("ppo", new, beh, adv, mask)
    with pytest.raises(ValueError):
        objective_loss("dapo", new, beh, adv, mask, kl="k2")


def test_empty_mask_is_zero_with_zero_grad():
    new, beh, adv, _ = _inputs()
    mask = torch.zeros(2, 3, dtype=torch.long)
    for kind in ("grpo", "dr_grpo", "dapo", "gspo"):
        x = new.detach().clone().requires_grad_(True)
        loss, st = objective_loss(kind, x, beh, adv, mask)
        loss.backward()
        assert loss.item() == 0.0 and st.tokens == 0
        approx_list(x.grad, [0.0] * 6)


# ------------------------------------------------------------------ PCGrad


def test_pcgrad_two_conflicting():
    g1, g2 = t([1.0, 0.0]), t([-1.0, 1.0])
    # g1.g2 = -1 < 0 (conflict).
    # g1' = g1 - (g1.g2)/||g2||^2 * g2 = [1,0] - (-1/2)[-1,1] = [1,0] + [-0.5,0.5] = [0.5, 0.5]
    # g2' = g2 - (g2.g1)/||g1||^2 * g1 = [-1,1] - (-1/1)[1,0] = [0, 1]
    # combined = [0.5, 1.5]; projections applied: 2
    out, n = pcgrad([g1, g2])
    approx_list(out, [0.5, 1.5])
    assert n == 2
    approx_list(g1, [1.0, 0.0])  # inputs untouched
    approx_list(g2, [-1.0, 1.0])


def test_pcgrad_non_conflicting_is_plain_sum():
    # [1,0].[1,1] = 1 >= 0 -> no projection; sum = [2, 1]
    out, n = pcgrad([t([1.0, 0.0]), t([1.0, 1.0])])
    approx_list(out, [2.0, 1.0])
    assert n == 0
    # orthogonal (dot 0) is not a conflict either: [1,0] + [0,1] = [1,1]
    out, n = pcgrad([t([1.0, 0.0]), t([0.0, 1.0])])
    approx_list(out, [1.0, 1.0])
    assert n == 0


def test_pcgrad_three_tasks_fixed_order():
    g1, g2, g3 = t([1.0, 0.0]), t([-1.0, 1.0]), t([0.0, -1.0])
    # g1: vs g2: dot -1 -> [1,0] + 0.5[-1,1] = [0.5,0.5]; vs g3: [0.5,0.5].[0,-1] = -0.5
    #     -> [0.5,0.5] - (-0.5/1)[0,-1] = [0.5, 0]                          (2 projections)
    # g2: vs g1: dot -1 -> [-1,1] + [1,0] = [0,1]; vs g3: [0,1].[0,-1] = -1 -> [0,1] + [0,-1] = [0,0]  (2)
    # g3: vs g1: [0,-1].[1,0] = 0 -> none; vs g2: [0,-1].[-1,1] = -1 -> [0,-1] + 0.5[-1,1] = [-0.5,-0.5] (1)
    # sum = [0.5,0] + [0,0] + [-0.5,-0.5] = [0, -0.5]; n = 5
    out, n = pcgrad([g1, g2, g3])
    approx_list(out, [0.0, -0.5])
    assert n == 5


def test_pcgrad_per_parameter_lists():
    # params: p0 shape [2], p1 shape [1,1], p2 None everywhere
    # flattened: task 1 = [1, 0, 0], task 2 = [-1, 1, 0] -> same as the 2-D case, padded with 0:
    # combined [0.5, 1.5, 0] -> p0 = [0.5, 1.5], p1 = [[0]], p2 = None
    a = [t([1.0, 0.0]), t([[0.0]]), None]
    b = [t([-1.0, 1.0]), None, None]  # None for p1 in task 2 = zeros
    out, n = pcgrad([a, b])
    assert n == 2
    approx_list(out[0], [0.5, 1.5])
    assert out[1].shape == (1, 1)
    approx_list(out[1], [0.0])
    assert out[2] is None


def test_pcgrad_single_task_and_shape_kept():
    g = t([[3.0, -4.0]])
    out, n = pcgrad([g])
    assert out.shape == (1, 2) and n == 0
    approx_list(out, [3.0, -4.0])
