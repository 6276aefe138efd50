"""Reward-model rewards of a micro-batch with each pair's shared prompt computed once.

A pair's chosen and rejected rows start with the same tokens: `learner.rm.encode_pairs`
tokenizes (question, response) as a pair, so the question's ids are the same on both
sides (conversations rendered through a chat template share their rendered prompt too).
Under causal attention those prefix positions do not depend on what follows, so one row
`[prefix | chosen suffix | rejected suffix]`, with positions `[0, L) [L, L+a) [L, L+b)` and
a mask under which the rejected suffix does not see the chosen suffix, gives each side's
last hidden state as its own row would: L + a + b positions per pair instead of the
2 * (L + max(a, b)) of two right-padded rows. The loss is unchanged (same rewards).

Guarantees:
- `shared_prefix_len(c, r)`: the longest common prefix of the two rows that leaves at
  least one token of each side outside it (each side is pooled at its own last token).
- `supports(model)`: True only for a plain HF `...ForSequenceClassification` (not LoRA,
  not FSDP-sharded) of a decoder family whose attention is causal over all positions with
  rotary positions (`FAMILIES`; no sliding window), with a linear `score` head and sdpa or
  eager attention. Anything else is scored with two rows per pair (`learner.rm.rewards`).
- `pair_rewards(model, enc, rows, pad_id, device)`: (r_chosen, r_rejected) float32
  tensors equal to `learner.rm.rewards` on the two separate rows up to float rounding
  (tests/test_rm.py checks rewards and gradients). Padding queries attend only to
  themselves, so no row of the mask is empty (no NaN in forward or backward).
"""

from __future__ import annotations

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
PREFIX, CHOSEN, REJECTED, PAD = 0, 1, 2, 3


def shared_prefix_len(chosen: list[int], rejected: list[int]) -> int:
    """Common prefix length of the two rows, leaving >= 1 own token on each side."""
    n = min(len(chosen), len(rejected)) - 1
    k = 0
    while k < n and chosen[k] == rejected[k]:
        k += 1
    return max(0, k)


def supports(model) -> bool:
    """Whether `pair_rewards` may score `model` (module guarantees)."""
    import torch

    from learner.lora import is_lora

    if is_lora(model) or not type(model).__name__.endswith("ForSequenceClassification"):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            return False
    except ImportError:  # pragma: no cover (torch without FSDP2)
        pass
    config = model.config
    if config.model_type not in FAMILIES or getattr(config, "use_sliding_window", False):
        return False
    if getattr(config, "sliding_window", None) and config.model_type == "mistral":
        return False
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return (
        body is not None
        and isinstance(getattr(model, "score", None), torch.nn.Linear)
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
    )


def pack(enc, rows: list[int], pad_id: int):
    """(ids, positions, segments, chosen_last, rejected_last) tensors of one row per pair."""
    import torch

    seqs, poss, segs, last_c, last_r = [], [], [], [], []
    for i in rows:
        c, r = enc.chosen[i], enc.rejected[i]
        n = shared_prefix_len(c, r)
        a, b = len(c) - n, len(r) - n
        seqs.append(c + r[n:])
        poss.append(list(range(n + a)) + list(range(n, n + b)))
        segs.append([PREFIX] * n + [CHOSEN] * a + [REJECTED] * b)
        last_c.append(n + a - 1)
        last_r.append(n + a + b - 1)
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)
    pos = torch.tensor([p + [0] * (width - len(p)) for p in poss], dtype=torch.long)
    seg = torch.tensor([s + [PAD] * (width - len(s)) for s in segs], dtype=torch.long)
    return ids, pos, seg, torch.tensor(last_c), torch.tensor(last_r)


def attention_mask(seg, impl: str, dtype):
    """(n, 1, W, W) mask: causal, no padding keys, the rejected suffix blind to the chosen
    one, each position sees itself; bool for sdpa (True = attend), additive for eager."""
    import torch

    width = seg.shape[1]
    idx = torch.arange(width)
    causal = (idx[:, None] >= idx[None, :])[None]
    q, k = seg[:, :, None], seg[:, None, :]
    allowed = causal & (k != PAD) & ~((q == REJECTED) & (k == CHOSEN))
    allowed = allowed | torch.eye(width, dtype=torch.bool)[None]
    if impl == "sdpa":
        return allowed[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def pair_rewards(model, enc, rows: list[int], pad_id: int, device):
    """(r_chosen, r_rejected) of `rows`, one packed row per pair (module guarantees)."""
    import torch

    ids, pos, seg, last_c, last_r = pack(enc, rows, pad_id)
    mask = attention_mask(seg, model.config._attn_implementation, torch.float32)
    body = getattr(model, model.base_model_prefix)
    hidden = body(
        input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device), use_cache=False
    ).last_hidden_state
    at = torch.arange(len(rows), device=hidden.device)
    picked = torch.cat([hidden[at, last_c.to(hidden.device)], hidden[at, last_r.to(hidden.device)]])
    r = model.score(picked)[:, 0].float()
    return r[: len(rows)], r[len(rows) :]
