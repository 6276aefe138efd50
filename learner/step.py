"""One learner step: model loading and the GRPO update (moved out of worker.py)."""

from __future__ import annotations

from pathlib import Path

from learner.groups import PooledSample


def load_models(model_path: Path, lc):
    """Policy (trainable), reference (frozen, only when beta > 0), tokenizer pad id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(lc.threads)
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    policy.train()
    ref = None
    if lc.beta > 0:
        ref = AutoModelForCausalLM.from_pretrained(model_path).eval()
        ref.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(model_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return policy, ref, pad


def train_step(policy, ref, optimizer, samples: list[PooledSample], pad_id: int, lc) -> dict[str, float]:
    """One GRPO step on the given samples (runs in a worker thread)."""
    if policy is None:  # null policy: the bus benchmark measures everything but the math
        return {"reward_mean": sum(s.reward.reward for s in samples) / len(samples), "samples": len(samples)}
    import torch

    from learner.batch import grpo_loss, pack_samples

    batch = pack_samples([s.reward for s in samples], pad_id)
    optimizer.zero_grad(set_to_none=True)
    loss, stats, adv = grpo_loss(policy, ref, batch, beta=lc.beta, clip_low=lc.clip_low,
                                 clip_high=lc.clip_high, normalize_std=lc.normalize_std,
                                 objective=lc.objective, kl=lc.kl_estimator)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), lc.grad_clip)
    optimizer.step()
    return {"loss": stats.loss, "pg_loss": stats.pg_loss, "kl": stats.kl, "clip_frac": stats.clip_frac,
            "ratio_mean": stats.ratio_mean, "ratio_max": stats.ratio_max, "tokens": stats.tokens,
            "grad_norm": float(grad_norm), "reward_mean": float(batch["rewards"].mean()),
            "adv_abs_mean": float(adv.abs().mean()), "samples": len(samples)}
