"""A tiny causal LM, built locally (no hub), for CPU-scale RL runs: char or BPE tokenizer.

Guarantees:
- `build_char_tokenizer()` returns a `PreTrainedTokenizerFast` with a fixed vocabulary:
  `<pad>`=0, `<eos>`=1, `<unk>`=2, then "\\n" (3) and every printable ASCII character
  32..126 (4..98), one token per character; vocab size 99. Encoding adds no BOS and no
  EOS; `decode(encode(s)) == s` exactly for any text made of those characters (spaces
  included). Another character encodes to `<unk>` with this object; a tokenizer reloaded
  with `AutoTokenizer` from a qwen2 checkpoint (transformers' Qwen2Tokenizer) drops it
  instead. ASCII text encodes identically either way. `padding_side` is the caller's to set.
- `build_tiny_model(out_dir, ..., tokenizer="char"|"bpe")` writes a randomly initialised
  Qwen2 or Llama causal LM (tied embeddings, vocab size = the tokenizer's, pad/eos/bos ids
  consistent with it, bos == eos) plus the tokenizer with `save_pretrained` (safetensors),
  and `rlbus_model.json` with the arch, tokenizer and parameter count. `bpe` is
  `rlbus.model.bpe_tokenizer.build_bpe_tokenizer(seed)` (byte-level BPE with a ChatML chat
  template); `char` (this function's default, kept for the tests and configs tuned on it;
  the CLI and `[model] tokenizer` default to `bpe`) has no chat template. The directory loads back offline with
  `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
- The same arguments (including `seed`) always give the same weights.
- `rope_scaling=(kind, factor)` (`ROPE_KINDS`: linear, dynamic, yarn; factor > 1) writes
  HF's `rope_scaling` into the config: the model takes `max_position_embeddings` positions,
  its rotary embedding scaled by `factor` from an original context of
  `max_position_embeddings // factor` (`original_max_position_embeddings`, recorded with the
  rest in `rlbus_model.json`). `parse_rope_scaling("linear:4")` reads the CLI's form; anything
  else is a ValueError naming the form.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from schemas.config.run import ROPE_KINDS as ROPE_KINDS
from schemas.config.run import parse_rope_scaling  # one parser for the CLI and [model]

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = [PAD, EOS, UNK]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]


def _byte_level(ch: str) -> str:
    """GPT-2 byte-level alias of an ASCII character (" " -> "Ġ", "\\n" -> "Ċ", "!" -> "!")."""
    b = ord(ch)
    if 33 <= b <= 126:
        return ch
    # bytes outside the printable ranges map to 256 + their rank among such bytes;
    # for ASCII below 33 that rank is the byte value itself
    return chr(256 + b)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: specials, then "\\n" and printable ASCII, one id each.

    Tokens are stored in GPT-2 byte-level form (a BPE with no merges behind a ByteLevel
    pre-tokenizer and decoder). That is one token per ASCII character, and it is also
    exactly what transformers' Qwen2Tokenizer rebuilds from the saved vocabulary when
    `AutoTokenizer` loads a qwen2 checkpoint, so both load paths tokenize identically.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [_byte_level(c) for c in CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 16,
    )


def make_tokenizer(kind: str, seed: int = 0) -> PreTrainedTokenizerFast:
    """The tokenizer named by `[model] tokenizer`: `char` or `bpe`."""
    if kind == "char":
        return build_char_tokenizer()
    if kind == "bpe":
        from rlbus.model.bpe_tokenizer import build_bpe_tokenizer

        return build_bpe_tokenizer(seed)
    raise ValueError(f"unknown tokenizer {kind!r}: expected 'bpe' or 'char'")


def rope_config(max_position_embeddings: int, rope_scaling: tuple[str, float] | None) -> dict:
    """The config fields of a rope scaling (empty without one)."""
    if rope_scaling is None:
        return {}
    kind, factor = parse_rope_scaling(f"{rope_scaling[0]}:{rope_scaling[1]}")
    original = int(max_position_embeddings // factor)
    if original < 16:
        raise ValueError(
            f"rope scaling {kind}:{factor} leaves {original} original positions of {max_position_embeddings}; use fewer"
        )
    return {"rope_scaling": {"rope_type": kind, "factor": factor, "original_max_position_embeddings": original}}


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tokenizer: str = "char",
    rope_scaling: tuple[str, float] | None = None,
) -> Path:
    """Build, save and return the directory of a randomly initialised tiny causal LM.

    `intermediate_size` defaults to 4 * hidden_size (SwiGLU MLP, as in both archs).
    """
    rope = rope_config(max_position_embeddings, rope_scaling)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kind = tokenizer
    tokenizer = make_tokenizer(kind, seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **rope,
    )
    if arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}: expected 'qwen2' or 'llama'")
    torch.manual_seed(seed)
    model = cls(config)
    gc = model.generation_config
    gc.pad_token_id, gc.eos_token_id, gc.bos_token_id = (config.pad_token_id, config.eos_token_id, config.bos_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    meta = {
        "arch": arch,
        "tokenizer": kind,
        "params": n_params,
        "vocab_size": config.vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        **rope,
    }
    (out / "rlbus_model.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
