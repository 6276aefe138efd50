"""Learner efficiency on a tiny model: length-bucketed micro-batches with gradient
accumulation give the one-batch loss and gradient; padding_frac; activation
checkpointing and bf16 autocast; PCGrad wired into the step."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.groups import PooledSample
from learner.objectives import aggregate_tokens
from learner.pcgrad import pcgrad
from learner.step import (
    bf16_problem,
    compute_context,
    enable_activation_checkpointing,
    load_models,
    padding_fraction,
    plan_micro_batches,
    train_step,
)
from schemas.config import LearnerSection
from tests.test_learner_units import reward

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(**TINY)


def samples(n_groups: int = 3, size: int = 2, seed: int = 0, domains=("arith",)) -> list[PooledSample]:
    """Groups of varied prompt/completion lengths, behaviour log-probs a little off-policy."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = tuple(rng.randrange(4, 99) for _ in range(rng.randrange(2, 12)))
        for i in range(size):
            comp = tuple(rng.randrange(4, 99) for _ in range(rng.randrange(1, 20)))
            logp = [-4.6 + rng.uniform(-0.5, 0.5) for _ in comp]
            r = reward(f"g{g}", i, size=size, prompt=prompt, comp=comp, logp=logp, value=float(rng.random()))
            traj = r.trajectory.model_copy(update={"domain": domains[g % len(domains)]})
            r = r.model_copy(update={"trajectory": traj})
            out.append(PooledSample(r, raw=None))
    return out


