"""LoRA (learner/lora.py) through the real learner path: load_models wraps the policy, steps
train only the adapters (beta > 0 uses the base as reference), the published blob holds
only the adapter and is a small fraction of the model, and applying it to a fresh base
reproduces the trained model's logits (merged model, and the full-state blob an engine
loads)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bus.weight_blobs import apply_adapter_blob, blob_kind, load_state_bytes, merged_state_blob, state_to_bytes
from learner.lora import is_lora
from learner.step import load_models, train_step
from learner.weights import model_segments
from rlbus.model.tiny_model import build_tiny_model
from schemas.config import LearnerSection
from tests.test_learner_efficiency import samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=64
    )


def test_lora_trains_adapters_and_blob_reproduces_logits(model_dir):
    torch.manual_seed(0)
    lc = LearnerSection(lora={"rank": 4, "alpha": 8.0}, beta=0.05, lr=1e-2, threads=1)
    policy, ref, pad = load_models(model_dir, lc)
    assert is_lora(policy) and ref is None  # the base (adapters off) is the reference
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(policy.parameters(), lr=lc.lr)
    for seed in range(3):
        metrics = train_step(policy, ref, opt, samples(seed=seed), pad, lc)
    assert metrics["kl"] > 0.0
    assert all(torch.equal(p, base_before[n]) for n, p in policy.named_parameters() if not p.requires_grad)

    blob = b"".join(model_segments(policy))
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    full = state_to_bytes(base)
    assert blob_kind(blob) == "lora" and blob_kind(full) == "full"
    assert len(blob) < 0.1 * len(full)

    ids = torch.randint(4, 99, (2, 12))
    policy.eval()
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        merged = apply_adapter_blob(base, blob)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        assert not is_lora(merged)
        engine = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # what a rollout engine holds
        load_state_bytes(engine, merged_state_blob(base, blob))
        torch.testing.assert_close(engine(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        base_logits = base(input_ids=ids).logits  # the base itself stays untouched
        assert not torch.allclose(base_logits, want)
        torch.testing.assert_close(base_logits, AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids).logits)
