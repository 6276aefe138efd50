"""One learner step: load the models, then turn a list of pooled samples into one update.

`train_step` reads top to bottom: pack the batch -> advantages over the whole batch ->
length-bucketed micro-batches -> per micro-batch loss (GRPO family, or off-policy
corrected) scaled by its share of the batch normaliser, backward (accumulate) -> with
PCGrad, the same per domain and the domain gradients projected -> replay NLL term ->
clip -> optimizer step -> metrics.

Guarantees:
- Micro-batching is exact: advantages and every normaliser (sequences with tokens,
  masked tokens, rows x generation budget) are taken over the whole batch and each
  micro-batch's loss is scaled by its share, so the accumulated loss and gradient equal
  the one-batch ones up to float rounding (right padding never changes a real token's
  log-prob under the causal mask).
- Micro-batches are formed from length-sorted samples (length bucketing), each padded
  only to its own longest sample; `padding_frac` = padded / all positions actually run.
- With PCGrad (Yu et al. 2020, arXiv:2001.06782; `learner.pcgrad`) the per-domain
  gradients sum to the plain gradient when no pair conflicts.
- Replay (`learner.replay`) adds `replay.share * NLL` on a replay batch; 0 = no
  replay forward at all.
- `beta == 0` never runs a reference model; with LoRA the reference is the base model
  (adapters disabled), so no second copy is loaded.
- `dtype = "bf16"` runs forwards under `torch.autocast(bfloat16)` with fp32 master
  weights, and fails at load time with a clear error where autocast is unavailable or
  the hardware has no native bf16 (`bf16_problem`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from pathlib import Path

from learner.groups import PooledSample

_REPLAY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # policy -> ReplayStream


def load_models(model_path: Path, lc):
    """Policy (trainable), reference (frozen, only when beta > 0 and no LoRA), tokenizer pad id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(lc.threads)
    compute_context(lc.dtype, torch.device("cpu"))  # fail early if bf16 autocast is unavailable
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    policy.train()
    if lc.activation_checkpointing:
        enable_activation_checkpointing(policy)
    ref = None
    if lc.lora.rank > 0:
        from learner.lora import wrap_lora

        policy = wrap_lora(
            policy,
            rank=lc.lora.rank,
            alpha=lc.lora.alpha,
            dropout=lc.lora.dropout,
            target_modules=lc.lora.target_modules,
        )
    elif lc.beta > 0:
        ref = AutoModelForCausalLM.from_pretrained(model_path).eval()
        ref.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(model_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return policy, ref, pad


def enable_activation_checkpointing(model) -> None:
    """Recompute activations in backward (non-reentrant), whichever name this transformers uses."""
    model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compute_context(dtype: str, device):
    """`nullcontext` for fp32; bf16 autocast on `device` (clear error where unsupported)."""
    import torch

    if dtype == "fp32":
        return contextlib.nullcontext()
    if dtype != "bf16":
        raise ValueError(f"learner.dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if not torch.amp.is_autocast_available(device.type):
        raise RuntimeError(
            f"learner.dtype = 'bf16' needs torch.autocast on {device.type!r}, which this torch "
            f"({torch.__version__}) does not support; use dtype = 'fp32'"
        )
    problem = bf16_problem(device.type)
    if problem:
        raise RuntimeError(problem)
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=4)
def bf16_problem(device_type: str) -> str | None:
    """None where `device_type` computes in bf16 natively, else the one-line reason and fix:
    CUDA must report `is_bf16_supported`; a CPU needs oneDNN (mkldnn) with bf16 and, on
    Linux, the AVX-512 BF16 or AMX-BF16 instructions (without them bf16 is emulated, slower
    than fp32)."""
    import torch

    fix = "set learner.dtype = 'fp32'"
    if device_type == "cuda":
        return None if torch.cuda.is_bf16_supported() else f"learner.dtype = 'bf16': this GPU has no bf16; {fix}"
    if device_type != "cpu":
        return None
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return f"learner.dtype = 'bf16': this torch/CPU has no oneDNN bf16 support; {fix}"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = set(cpuinfo.read_text().split())
        if not flags & {"avx512_bf16", "amx_bf16"}:
            return (
                f"learner.dtype = 'bf16': this CPU ({torch.backends.cpu.get_cpu_capability()}) lacks AVX-512 BF16 "
                f"and AMX-BF16, so bf16 would only be emulated; {fix}"
            )
    return None


# ------------------------------------------------------------------ micro-batches


def plan_micro_batches(
    lengths: list[int], max_tokens: int = 0, max_rows: int = 0, max_padding: float = 0.0
) -> list[list[int]]:
    """Split sample indices into micro-batches of length-sorted samples.

    A micro-batch holds at most `max_rows` samples (0 = no limit) and at most
    `max_tokens` padded positions, rows x its longest sample (0 = no limit; a sample
    longer than the budget gets a micro-batch of its own). With `max_padding` > 0, a
    micro-batch also closes before the next (shorter) sample would raise its padded share
    above `max_padding`, so every micro-batch, and the step, pads at most that fraction.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    real = 0
    for i in order:
        cur = chunks[-1] if chunks else None
        width = lengths[cur[0]] if cur else 0
        fits = (
            cur is not None
            and (not max_rows or len(cur) < max_rows)
            and (not max_tokens or (len(cur) + 1) * width <= max_tokens)
            and (not max_padding or 1.0 - (real + lengths[i]) / ((len(cur) + 1) * max(1, width)) <= max_padding)
        )
        if fits:
            cur.append(i)
            real += lengths[i]
        else:
            chunks.append([i])
            real = lengths[i]
    return chunks


def padding_fraction(lengths: list[int], chunks: list[list[int]]) -> float:
    """Padded positions / all positions over the micro-batches."""
    total = sum(len(c) * max(lengths[i] for i in c) for c in chunks)
    return 1.0 - sum(lengths) / total if total else 0.0


def take_rows(batch: dict, rows: list[int]) -> dict:
    """The micro-batch of `rows`, trimmed to its longest sample."""
    import torch

    idx = torch.tensor(rows)
    width = int(batch["attention_mask"][idx].sum(dim=1).max())
    return {
        "input_ids": batch["input_ids"][idx, :width],
        "attention_mask": batch["attention_mask"][idx, :width],
        "loss_mask": batch["loss_mask"][idx, : width - 1],
        "behavior_logp": batch["behavior_logp"][idx, : width - 1],
        "rows": idx,
    }


def loss_share(kind: str, mask_part, mask_full) -> float:
    """The part's share of the batch normaliser of `kind` (see `learner.objectives.aggregate_tokens`)."""
    if kind == "dapo":
        num, den = (mask_part != 0).sum(), (mask_full != 0).sum()
    elif kind == "dr_grpo":
        num, den = mask_part.shape[0], mask_full.shape[0]
    else:  # grpo, gspo: sequences with at least one token
        num, den = (mask_part != 0).any(dim=1).sum(), (mask_full != 0).any(dim=1).sum()
    return float(num) / float(den) if float(den) > 0 else 0.0


# ------------------------------------------------------------------ losses


def batch_advantages(batch: dict, lc):
    """Group-relative advantages over the whole batch, as the objective's paper defines them."""
    from learner.losses import group_advantages
    from learner.objectives import compute_advantages

    if lc.objective == "grpo":
        return group_advantages(batch["rewards"], batch["group_ids"], normalize_std=lc.normalize_std)
    return compute_advantages(lc.objective, batch["rewards"], batch["group_ids"])


def reference_logprobs(policy, ref, mb: dict):
    """Reference log-probs without gradients: the frozen reference, or the LoRA base."""
    import torch

    from learner.batch import token_logprobs
    from learner.lora import is_lora

    with torch.no_grad():
        if ref is not None:
            return token_logprobs(ref, mb["input_ids"], mb["attention_mask"])
        if is_lora(policy):
            with policy.disable_adapter():
                return token_logprobs(policy, mb["input_ids"], mb["attention_mask"])
    raise ValueError("beta > 0 needs a reference model (or LoRA, whose base is the reference)")


def micro_loss(policy, ref, mb: dict, adv, lc, max_len: int):
    """(loss, stats) of one micro-batch with the batch-level `max_len` (Dr. GRPO budget)."""
    from learner.batch import token_logprobs
    from learner.objectives import objective_loss
    from learner.offpolicy import offpolicy_loss

    logp = token_logprobs(policy, mb["input_ids"], mb["attention_mask"])
    logp_ref = reference_logprobs(policy, ref, mb) if lc.beta > 0 else None
    common = dict(
        clip_low=lc.clip_low,
        clip_high=lc.clip_high,
        beta=lc.beta,
        kl=lc.kl_estimator,
        logp_ref=logp_ref,
        max_len=max_len,
    )
    if lc.off_policy.mode == "none":
        return objective_loss(lc.objective, logp, mb["behavior_logp"], adv, mb["loss_mask"], **common)
    return offpolicy_loss(
        lc.off_policy.mode,
        lc.objective,
        logp,
        mb["behavior_logp"],
        adv,
        mb["loss_mask"],
        cap=lc.off_policy.tis_cap,
        **common,
    )


def accumulate(policy, ref, batch: dict, adv, chunks: list[list[int]], lc) -> list[tuple[float, object]]:
    """Backward every micro-batch's share-scaled loss (gradients add up); [(share, stats)]."""
    max_len = batch["loss_mask"].shape[1]
    parts = []
    for rows in chunks:
        mb = take_rows(batch, rows)
        share = loss_share(lc.objective, mb["loss_mask"], batch["loss_mask"])
        with compute_context(lc.dtype, batch["input_ids"].device):
            loss, stats = micro_loss(policy, ref, mb, adv[mb["rows"]], lc, max_len)
        if share > 0 and loss.requires_grad:
            (loss * share).backward()
        parts.append((share, stats))
    return parts


def merge_stats(parts: list[tuple[float, object]]) -> dict[str, float]:
    """Batch stats from micro-batch stats: loss terms by share, ratios token-weighted, maxima."""
    import math

    tokens = sum(s.tokens for _, s in parts)

    def tok_mean(field: str) -> float:
        vals = [(s.tokens, getattr(s, field)) for _, s in parts if s.tokens and not math.isnan(getattr(s, field))]
        n = sum(t for t, _ in vals)
        return sum(t * v for t, v in vals) / n if n else float("nan")

    def nan_max(field: str) -> float:
        vals = [getattr(s, field) for _, s in parts if not math.isnan(getattr(s, field))]
        return max(vals) if vals else float("nan")

    out = {k: sum(share * getattr(s, k) for share, s in parts) for k in ("loss", "pg_loss", "kl")}
    out.update(
        clip_frac=tok_mean("clip_frac"),
        ratio_mean=tok_mean("ratio_mean"),
        ratio_max=nan_max("ratio_max"),
        tokens=tokens,
    )
    return out


def offpolicy_stats(parts) -> dict[str, float]:
    """Importance-weight statistics of the off-policy correction."""
    import math

    vals = [(s.tokens, s) for _, s in parts if s.tokens and not math.isnan(s.is_weight_mean)]
    n = sum(t for t, _ in vals) or 1
    return {
        "is_weight_mean": sum(t * s.is_weight_mean for t, s in vals) / n,
        "is_weight_max": max((s.is_weight_max for _, s in vals), default=float("nan")),
        "is_truncated_frac": sum(t * s.is_truncated_frac for t, s in vals) / n,
    }


# ------------------------------------------------------------------ PCGrad and replay


def pcgrad_accumulate(policy, ref, batch: dict, adv, lengths, domains: list[str], lc):
    """Per-domain gradients (each with its global share), combined with PCGrad into `.grad`.

    Returns (parts, chunks, metrics) where metrics hold `pcgrad_conflicts` (projections
    applied) and `pcgrad_conflict_frac` (over the K*(K-1) ordered domain pairs).
    """
    from learner.pcgrad import pcgrad

    params = [p for p in policy.parameters() if p.requires_grad]
    grads, parts, chunks = [], [], []
    for d in sorted(set(domains)):
        idx = [i for i, x in enumerate(domains) if x == d]
        dchunks = [
            [idx[j] for j in c]
            for c in plan_micro_batches(
                [lengths[i] for i in idx], lc.micro_batch_tokens, lc.micro_batch_size, lc.micro_batch_max_padding
            )
        ]
        for p in params:
            p.grad = None
        parts += accumulate(policy, ref, batch, adv, dchunks, lc)
        chunks += dchunks
        grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
    combined, n_conflicts = pcgrad(grads)
    for p, g in zip(params, combined):
        p.grad = g
    k = len(grads)
    return (
        parts,
        chunks,
        {"pcgrad_conflicts": float(n_conflicts), "pcgrad_conflict_frac": n_conflicts / (k * (k - 1)) if k > 1 else 0.0},
    )


def replay_stream(policy, lc):
    """The policy's replay stream (built on first use from `lc.replay.data` and the model's tokenizer)."""
    from transformers import AutoTokenizer

    from learner.replay import ReplayStream

    if policy not in _REPLAY:
        if not lc.replay.data:
            raise ValueError("learner.replay.share > 0 needs learner.replay.data (a JSONL file)")
        tok = AutoTokenizer.from_pretrained(policy.name_or_path)
        _REPLAY[policy] = ReplayStream.from_file(lc.replay.data, tok)
    return _REPLAY[policy]


def replay_backward(policy, lc, replay=None) -> float:
    """Backward `replay.share * NLL` of the next replay batch; returns the NLL."""
    import torch

    from learner.replay import replay_nll

    replay = replay or replay_stream(policy, lc)
    batch = replay.next_batch(lc.replay.batch_size)
    with compute_context(lc.dtype, torch.device("cpu")):
        nll = replay_nll(policy, batch)
    (lc.replay.share * nll).backward()
    return float(nll.detach())


# ------------------------------------------------------------------ the step


def skipped_loss_scale(kind: str, trained: list, skipped: list) -> float:
    """The factor that turns a loss normalised over the `trained` rewards into the loss over
    `trained` + `skipped` (all-equal groups, advantage 0: they would add nothing to the sum,
    only to the normaliser): sequences for `grpo`, `gspo` and `dr_grpo` (its normaliser is
    sequences x width), generated tokens for `dapo`. 1.0 when nothing was skipped."""
    if not skipped:
        return 1.0
    if kind == "dapo":
        from schemas import unpack_i32

        def tokens(rs) -> int:  # the tokens the loss mask counts: those of trainable turns
            return sum(len(unpack_i32(t.token_ids)) for r in rs for t in r.trajectory.turns if t.trainable)

        return tokens(trained) / max(1, tokens(trained) + tokens(skipped))
    return len(trained) / (len(trained) + len(skipped))


def train_step(
    policy, ref, optimizer, samples: list[PooledSample], pad_id: int, lc, replay=None, loss_scale: float = 1.0
) -> dict[str, float]:
    """One update on the given samples (runs in a worker thread); returns step metrics.
    `loss_scale` multiplies the policy loss's gradient (not the replay NLL's): see
    `skipped_loss_scale`."""
    if policy is None:  # null policy: the bus benchmark measures everything but the math
        return {"reward_mean": sum(s.reward.reward for s in samples) / len(samples), "samples": len(samples)}
    import torch

    from learner.batch import pack_samples

    rewards = [s.reward for s in samples]
    batch = pack_samples(rewards, pad_id)
    adv = batch_advantages(batch, lc)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    optimizer.zero_grad(set_to_none=True)
    extra: dict[str, float] = {}
    domains = [r.trajectory.domain for r in rewards]
    if lc.pcgrad and len(set(domains)) > 1:
        parts, chunks, extra = pcgrad_accumulate(policy, ref, batch, adv, lengths, domains, lc)
    else:
        chunks = plan_micro_batches(lengths, lc.micro_batch_tokens, lc.micro_batch_size, lc.micro_batch_max_padding)
        parts = accumulate(policy, ref, batch, adv, chunks, lc)
    if loss_scale != 1.0:
        for p in policy.parameters():
            if p.grad is not None:
                p.grad.mul_(loss_scale)
        extra["loss_scale"] = loss_scale
    if lc.off_policy.mode != "none":
        extra.update(offpolicy_stats(parts))
    if lc.replay.share > 0:
        extra["replay_nll"] = replay_backward(policy, lc, replay)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], lc.grad_clip)
    optimizer.step()
    return {
        **merge_stats(parts),
        "grad_norm": float(grad_norm),
        "reward_mean": float(batch["rewards"].mean()),
        "adv_abs_mean": float(adv.abs().mean()),
        "samples": len(samples),
        "micro_batches": len(chunks),
        "padding_frac": padding_fraction(lengths, chunks),
        **extra,
    }
