"""Supervised warm start: teach a small causal LM the answer format before RL.

Guarantees:
- `run_sft` trains on batches taken from any iterator of demo lists (what makes them,
  e.g. `producers.demos`, is the caller's business). A demo is a `(prompt, completion)`
  pair (the loss covers the completion), or, for multi-turn episodes, a list of
  `(text, trainable)` segments (the loss covers the trainable ones: the model's own
  turns, never prompts or tool observations). A segment whose flag is `None` is the
  model's own text left unsupervised: it is encoded as model text and seen as context,
  but not trained on (a teacher's digits the student cannot learn, `producers.domains.tool_calc`).
  Every sequence ends with a supervised `<eos>`; prompt, context and padding are masked with -100. Batches are right-padded.
- Demos are tokenized as rollout tokenizes episodes (`schemas.chat`): with a chat
  template, the first (context) segment is the prompt rendered as a user message with
  the generation prompt, later context segments are tool turns as the template renders
  a tool message, model segments are their text encoded alone, and the closing token is
  the tokenizer's eos (`<|im_end|>` for the BPE tokenizer). Without a template every
  segment is its text encoded alone, as before. A json-format tool demo
  (`schemas.tool_protocol.ToolDemo`) declares its `tools` in the prompt's system turn,
  as rollout renders a `tool_format = "json"` task's prompt.
- It stops at `seconds` of wall time or `max_steps` optimizer steps, whichever comes
  first, and always takes at least one step.
- Each step's gradient is the batch's mean loss over its supervised tokens, computed in
  length-sorted micro-batches of at most `micro_batch_tokens` padded tokens
  (`sft_step_loss`), so short rows are not padded to a long row's length.
- AdamW, linear warmup then cosine decay to 10% of `lr` over the run's progress
  (the larger of step fraction and time fraction), gradient clipping at 1.0.
- The same `seed` and batches give the same weights, unless the time budget is what
  stops the run.
- The trained model and tokenizer are written to `out_dir` with `save_pretrained`, and
  the returned summary dict is also written as `out_dir/sft.json`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, AutoTokenizer

from schemas.chat import encode_text, has_template, prompt_ids, tool_turn, user_prompt

Segments = list[tuple[str, bool | None]]
Demo = "tuple[str, str] | Segments"


def as_segments(demo) -> Segments:
    """A demo as (text, trainable) segments: a (prompt, completion) pair becomes two."""
    if isinstance(demo, tuple) and len(demo) == 2 and isinstance(demo[1], str):
        return [(demo[0], False), (demo[1], True)]
    return list(demo)


def segment_ids(tokenizer, segments: Segments, tools: list[dict] | None = None) -> list[list[int]]:
    """Token ids of each segment, as rollout renders the same episode (module guarantees);
    `tools` (a json-format demo's `ToolDemo.tools`) are declared in the prompt's system turn."""
    if not has_template(tokenizer):
        return tokenizer([t for t, _ in segments], add_special_tokens=False)["input_ids"]
    out = []
    for k, (text, train) in enumerate(segments):
        if train or train is None:  # None: model text, not supervised (module guarantees)
            out.append(encode_text(tokenizer, text))
        elif k == 0:  # an empty prompt (a replay `text` line) stays empty: plain text, no turn markers
            out.append(prompt_ids(tokenizer, user_prompt(text), tools) if text else [])
        else:
            out.append(tool_turn(tokenizer, text)[1])
    return out


def make_batch(tokenizer, demos: list) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels for demos (pairs or segment lists)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, masks = [], []
    for demo in demos:
        segments = as_segments(demo)
        encoded = segment_ids(tokenizer, segments, getattr(demo, "tools", None))
        ids = [i for part in encoded for i in part] + [eos]
        sup = [bool(train) for part, (_, train) in zip(encoded, segments) for _ in part] + [True]
        rows.append(ids)
        masks.append(sup)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    supervised = torch.zeros((len(rows), width), dtype=torch.bool)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        input_ids[i, : len(r)] = torch.tensor(r)
        supervised[i, : len(m)] = torch.tensor(m)
        attention_mask[i, : len(r)] = 1
    labels = torch.where(supervised, input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


CHUNK_OVERHEAD_TOKENS = 256
"""What one more forward/backward call costs, in padded tokens (the tiny model's per-call
overhead on CPU); `micro_batches` weighs it against the padding a cut saves."""


def micro_batches(batch: dict[str, torch.Tensor], max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """`batch`'s rows sorted by length and cut into micro-batches of at most `max_tokens`
    padded tokens (at least one row each), each trimmed to its own longest row: the same
    rows and labels, without padding short rows to a long one's length (a batch that
    mixes bare answers with tool episodes). The cuts minimise padded tokens plus
    `CHUNK_OVERHEAD_TOKENS` per micro-batch (exact, over the sorted rows)."""
    lengths = batch["attention_mask"].sum(dim=1)
    order = torch.argsort(lengths, stable=True).tolist()
    ls = [int(lengths[i]) for i in order]
    n = len(ls)
    best, cut = [0] + [None] * n, [0] * (n + 1)  # best[j]: cost of rows[:j]; cut[j]: where its last chunk starts
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            size = (j - i) * ls[j - 1]
            if size > max_tokens and i < j - 1:
                break  # longer chunks ending at j only grow
            cost = best[i] + size + CHUNK_OVERHEAD_TOKENS
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], n
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    out = []
    for i, j in reversed(bounds):
        rows = order[i:j]
        out.append({k: v[rows, : ls[j - 1]] for k, v in batch.items()})
    return out


def sft_step_loss(model, batch: dict[str, torch.Tensor], max_tokens: int) -> float:
    """Backpropagate the batch's mean next-token loss over its supervised tokens (as
    `model(**batch).loss`), computed in length-sorted micro-batches (`micro_batches`):
    the same gradient up to float rounding, at the cost of the real tokens. Returns the loss."""
    total = int((batch["labels"][:, 1:] != -100).sum())
    loss_sum = 0.0
    for mb in micro_batches(batch, max_tokens):
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        part = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
            mb["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (part / max(1, total)).backward()
        loss_sum += part.item()
    return loss_sum / max(1, total)


def lr_factor(progress: float, step: int, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 to 0.1 as progress goes 0 -> 1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def run_sft(
    model_dir: str | Path,
    out_dir: str | Path,
    batches: Iterable[list[Demo]],
    *,
    seconds: float,
    max_steps: int,
    lr: float = 3e-3,
    seed: int = 0,
    threads: int = 2,
    progress: bool = True,
    micro_batch_tokens: int = 2048,
) -> dict:
    """Supervised fine-tuning on `batches` until `seconds` or `max_steps`; returns a summary.

    Summary keys: steps, final_loss (mean of the last 10 step losses), first_loss,
    seconds (training wall time), samples (sequences seen), lr, batch_size (of the first batch).
    """
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    batches = iter(batches)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    warmup = max(1, min(50, max_steps // 10))

    bar = Progress(
        TextColumn("[bold]sft"),
        BarColumn(),
        TextColumn("step {task.fields[step]}"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        disable=not progress,
    )
    task = bar.add_task("sft", total=1.0, step=0, loss=float("nan"))
    losses: list[float] = []
    step, samples, batch_size, t0 = 0, 0, 0, time.monotonic()
    with bar:
        while True:
            elapsed = time.monotonic() - t0
            done = max(step / max_steps, elapsed / seconds) if seconds > 0 else 1.0
            if step > 0 and done >= 1.0:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr * lr_factor(done, step, warmup)
            drawn = next(batches)
            samples += len(drawn)
            batch_size = batch_size or len(drawn)
            optimizer.zero_grad(set_to_none=True)
            loss = sft_step_loss(model, make_batch(tokenizer, drawn), micro_batch_tokens)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            losses.append(loss)
            bar.update(task, completed=min(done, 1.0), step=step, loss=losses[-1])
        bar.update(task, completed=1.0)
    train_seconds = time.monotonic() - t0

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = losses[-10:]
    summary = {
        "steps": step,
        "final_loss": sum(tail) / len(tail),
        "first_loss": losses[0],
        "seconds": round(train_seconds, 3),
        "samples": samples,
        "lr": lr,
        "batch_size": batch_size,
    }
    (out / "sft.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
