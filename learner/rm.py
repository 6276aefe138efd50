"""Reward-model math and model handling: the Bradley-Terry loss, pair encoding, micro-batched
accumulation, held-out scoring and the Hugging Face export.

Sources: Bradley & Terry 1952 (paired comparisons); the pairwise reward-model loss of
Ouyang et al. 2022, arXiv:2203.02155, -log sigmoid(r_chosen - r_rejected); the margin of
Touvron et al. 2023 (Llama 2), arXiv:2307.09288, subtracted inside the sigmoid; the
centring term of Eisenstein et al. 2023, arXiv:2312.09244, coef * mean((r_c + r_r)^2).

Guarantees:
- `bt_loss` is the mean over pairs of -log sigmoid(r_c - r_r - margin), plus
  `center_coef * mean((r_c + r_r)^2)`; both are sums over pairs divided by the batch's
  pair count, so `accumulate` over length-sorted micro-batches of whole pairs gives the
  one-batch loss and gradient up to float rounding.
- `encode_pairs` tokenizes each side as the `model` verifier's classifier does
  (`side_ids`: prompt + response as ONE text, the tokenizer's EOS appended unless already
  last, as TRL's RewardTrainer does; a conversation as its chat template renders it),
  truncated from the left to `max_length`), so a pair
  trains on exactly what serving scores (tests/test_rm.py checks the two agree); an
  over-long side is truncated, never dropped, and counted (`Encoded.truncated`: pairs
  with a truncated side; `both_truncated`). On the bench's pairs the earlier form,
  `tokenizer(prompt, response)` with no EOS, reached 4-5 points lower held-out accuracy
  than TRL in the same steps (docs/benchmarks.md, rm_vs_trl).
- `load_reward_model` turns a causal LM (or a one-label classifier) into a one-label
  `AutoModelForSequenceClassification` with `pad_token_id` set; an architecture that
  transformers has no sequence-classification head for raises `RmModelError` naming it.
- `export` writes a plain HF directory (LoRA merged) plus the tokenizer and its chat
  template, which `AutoModelForSequenceClassification.from_pretrained` loads as-is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from learner.rm_data import Pair, render
from schemas.config.workers import RM_INPUT_FORM


class RmModelError(ValueError):
    """The base model cannot become a reward model (the message names its architecture)."""


@dataclass
class Encoded:
    """Token ids of every pair: chosen[i], rejected[i], margin[i]."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    margin: list[float]
    truncated: int = 0
    both_truncated: int = 0
    lengths: list[int] = field(default_factory=list)  # per pair: the longer side


def bt_loss(r_chosen, r_rejected, margin=None, center_coef: float = 0.0, *, pairs: int | None = None):
    """Bradley-Terry loss of reward tensors (module guarantees); `pairs` is the normaliser
    (default: this call's pair count; `accumulate` passes the whole batch's)."""
    import torch.nn.functional as F

    n = pairs if pairs is not None else r_chosen.shape[0]
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).sum() / n
    if center_coef:
        loss = loss + center_coef * ((r_chosen + r_rejected) ** 2).sum() / n
    return loss


def side_ids(tokenizer, text: str, text_pair: str | None, max_length: int) -> tuple[list[int], bool]:
    """(ids, truncated) of one side: text + text_pair as one text, EOS appended unless last,
    the last `max_length` ids kept (the `model` verifier's `classifier_ids`, module guarantees);
    a rendered conversation (`text_pair` None) is tokenized as rendered, as TRL does."""
    ids = tokenizer(text + (text_pair or ""))["input_ids"]
    eos = tokenizer.eos_token_id
    if text_pair is not None and eos is not None and (not ids or ids[-1] != eos):
        ids = ids + [eos]
    return ids[-max_length:], len(ids) > max_length


def encode_pairs(tokenizer, pairs: list[Pair], max_length: int) -> Encoded:
    """Token ids of both sides of every pair, as served (module guarantees)."""
    out = Encoded([], [], [p.margin for p in pairs])
    cut: dict[str, list[bool]] = {}
    for side in ("chosen", "rejected"):
        cut[side] = []
        for pair in pairs:
            ids, was_cut = side_ids(tokenizer, *render(tokenizer, pair, side), max_length)
            cut[side].append(was_cut)
            getattr(out, side).append(ids)
    out.lengths = [max(len(c), len(r)) for c, r in zip(out.chosen, out.rejected)]
    out.truncated = sum(a or b for a, b in zip(cut["chosen"], cut["rejected"]))
    out.both_truncated = sum(a and b for a, b in zip(cut["chosen"], cut["rejected"]))
    return out