def grads_of(model_dir, batch, **cfg) -> tuple[dict, list[torch.Tensor]]:
    """Metrics and the gradient a step leaves behind (lr 0, no clipping)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    lc = LearnerSection(grad_clip=1e9, **cfg)
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval() if lc.beta > 0 else None
    if lc.activation_checkpointing:
        enable_activation_checkpointing(model)
    metrics = train_step(model, ref, torch.optim.SGD(model.parameters(), lr=0.0), batch, 0, lc)
    return metrics, [p.grad.clone() for p in model.parameters()]


def assert_grads_close(a, b, rtol=1e-4, atol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def test_plan_micro_batches_buckets_by_length():
    lengths = [5, 20, 6, 19]
    chunks = plan_micro_batches(lengths, max_tokens=40)
    assert chunks == [[1, 3], [2, 0]]
    assert padding_fraction(lengths, chunks) == pytest.approx(1 - 50 / 52)
    assert plan_micro_batches(lengths, max_rows=3) == [[1, 3, 2], [0]]
    assert plan_micro_batches(lengths) == [[1, 3, 2, 0]]
    assert plan_micro_batches([50, 3], max_tokens=10) == [[0], [1]]  # too long: alone


@pytest.mark.parametrize(
    "cfg",
    [
        dict(objective="grpo"),
        dict(objective="dr_grpo"),
        dict(objective="dapo", beta=0.05, kl_estimator="k1"),
        dict(objective="gspo", clip_low=0.5, clip_high=0.5),
        dict(objective="grpo", off_policy={"mode": "decoupled"}, beta=0.05),
        dict(objective="dapo", off_policy={"mode": "tis", "tis_cap": 1.5}),
    ],
)
def test_micro_batched_loss_and_grad_equal_one_batch(model_dir, cfg):
    batch = samples()
    full, g_full = grads_of(model_dir, batch, micro_batch_max_padding=0.0, **cfg)  # one padded batch
    micro, g_micro = grads_of(model_dir, batch, micro_batch_tokens=48, micro_batch_max_padding=0.0, **cfg)
    assert full["micro_batches"] == 1 and micro["micro_batches"] > 2
    assert micro["padding_frac"] < full["padding_frac"]
    for k in ("loss", "pg_loss", "kl"):
        assert micro[k] == pytest.approx(full[k], rel=1e-4, abs=1e-6)
    assert micro["tokens"] == full["tokens"]
    assert_grads_close(g_full, g_micro)
    if cfg.get("off_policy"):
        assert 0.0 <= micro["is_truncated_frac"] <= 1.0 and micro["is_weight_max"] >= micro["is_weight_mean"]


def test_activation_checkpointing_same_grad(model_dir):
    batch = samples()
    _, a = grads_of(model_dir, batch)
    _, b = grads_of(model_dir, batch, activation_checkpointing=True, micro_batch_size=2)
    assert_grads_close(a, b)


NO_BF16 = bf16_problem("cpu")
needs_bf16 = pytest.mark.skipif(NO_BF16 is not None, reason=f"no native bf16 on this CPU: {NO_BF16}")


@needs_bf16
def test_bf16_autocast_step_close_to_fp32(model_dir):
    batch = samples()
    fp32, _ = grads_of(model_dir, batch)
    bf16, g = grads_of(model_dir, batch, dtype="bf16")
    assert bf16["loss"] == pytest.approx(fp32["loss"], abs=0.05)
    assert all(torch.isfinite(x).all() for x in g)


def test_pcgrad_step_projects_domain_gradients(model_dir):
    """Step gradient == PCGrad of the per-domain gradients, each with its batch share."""
    batch = samples(n_groups=4, domains=("arith", "code"))
    metrics, combined = grads_of(model_dir, batch, pcgrad=True, micro_batch_size=3)
    per_domain = []
    for d in ("arith", "code"):
        part = [s for s in batch if s.reward.trajectory.domain == d]
        _, g = grads_of(model_dir, part)
        per_domain.append([x * len(part) / len(batch) for x in g])  # grpo share: sequences
    expected, n = pcgrad(per_domain)
    assert metrics["pcgrad_conflicts"] == n and metrics["pcgrad_conflict_frac"] == n / 2
    assert_grads_close(combined, expected)
    plain, g_plain = grads_of(model_dir, batch)
    # the GRPO loss is a sum of terms that nearly cancel (advantages sum to 0 per group), so
    # its relative error under another summation order (micro-batches of 3) is large: absolute
    assert plain["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
    if n == 0:
        assert_grads_close(combined, g_plain)


def test_beta_zero_loads_no_reference(model_dir):
    policy, ref, pad = load_models(model_dir, LearnerSection(beta=0.0, threads=1))
    assert ref is None and pad == 0 and policy.training
    _, ref = load_models(model_dir, LearnerSection(beta=0.1, threads=1))[:2]
    assert ref is not None and not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_bf16_needs_autocast_on_the_device():
    if NO_BF16 is None:
        assert compute_context("bf16", torch.device("cpu")) is not None
    else:  # a CPU without AVX-512 BF16 / AMX (e.g. AVX2 only): the clear start-up error
        with pytest.raises(RuntimeError, match="set learner.dtype = 'fp32'"):
            compute_context("bf16", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="dtype = 'fp32'"):
        compute_context("bf16", torch.device("meta"))


def test_aggregate_tokens_per_kind():
    tok = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate_tokens("grpo", tok, mask).item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate_tokens("dapo", tok, mask).item() == pytest.approx(7.0 / 3)
    assert aggregate_tokens("dr_grpo", tok, mask, max_len=10).item() == pytest.approx(7.0 / 20)


def test_the_padding_cap_keeps_mixed_lengths_under_ten_percent():
    import random

    rng = random.Random(0)
    for n in (8, 64, 256):
        lengths = [rng.randint(64, 512) for _ in range(n)]
        assert padding_fraction(lengths, plan_micro_batches(lengths)) > 0.25  # one batch pads to the longest
        capped = plan_micro_batches(lengths, max_padding=0.1)
        assert padding_fraction(lengths, capped) <= 0.1
        assert sorted(i for c in capped for i in c) == list(range(n))  # every sample exactly once
        assert len(capped) <= max(4, n // 4), len(capped)
