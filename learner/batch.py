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
from schemas import unpack_f32, unpack_i32


def pack_samples(rewards, pad_id: int) -> dict[str, torch.Tensor]:
    """Padded `input_ids`, `attention_mask`, `loss_mask`, `behavior_logp`, `rewards`, `group_ids`."""
    seqs, comp_lens, prompt_lens, behav = [], [], [], []
    for r in rewards:
        prompt = np.concatenate([unpack_i32(t.token_ids) for t in r.trajectory.turns if not t.trainable])
        comp_turns = [t for t in r.trajectory.turns if t.trainable]
        comp = np.concatenate([unpack_i32(t.token_ids) for t in comp_turns])
        seqs.append(np.concatenate([prompt, comp]))
        prompt_lens.append(len(prompt))
        comp_lens.append(len(comp))
        behav.append(np.concatenate([unpack_f32(t.logprobs) for t in comp_turns]))
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    loss_mask = np.zeros((B, L - 1), dtype=np.float32)
    behavior = np.zeros((B, L - 1), dtype=np.float32)
    for i, (s, p, c, b) in enumerate(zip(seqs, prompt_lens, comp_lens, behav)):
        ids[i, : len(s)] = s
        attn[i, : len(s)] = 1
        loss_mask[i, p - 1 : p - 1 + c] = 1.0
        behavior[i, p - 1 : p - 1 + c] = b
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


def grpo_loss(model, ref_model, batch: dict[str, torch.Tensor], *, beta: float, clip_low: float,
              clip_high: float, normalize_std: bool):
    """Group-relative advantages + clipped ratio + optional k3 KL; returns (loss, stats, advantages)."""
    adv = group_advantages(batch["rewards"], batch["group_ids"], normalize_std=normalize_std)
    logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    logp_ref = None
    if beta > 0:
        with torch.no_grad():
            logp_ref = token_logprobs(ref_model, batch["input_ids"], batch["attention_mask"])
    loss, stats = policy_loss(logp, batch["behavior_logp"], adv, batch["loss_mask"], clip_low=clip_low,
                              clip_high=clip_high, beta=beta, logp_ref=logp_ref)
    return loss, stats, adv