def padded(rows: list[list[int]], pad_id: int, device):
    """Right-padded input_ids and attention_mask (the classifier pools the last real token)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def rewards(model, rows: list[list[int]], pad_id: int, device):
    """One forward: the scalar reward of each row (float32)."""
    ids, mask = padded(rows, pad_id, device)
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0].float()


def plan_pairs(enc: Encoded, rows: list[int], max_tokens: int) -> list[list[int]]:
    """Length-sorted micro-batches of whole pairs (`learner.step.plan_micro_batches` on the
    longer side; both sides count, so a micro-batch runs at most `max_tokens` positions)."""
    from learner.step import plan_micro_batches

    chunks = plan_micro_batches([enc.lengths[i] for i in rows], max(1, max_tokens // 2))
    return [[rows[j] for j in c] for c in chunks]


def micro_loss(
    model, enc: Encoded, rows: list[int], n_pairs: int, center_coef: float, pad_id: int, device, shared=False
):
    """(loss tensor scaled to the batch's `n_pairs`, chosen rewards, rejected rewards) of `rows`;
    `shared`: one row per pair, its prompt computed once (`learner.rm_shared`, same rewards)."""
    import torch

    if shared:
        from learner.rm_shared import pair_rewards

        rc, rr = pair_rewards(model, enc, rows, pad_id, device)
    else:
        r = rewards(model, [enc.chosen[i] for i in rows] + [enc.rejected[i] for i in rows], pad_id, device)
        rc, rr = r[: len(rows)], r[len(rows) :]
    margin = torch.tensor([enc.margin[i] for i in rows], dtype=torch.float32, device=device)
    return bt_loss(rc, rr, margin, center_coef, pairs=n_pairs), rc.detach(), rr.detach()


def accumulate(
    model, enc: Encoded, jobs: list[tuple[list[int], bool]], n_pairs: int, cfg, ctx, device, scale=1.0, shared=False
):
    """Backward every job's loss (a job: (rows, real); a padding job is zero-weighted, as
    `learner.sharded` pads ranks); `cfg` has `center_coef` and `pad_id`. Returns (loss sum,
    correct pairs) of the real jobs, read from the device once, after the last backward."""
    import torch

    loss_sum, correct = [], []
    for rows, real in jobs:
        with ctx():
            loss, rc, rr = micro_loss(model, enc, rows, n_pairs, cfg.center_coef, cfg.pad_id, device, shared)
        (loss * (scale if real else 0.0)).backward()
        if real:
            loss_sum.append(loss.detach())
            correct.append((rc > rr).sum())
    if not loss_sum:
        return 0.0, 0
    return float(torch.stack(loss_sum).sum()), int(torch.stack(correct).sum())


def score_all(
    model, enc: Encoded, pad_id: int, device, ctx, max_tokens: int, shared=False
) -> tuple[list[float], list[float]]:
    """Rewards of every pair's sides, without gradients, in length-sorted micro-batches."""
    import torch

    rc, rr = [0.0] * len(enc.chosen), [0.0] * len(enc.chosen)
    with torch.no_grad():
        for rows in plan_pairs(enc, list(range(len(enc.chosen))), max_tokens):
            with ctx():
                _, c, r = micro_loss(model, enc, rows, len(rows), 0.0, pad_id, device, shared)
            for i, a, b in zip(rows, c.tolist(), r.tolist()):
                rc[i], rr[i] = a, b
    return rc, rr


def load_reward_model(base: str | Path, *, lora_rank: int = 0, lora_alpha: float = 16.0, seed: int = 0):
    """(model, tokenizer): a one-label sequence classifier on `base` (module guarantees)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    base = Path(base)
    if not (base / "config.json").exists():
        raise RmModelError(f"base model {str(base)!r} is not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(base, local_files_only=True)
    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise RmModelError(
            f"base model {str(base)!r} (architecture {config.architectures}, model_type {config.model_type!r}) "
            "has no sequence-classification head in transformers; start from a decoder LM such as qwen2 or llama"
        )
    if getattr(config, "num_labels", 1) != 1 and any(
        a.endswith("ForSequenceClassification") for a in config.architectures or []
    ):
        raise RmModelError(f"base model {str(base)!r} is a {config.num_labels}-label classifier; a reward model has 1")
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)  # the new score head's initialisation
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, pad_token_id=tokenizer.pad_token_id, local_files_only=True, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS", bias="none"
        )
        model = get_peft_model(model, cfg)
    return model, tokenizer


def export(model, tokenizer, out: Path) -> Path:
    """Write the reward model as a plain HF classifier directory (LoRA merged); returns `out`."""
    from learner.lora import is_lora

    if is_lora(model):
        model = model.merge_and_unload()
    model.config.num_labels = 1
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.rlbus_rm_input = RM_INPUT_FORM  # the verifier serves exactly this form
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
