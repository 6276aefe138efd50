"""Turning pooled groups into padded tensors and computing the policy loss.

Guarantees:
- Sequences are prompt + generated tokens, right-padded; the loss mask covers exactly
  the generated (trainable) tokens, aligned so position t scores token t+1.
- Behaviour log-probs are placed at the same positions as the new log-probs.
- Everything is vectorised; the only Python loop is over samples while packing.
"""

from __future__ import annotations

import numpy as np
import torch

from learner.losses import group_advantages, policy_loss
from learner.objectives import compute_advantages, objective_loss
from schemas import unpack_f32, unpack_i32


def pack_samples(rewards, pad_id: int) -> dict[str, torch.Tensor]:
    """Padded `input_ids`, `attention_mask`, `loss_mask`, `behavior_logp`, `rewards`, `group_ids`.

    Turns are concatenated in episode order; each trainable turn's tokens are covered by
    the loss mask and carry their behaviour log-probs, tool/prompt turns are context only.
    """
    seqs, spans = [], []  # spans: per sample, (offset, length, logprobs) of trainable turns
    for r in rewards:
        parts, sample_spans, offset = [], [], 0
        for t in r.trajectory.turns:
            ids = unpack_i32(t.token_ids)
            if t.trainable and len(ids):
                sample_spans.append((offset, len(ids), unpack_f32(t.logprobs)))
            parts.append(ids)
            offset += len(ids)
        if not sample_spans or sample_spans[0][0] == 0:
            raise ValueError(f"reward {r.msg_id}: a trajectory needs context tokens before its first trainable turn")
        seqs.append(np.concatenate(parts))
        spans.append(sample_spans)
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    loss_mask = np.zeros((B, L - 1), dtype=np.float32)
    behavior = np.zeros((B, L - 1), dtype=np.float32)
    for i, (s, sample_spans) in enumerate(zip(seqs, spans)):
        ids[i, : len(s)] = s
        attn[i, : len(s)] = 1
        for off, n, lp in sample_spans:  # position t scores token t+1
            loss_mask[i, off - 1 : off - 1 + n] = 1.0
            behavior[i, off - 1 : off - 1 + n] = lp
    group_index = {g: k for k, g in enumerate(dict.fromkeys(r.trajectory.group_id for r in rewards))}
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "loss_mask": torch.from_numpy(loss_mask),
        "behavior_logp": torch.from_numpy(behavior),
        "rewards": torch.tensor([r.reward for r in rewards], dtype=torch.float32),
        "group_ids": torch.tensor([group_index[r.trajectory.group_id] for r in rewards], dtype=torch.long),
    }


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position: [B, L-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def grpo_loss(
    model,
    ref_model,
    batch: dict[str, torch.Tensor],
    *,
    beta: float,
    clip_low: float,
    clip_high: float,
    normalize_std: bool,
    objective: str = "grpo",
    kl: str = "k3",
):
    """Group-relative advantages + clipped ratio + optional KL; returns (loss, stats, advantages).

    `objective` picks the GRPO-family member (`learner.objectives`): `grpo` (advantages
    std-normalised when `normalize_std`), `dr_grpo`, `dapo`, `gspo`; `kl` the estimator.
    """
    if objective == "grpo":
        adv = group_advantages(batch["rewards"], batch["group_ids"], normalize_std=normalize_std)
    else:
        adv = compute_advantages(objective, batch["rewards"], batch["group_ids"])
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    logp_ref = None
    if beta > 0:
        with torch.no_grad():
            logp_ref = token_logprobs(ref_model, batch["input_ids"], batch["attention_mask"])
    if objective == "grpo" and kl == "k3":
        loss, stats = policy_loss(
            logp,
            batch["behavior_logp"],
            adv,
            batch["loss_mask"],
            clip_low=clip_low,
            clip_high=clip_high,
            beta=beta,
            logp_ref=logp_ref,
        )
    else:
        loss, stats = objective_loss(
            objective,
            logp,
            batch["behavior_logp"],
            adv,
            batch["loss_mask"],
            clip_low=clip_low,
            clip_high=clip_high,
            beta=beta,
            kl=kl,
            logp_ref=logp_ref,
        )
    return loss, stats, adv
