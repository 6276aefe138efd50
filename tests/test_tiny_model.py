"""Tiny char-level model: tokenizer round trip, build/reload offline, and a short SFT run."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.sft import make_batch, micro_batches, run_sft, sft_step_loss
from producers.demos import batches_of
from producers.domains import arith
from rlbus.model.tiny_model import build_char_tokenizer, build_tiny_model

ALL_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


def test_char_tokenizer_special_ids_and_vocab():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "<eos>", "<unk>")
    assert len(tok) == 99
    # one token per character, in order: "\n" is 3, then ASCII 32..126
    assert tok.encode(ALL_CHARS, add_special_tokens=True) == list(range(3, 99))


@pytest.mark.parametrize("text", ["12+34=46", "7-9=-2", "a b  c", " lead and trail ", "x*3\ny", ALL_CHARS, ""])
def test_char_tokenizer_round_trip(text):
    tok = build_char_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)  # no BOS, no EOS appended
    assert tok.decode(ids) == text


def test_char_tokenizer_padding_side_and_eos_decode():
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    batch = tok(["1+2=", "10+20="], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0][:2] == [0, 0]
    ids = tok.encode("42") + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "42"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_build_and_reload_offline(tmp_path, arch):
    out = build_tiny_model(tmp_path / arch, arch=arch)
    meta = json.loads((out / "rlbus_model.json").read_text())
    assert meta["arch"] == arch and 500_000 <= meta["params"] <= 5_000_000
    assert (out / "model.safetensors").exists()

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == meta["params"]
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert model.config.vocab_size == len(tok) == 99
    assert (model.config.pad_token_id, model.config.eos_token_id) == (0, 1)
    assert model.generation_config.eos_token_id == tok.eos_token_id == 1
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    # the reloaded tokenizer agrees with the in-memory one on ASCII text
    ref = build_char_tokenizer()
    assert tok.encode(ALL_CHARS) == ref.encode(ALL_CHARS)
    assert tok.decode(tok.encode(ALL_CHARS)) == ALL_CHARS

    # same seed, same weights
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "again", arch=arch))
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_make_batch_masks_prompt_and_padding():
    tok = build_char_tokenizer()
    b = make_batch(tok, [("1+2=", "3"), ("10+20=", "30")])
    ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
    assert ids.shape == (2, 9)
    assert tok.decode(ids[0, :6]) == "1+2=3<eos>" and ids[0, 6:].tolist() == [0, 0, 0]
    assert mask[0].tolist() == [1] * 6 + [0] * 3 and mask[1].tolist() == [1] * 9
    assert labels[0].tolist() == [-100] * 4 + tok.encode("3") + [1] + [-100] * 3
    assert labels[1].tolist() == [-100] * 6 + tok.encode("30") + [1]


def test_micro_batched_sft_step_is_the_full_batch_step(tmp_path):
    """SFT's length-sorted micro-batches give the gradient and loss of `model(**batch).loss`
    on the whole padded batch, for a batch that mixes bare answers with tool episodes."""
    from producers.domains import tool_calc

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    rng = random.Random(3)
    demos = [(p.prompt, p.completion) for p in (arith.generate(rng, 3) for _ in range(20))]
    demos += [tool_calc.demonstration(rng, 1, direct_share=0.5) for _ in range(12)]
    rng.shuffle(demos)
    batch = make_batch(tok, demos)
    parts = micro_batches(batch, 200)
    assert len(parts) > 2 and sum(len(p["input_ids"]) for p in parts) == len(demos)
    assert sum(p["input_ids"].numel() for p in parts) < 0.8 * batch["input_ids"].numel()  # padding dropped
    full = model(**batch).loss
    full.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got = sft_step_loss(model, batch, 200)
    assert got == pytest.approx(full.item(), rel=1e-5)
    for g, w in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_short_sft_reduces_loss(tmp_path):
    base = build_tiny_model(tmp_path / "base")

    def demos(rng: random.Random) -> tuple[str, str]:
        p = arith.generate(rng, 1)
        return p.prompt, p.completion

    out = tmp_path / "sft"
    # threads=1: with other processes on the CPU, 2 OpenMP threads can be several times slower
    threads_before = torch.get_num_threads()  # run_sft sets the process-wide count
    try:
        summary = run_sft(
            base, out, batches_of(demos, 0, 32), seconds=12, max_steps=50, lr=1e-2, threads=1, progress=False
        )
    finally:
        torch.set_num_threads(threads_before)
    assert 1 <= summary["steps"] <= 50 and summary["samples"] == 32 * summary["steps"]
    assert summary["final_loss"] < 0.5 * summary["first_loss"]
    assert json.loads((out / "sft.json").read_text())["steps"] == summary["steps"]
    assert AutoModelForCausalLM.from_pretrained(out) is not None
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 1
