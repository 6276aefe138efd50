"""What the long-context domains (`findoc`, `recall`) share: length as the level, token counts
of the run's tokenizer, the prompt budget, and fitting a document to a length.

Guarantees:
- `lengths(ctx)` is the domain's `params.lengths` (default `DEFAULT_LENGTHS`), strictly
  increasing token counts; curriculum level i (1-based, as `DomainConfig` levels are) is
  `lengths[i - 1]`. A `max_level` beyond the list, or a malformed list, is a config error
  (ValueError naming the fix).
- `TokenCounter.of(ctx)` counts tokens with the run's tokenizer: `params.tokenizer` (a local
  HF tokenizer folder), else `model.path`, else the run folder's prepared model
  (`<run_dir>/<run_id>/model/start`, else `model/base`, written by `rlbus up` before any
  domain is built). With none of them, `DomainUnavailable` says what to set: a document's
  length is never guessed from characters. A prompt is counted as the engine receives it:
  `schemas.chat.prompt_ids` (through the chat template when the tokenizer has one).
- `prompt_budget(ctx, counter)` is `params.max_prompt_tokens` when set, else the engine's
  context (the model's `max_position_embeddings`, capped by `rollout.max_context_tokens`)
  minus the task's generation budget: a prompt over it cannot be generated from.
- `fit(...)` keeps every essential block and adds optional ones, in the order given, while
  the whole prompt stays within the target; the result is checked with one full count.
- `check_levels(...)` raises `DomainUnavailable` when no configured level's length (or probe
  document) fits the budget (the run goes on without the domain, with the reason); otherwise
  it returns the levels that do not fit: the source refuses every task drawn at one of them,
  and any single document over the budget, and counts them (`prompt_too_long`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.domains import DomainContext, DomainUnavailable
from schemas import ChatMessage
from schemas.chat import prompt_ids

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Token lengths of levels 1, 2, ... when `params.lengths` is not given."""


def lengths(ctx: DomainContext) -> tuple[int, ...]:
    """The domain's level lengths (see the module guarantees)."""
    raw = ctx.dc.params.get("lengths", DEFAULT_LENGTHS)
    where = f"sampler.domains.{ctx.name}.params.lengths"
    if not isinstance(raw, (list, tuple)) or not raw or not all(type(x) is int and x >= 64 for x in raw):
        raise ValueError(f"{where} must be a non-empty list of token counts >= 64, e.g. [512, 1024, 2048], got {raw!r}")
    if any(b <= a for a, b in zip(raw, raw[1:])):
        raise ValueError(f"{where} must increase strictly (level i -> lengths[i-1]), got {list(raw)}")
    if ctx.dc.max_level > len(raw):
        raise ValueError(
            f"sampler.domains.{ctx.name}.max_level {ctx.dc.max_level} > the {len(raw)} lengths of {where}; "
            f"lower max_level or add lengths"
        )
    return tuple(raw)


def length_of(levels: tuple[int, ...], level: int) -> int:
    """The token length of curriculum `level` (clamped into the list)."""
    return levels[max(1, min(level, len(levels))) - 1]


def _model_dir(ctx: DomainContext) -> Path | None:
    cfg = ctx.cfg
    if cfg.model.path:
        return Path(cfg.model.path)
    if cfg.run.run_id:
        run = Path(cfg.run.run_dir) / cfg.run.run_id / "model"
        for sub in ("start", "base"):
            if (run / sub / "tokenizer_config.json").is_file():
                return run / sub
    return None


@dataclass
class TokenCounter:
    """Token counts of prompts and texts under one HF tokenizer."""

    tokenizer: Any
    source: str
    """Where the tokenizer came from (for messages)."""
    positions: int | None = None
    """The model's `max_position_embeddings` when its config was found beside the tokenizer."""

    @classmethod
    def of(cls, ctx: DomainContext) -> TokenCounter:
        """The run's tokenizer (see the module guarantees)."""
        given = ctx.dc.params.get("tokenizer")
        where = Path(str(given)) if given else _model_dir(ctx)
        if where is None or not where.is_dir():
            raise DomainUnavailable(
                f"domain {ctx.name!r} measures documents in tokens of the run's tokenizer, and none is here "
                f"({'params.tokenizer ' + repr(str(given)) + ' is not a folder' if given else 'no model.path and no prepared run model'}); "
                f"set sampler.domains.{ctx.name}.params.tokenizer to a local tokenizer folder, or model.path"
            )
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(where))
        except (OSError, ValueError) as exc:
            raise DomainUnavailable(f"domain {ctx.name!r}: no tokenizer loads from {where}: {exc}") from exc
        positions = None
        config = where / "config.json"
        if config.is_file():
            positions = json.loads(config.read_text()).get("max_position_embeddings")
        return cls(tok, str(where), int(positions) if positions else None)

    def prompt(self, prompt: list[ChatMessage]) -> int:
        """Tokens of a prompt as the engine receives it."""
        return len(prompt_ids(self.tokenizer, prompt))

    def text(self, text: str) -> int:
        """Tokens of a text alone."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def texts(self, texts: list[str]) -> list[int]:
        """Tokens of each text alone (one batched call)."""
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]


def prompt_budget(ctx: DomainContext, counter: TokenCounter) -> int:
    """Most prompt tokens a task of this domain may have (see the module guarantees)."""
    given = ctx.dc.params.get("max_prompt_tokens")
    if given is not None:
        if type(given) is not int or given < 16:
            raise ValueError(f"sampler.domains.{ctx.name}.params.max_prompt_tokens must be an int >= 16, got {given!r}")
        return given
    cfg = ctx.cfg
    positions = counter.positions or cfg.model.max_position_embeddings
    context = min(positions, cfg.rollout.max_context_tokens)
    return context - (ctx.dc.max_tokens or cfg.sampler.max_tokens)


def fit(
    counter: TokenCounter, render, essential: list[Any], optional: list[Any], target: int
) -> tuple[list[ChatMessage], list[Any], int]:
    """(prompt, blocks kept, tokens): `render(blocks)` of the essential blocks plus as many of
    the optional ones (in order) as keep the prompt within `target` tokens. Blocks are added
    by their own token counts (texts are joined at blank lines, so counts nearly add up) and
    the result is counted whole; while it is over `target`, the last added optional block goes."""
    kept = list(essential)
    used = counter.prompt(render(kept))
    for block, n in zip(optional, counter.texts([b.text for b in optional])):
        cost = n + 1
        if used + cost <= target:
            kept.append(block)
            used += cost
    while True:
        prompt = render(kept)
        tokens = counter.prompt(prompt)
        if tokens <= target or len(kept) <= len(essential):
            return prompt, kept, tokens
        kept.pop()


def check_levels(ctx: DomainContext, levels: tuple[int, ...], budget: int, probe) -> list[int]:
    """The configured levels whose length, or whose probe document (`probe(level)`: a fitted
    prompt's token count), exceeds `budget`; `DomainUnavailable` when that is every level."""
    dc = ctx.dc
    over = {lvl: max(probe(lvl), length_of(levels, lvl)) for lvl in range(dc.min_level, dc.max_level + 1)}
    too_long = [lvl for lvl, n in over.items() if n > budget]
    if len(too_long) == len(over):
        raise DomainUnavailable(
            f"domain {ctx.name!r}: every level's document is longer than max_prompt_tokens {budget} "
            f"(levels {dc.min_level}..{dc.max_level}: {', '.join(f'{lvl}: {n} tokens' for lvl, n in over.items())}); "
            f"use shorter params.lengths, a model with a longer context, or a larger rollout.max_context_tokens"
        )
    return too_long
