"""PCGrad at a hundred domains: the Gram-matrix form equals the textbook loop (Yu et al. 2020,
Algorithm 1, fixed order), and a learner step with 100 domains in its batch projects them."""

from __future__ import annotations

import pytest
import torch

from learner.pcgrad import pcgrad


def loop_reference(flat: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Algorithm 1 over the vectors themselves, in float64."""
    flat = [g.double() for g in flat]
    sq = [float(g @ g) for g in flat]
    total, n = torch.zeros_like(flat[0]), 0
    for i, g in enumerate(flat):
        gi = g.clone()
        for j, gj in enumerate(flat):
            if j != i and sq[j] > 0 and float(gi @ gj) < 0:
                gi, n = gi - (gi @ gj) / sq[j] * gj, n + 1
        total = total + gi
    return total, n


@pytest.mark.parametrize("k", [4, 10, 100])
def test_gram_form_equals_the_loop(k):
    gen = torch.Generator().manual_seed(k)
    shared = torch.randn(300, generator=gen)
    flat = [(0.5 if i % 2 else -0.5) * shared + torch.randn(300, generator=gen) for i in range(k)]
    flat[1] = torch.zeros(300)  # a domain without gradient is never projected against
    got, n = pcgrad(flat)
    want, n_want = loop_reference(flat)
    assert n == n_want and n > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_learner_step_with_a_hundred_domains(tmp_path):
    from transformers import AutoModelForCausalLM

    from learner.groups import PooledSample
    from learner.step import train_step
    from rlbus.model.tiny_model import build_tiny_model
    from schemas.config import LearnerSection
    from tests.test_learner_units import reward

    model_dir = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2)
    batch = []
    for g in range(100):
        for i in range(2):
            r = reward(f"g{g}", i, prompt=(5 + g % 7, 6, 7), comp=(8 + i, 9 + g % 5), value=float((g + i) % 2))
            traj = r.trajectory.model_copy(update={"domain": f"d{g:03d}"})
            batch.append(PooledSample(r.model_copy(update={"trajectory": traj}), raw=None))
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    metrics = train_step(
        model, None, torch.optim.SGD(model.parameters(), lr=0.0), batch, 0, LearnerSection(pcgrad=True, grad_clip=1e9)
    )
    assert metrics["micro_batches"] == 100 and 0.0 <= metrics["pcgrad_conflict_frac"] <= 1.0
    assert metrics["pcgrad_conflicts"] == metrics["pcgrad_conflict_frac"] * 100 * 99
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
