"""Off-policy correction (learner/offpolicy.py) against hand-computed values: truncated
importance sampling, decoupled PPO with a proximal policy, the on-policy limit, and the
staleness filter that runs before them."""

from __future__ import annotations

import math

import pytest
import torch

from learner.groups import Group, PooledSample, split_stale
from learner.losses import policy_loss
from learner.objectives import objective_loss
from learner.offpolicy import importance_weights, offpolicy_loss

E = math.e
NAN = float("nan")
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def tis_inputs():
    """rho = exp(new - behaviour) = [[1, e, 1/e], [0.5, 4, pad]]; with cap 2: w = [[1, 2, 1/e], [0.5, 2]]."""
    new = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.3, 0.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -1.5, -1.0], [-0.3 - math.log(0.5), -0.3 - math.log(4.0), NAN]])
    return new, behav


def test_importance_weights_truncate_at_cap():
    new, behav = tis_inputs()
    w, rho, trunc = importance_weights(new, behav, MASK, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 1 / E], [0.5, 2.0, 1.0]]))
    torch.testing.assert_close(rho, torch.tensor([[1.0, E, 1 / E], [0.5, 4.0, 1.0]]))
    assert trunc.tolist() == [[False, True, False], [False, True, False]]
    with pytest.raises(ValueError, match="tis_cap"):
        importance_weights(new, behav, MASK, cap=0.0)


def test_tis_grpo_value_grad_and_stats():
    new, behav = tis_inputs()
    loss, st = offpolicy_loss("tis", "grpo", new, behav, ADV, MASK, cap=2.0)
    row0 = -(1 + 2 + 1 / E) / 3  # -w * A, A = 1
    row1 = (0.5 * 2 + 2 * 2) / 2  # -w * A, A = -2
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-6)
    loss.backward()
    expected = torch.tensor([[-1 / 6, -2 / 6, -1 / E / 6], [0.25, 1.0, 0.0]])
    torch.testing.assert_close(new.grad, expected)
    assert st.is_weight_mean == pytest.approx((1 + E + 1 / E + 0.5 + 4) / 5, rel=1e-6)
    assert st.is_weight_max == pytest.approx(4.0)
    assert st.is_truncated_frac == pytest.approx(2 / 5)
    assert st.ratio_mean == pytest.approx(1.0) and st.clip_frac == 0.0 and st.tokens == 5


def test_tis_dapo_token_mean():
    new, behav = tis_inputs()
    loss, _ = offpolicy_loss("tis", "dapo", new, behav, ADV, MASK, cap=2.0)
    assert loss.item() == pytest.approx((-(1 + 2 + 1 / E) + (1 + 4)) / 5, rel=1e-6)


def test_decoupled_clips_against_proximal_and_weights_by_truncated_is():
    prox = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    r = torch.tensor([[1.5, 1.0, 0.5], [1.5, 0.5, 1.0]])  # pi_theta / pi_prox
    rho = torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.5, 1.0]])  # pi_prox / mu  -> w = [[1, 2, .5], [1, 1.5]]
    new = (prox + r.log()).requires_grad_(True)
    behav = prox - rho.log()
    loss, st = offpolicy_loss(
        "decoupled", "grpo", new, behav, ADV, MASK, cap=2.0, clip_low=0.2, clip_high=0.2, logp_prox=prox
    )
    # row 0 (A=1): min(rA, clip(r)A) = [1.2 (clipped), 1.0, 0.5]; -w*obj = [-1.2, -2.0, -0.25]
    # row 1 (A=-2): [-3.0, -1.6 (clipped)]; -w*obj = [3.0, 2.4]
    assert loss.item() == pytest.approx((-3.45 / 3 + 5.4 / 2) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp of -w r A / (n_i * B) on unclipped tokens, 0 on clipped ones
    expected = torch.tensor([[0.0, -2 / 6, -0.25 / 6], [0.75, 0.0, 0.0]])
    torch.testing.assert_close(new.grad, expected)
    assert st.clip_frac == pytest.approx(2 / 5)
    assert st.is_truncated_frac == pytest.approx(1 / 5) and st.is_weight_max == pytest.approx(3.0)


def test_decoupled_default_proximal_equals_tis():
    """One optimizer step per batch: the proximal policy is the current one, r == 1, no clip."""
    new, behav = tis_inputs()
    a, _ = offpolicy_loss("tis", "grpo", new, behav, ADV, MASK, cap=2.0)
    (ga,) = torch.autograd.grad(a, new)
    b, st = offpolicy_loss("decoupled", "grpo", new, behav, ADV, MASK, cap=2.0)
    (gb,) = torch.autograd.grad(b, new)
    assert a.item() == pytest.approx(b.item()) and st.clip_frac == 0.0
    torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo"])
def test_on_policy_limit_matches_uncorrected(mode, kind):
    """Behaviour == current policy: weights are 1 and the loss equals the `none` objective."""
    torch.manual_seed(0)
    new = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.float32)
    adv, ref = torch.tensor([0.5, -1.0, 2.0]), torch.randn(3, 4)
    a, sa = offpolicy_loss(mode, kind, new, new.detach(), adv, mask, beta=0.1, logp_ref=ref)
    (ga,) = torch.autograd.grad(a, new)
    b, sb = objective_loss(kind, new, new.detach(), adv, mask, beta=0.1, logp_ref=ref)
    (gb,) = torch.autograd.grad(b, new)
    assert a.item() == pytest.approx(b.item(), rel=1e-6) and sa.kl == pytest.approx(sb.kl, rel=1e-6)
    torch.testing.assert_close(ga, gb)
    assert sa.is_weight_mean == pytest.approx(1.0) and sa.is_truncated_frac == 0.0


def test_masked_nan_and_errors():
    new, behav = tis_inputs()
    behav[1, 2] = float("inf")
    loss, _ = offpolicy_loss("decoupled", "grpo", new, behav, ADV, MASK)
    loss.backward()
    assert torch.isfinite(loss) and new.grad[1, 2] == 0.0
    with pytest.raises(ValueError, match="gspo"):
        offpolicy_loss("tis", "gspo", new, behav, ADV, MASK)
    with pytest.raises(ValueError, match="mode"):
        offpolicy_loss("vtrace", "grpo", new, behav, ADV, MASK)
    with pytest.raises(ValueError, match="logp_ref"):
        offpolicy_loss("tis", "grpo", new, behav, ADV, MASK, beta=0.1)


def test_stale_samples_dropped_before_correction():
    """Versions 10-6 (=max_staleness) are kept and corrected; older ones leave the group."""
    from tests.test_learner_units import reward

    group = Group("g", "tm-g", 4, 0.0)
    for i, v in enumerate([10, 6, 5, 3]):
        group.samples[i] = PooledSample(reward("g", i, size=4, version=v), raw=None)
    dropped = split_stale(group, current_version=10, max_staleness=4)
    assert sorted(s.reward.trajectory.policy_version for s in dropped) == [3, 5]
    assert sorted(s.reward.trajectory.policy_version for s in group.samples.values()) == [6, 10]


def test_policy_loss_is_the_none_mode():
    new, behav = tis_inputs()
    behav = torch.where(MASK.bool(), behav, torch.zeros_like(behav))
    a, _ = policy_loss(new, behav, ADV, MASK)
    b, _ = objective_loss("grpo", new, behav, ADV, MASK)
    assert a.item() == b.item()
