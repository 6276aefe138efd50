"""Replay against forgetting (learner/replay.py): the JSONL reader, the seeded stream, and a
small end-to-end check on a tiny model: after SFT on the shipped general data
(examples/data/replay.jsonl: single-digit sums and copy tasks), RL steps on an unrelated
task raise the held-out copy-task NLL much less when the replay term is on."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.batch import pack_samples, token_logprobs
from learner.groups import PooledSample
from learner.replay import ReplayStream, load_pairs, replay_nll
from learner.sft import make_batch
from learner.step import train_step
from rlbus.model.tiny_model import build_char_tokenizer, build_tiny_model
from schemas.config import LearnerSection
from tests.test_learner_units import reward

REPLAY = Path(__file__).resolve().parents[1] / "examples" / "data" / "replay.jsonl"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def test_load_pairs_formats_and_errors(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"text": "hello"}\n\n{"prompt": "1+1=", "completion": "2"}\n')
    assert load_pairs(p) == [("", "hello"), ("1+1=", "2")]
    p.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="r.jsonl:1"):
        load_pairs(p)
    p.write_text("\n")
    with pytest.raises(ValueError, match="no replay examples"):
        load_pairs(p)


def test_stream_is_seeded_and_covers_each_example_once_per_pass():
    tok = build_char_tokenizer()
    pairs = [(f"{i}=", str(i)) for i in range(7)]
    a, b = ReplayStream(pairs, tok, seed=3), ReplayStream(pairs, tok, seed=3)
    first = [a.next_batch(7)["input_ids"] for _ in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(first, [b.next_batch(7)["input_ids"] for _ in range(2)]))
    seen = sorted(tok.decode(row[:2]) for row in first[0])
    assert seen == sorted(p for p, _ in pairs)


def held_out_nll(model, tok, pairs) -> float:
    model.eval()
    with torch.no_grad():
        nll = float(replay_nll(model, make_batch(tok, pairs)))
    model.train()
    return nll


def sft(model, tok, pairs, steps: int, seed: int = 0) -> None:
    stream = ReplayStream(pairs, tok, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = replay_nll(model, stream.next_batch(16))
        opt.zero_grad()
        loss.backward()
        opt.step()


def task_b_samples(model, tok, rng) -> list[PooledSample]:
    """Groups on an unrelated task ('?' -> 'zzzz' rewarded), with on-policy behaviour log-probs."""
    out = []
    for g in range(4):
        prompt = tok.encode(f"?{rng.randrange(10)}:")
        comps = [tok.encode("zzzz"), tok.encode("".join(rng.choice(LETTERS) for _ in range(4)))]
        rs = [
            reward(f"g{g}", i, prompt=tuple(prompt), comp=tuple(c), logp=[0.0] * len(c), value=float(i == 0))
            for i, c in enumerate(comps)
        ]
        batch = pack_samples(rs, 0)
        with torch.no_grad():
            lp = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
        for i, (r, c) in enumerate(zip(rs, comps)):
            logp = lp[i, len(prompt) - 1 : len(prompt) - 1 + len(c)].tolist()
            out.append(
                PooledSample(
                    reward(f"g{g}", i, prompt=tuple(prompt), comp=tuple(c), logp=logp, value=r.reward), raw=None
                )
            )
    return out


def rise_after_task_b(model, tok, held_out, lc, steps: int) -> float:
    before = held_out_nll(model, tok, held_out)
    opt = torch.optim.AdamW(model.parameters(), lr=lc.lr)
    rng = random.Random(1)
    for _ in range(steps):
        metrics = train_step(model, None, opt, task_b_samples(model, tok, rng), 0, lc)
    assert (lc.replay.share > 0) == ("replay_nll" in metrics)
    return held_out_nll(model, tok, held_out) - before


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_replay_reduces_forgetting(tmp_path, one_thread):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    path = build_tiny_model(tmp_path / "m", hidden_size=48, num_layers=2, num_heads=4, max_position_embeddings=32)
    base = AutoModelForCausalLM.from_pretrained(path)
    rng = random.Random(99)
    held_out = []  # copy tasks on strings drawn apart from the shipped file
    while len(held_out) < 32:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        held_out.append((f"copy:{s}=", s))
    untrained = held_out_nll(base, tok, held_out)
    sft(base, tok, load_pairs(REPLAY), steps=100)
    assert held_out_nll(base, tok, held_out) < untrained - 1.0  # the general data was learned
    common = dict(lr=1e-2)
    plain = rise_after_task_b(copy.deepcopy(base), tok, held_out, LearnerSection(**common), steps=10)
    mixed = rise_after_task_b(
        copy.deepcopy(base),
        tok,
        held_out,
        LearnerSection(replay={"share": 1.0, "data": str(REPLAY), "batch_size": 16}, **common),
        steps=10,
    )
    print(f"held-out NLL rise: without replay {plain:.3f}, with replay {mixed:.3f}")
    assert plain > 0.5
    assert mixed < 0.25 * plain
