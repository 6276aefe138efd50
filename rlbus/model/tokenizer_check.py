"""Start-time check: the run's tokenizer can encode every character its domains produce.

Guarantees:
- `run_tokenizer(cfg)` is the tokenizer the run's policy will use: the checkpoint's
  (`model.path`, loaded with `AutoTokenizer`) or the one a built tiny model gets
  (`[model] tokenizer`, `rlbus.model.tiny_model.make_tokenizer`).
- `domain_texts(cfg)` samples each configured domain's prompts (and SFT demonstrations,
  where the domain has them) at every level from `min_level` to `max_level`, seeded, so
  the check is deterministic; a domain whose source cannot be built here is skipped (the
  sampler reports it).
- `tokenizer_problems(cfg, tok)` names, per domain, the characters `tok` cannot encode
  (`schemas.chat.unencodable`: unknown, or not decoded back); empty when all encode. The
  byte-level BPE encodes everything (`byte_level`: checked without sampling the domains); the char tokenizer only "\\n" and printable ASCII.
- `template_problems(cfg, tok)` names each domain with `tool_format = "json"` when `tok`
  has no chat template (json tools are declared in the system turn by the template).
"""

from __future__ import annotations

import random

from schemas.chat import unencodable


def run_tokenizer(cfg):
    """The tokenizer the run's model uses (see the module guarantees)."""
    if cfg.model.path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.path)
    from rlbus.model.tiny_model import make_tokenizer

    return make_tokenizer(cfg.model.tokenizer, cfg.run.seed)


def domain_texts(cfg, per_level: int = 8) -> dict[str, list[str]]:
    """domain -> sample prompt and demonstration texts (see the module guarantees)."""
    from producers.domains import TaskSkipped, make_source

    out: dict[str, list[str]] = {}
    for name, dc in cfg.sampler.domains.items():
        try:
            src = make_source("check", name, cfg)
        except (ValueError, OSError):
            continue
        rng, texts = random.Random(f"tokenizer-check-{cfg.run.seed}-{name}"), []
        for level in range(dc.min_level, dc.max_level + 1):
            for i in range(per_level):
                try:
                    texts += [m.content for m in src.make_task(rng, level, i).task.prompt]
                except TaskSkipped:  # the sampler skips (and counts) such a task too
                    continue
                if hasattr(src, "demonstration"):
                    try:
                        demo = src.demonstration(rng, level)
                    except ValueError:  # a domain with no gold answers has no demonstrations (no SFT either)
                        continue
                    texts += [demo[0], demo[1]] if isinstance(demo, tuple) else [t for t, _ in demo]
        out[name] = texts
    return out


PROBE = "\x00\x07\t\n ~é\u00ff\u03c0\u2211\u20ac\u4e2d\u0301\U0001f600\U0010fffd"
"""Characters across the byte ranges of UTF-8 (control, Latin-1, Greek, symbols, CJK, combining, emoji, plane 16)."""


def byte_level(tokenizer) -> bool:
    """True for a byte-level tokenizer (a ByteLevel pre-tokenizer whose alphabet round-trips PROBE): it encodes
    any text, so sampling the domains for unencodable characters (slow with a hundred generators) is skipped."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    return pre is not None and "ByteLevel" in repr(pre) and not unencodable(tokenizer, [PROBE])


def tokenizer_problems(cfg, tokenizer) -> list[str]:
    """One line per domain with characters `tokenizer` cannot encode; [] when all encode."""
    if byte_level(tokenizer):
        return []
    lines = []
    for name, texts in domain_texts(cfg).items():
        bad = unencodable(tokenizer, texts)
        if bad:
            lines.append(
                f"domain {name!r}: the tokenizer cannot encode {len(bad)} character(s): "
                + " ".join(repr(c) for c in bad[:40])
            )
    return lines


def template_problems(cfg, tokenizer) -> list[str]:
    """One line per `tool_format = "json"` domain when `tokenizer` has no chat template; [] otherwise."""
    from schemas.chat import has_template

    if has_template(tokenizer):
        return []
    return [
        f'domain {name!r} has tool_format = "json" but the model\'s tokenizer has no chat template '
        "(tokenizer_config.json `chat_template`, which declares the tools in the system turn); use a model "
        "dir whose tokenizer has one (model.tokenizer = 'bpe' builds one), or tool_format = \"tags\""
        for name, dc in cfg.sampler.domains.items()
        if dc.tool_format == "json"
    ]
