"""Replay against forgetting: an NLL term on general data mixed into every RL step.

Source: Ouyang et al. 2022, "Training language models to follow instructions with
human feedback" (InstructGPT), arXiv:2203.02155, eq. 2 (PPO-ptx): the RL objective
plus ``gamma * E_{x ~ D_pretrain}[log pi(x)]``. Here ``gamma = learner.replay.share``
and ``D`` is a JSONL file (`learner.replay.data`) of ``{"prompt", "completion"}``
demonstrations (loss on the completion and `<eos>`) or ``{"text"}`` lines (loss on all
of it).

Guarantees:
- The stream is deterministic for a given file and seed: it walks a seeded permutation
  of the examples and reshuffles after each full pass, so every example is seen once
  per pass.
- `replay_nll` is the token-mean NLL of the supervised tokens (HF's causal-LM loss with
  prompt and padding labelled -100, as in `learner.sft.make_batch`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["ReplayStream", "load_pairs", "replay_nll"]


def load_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs of a replay JSONL (`text` lines become ("", text))."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "text" in row:
            pairs.append(("", row["text"]))
        elif "prompt" in row and "completion" in row:
            pairs.append((row["prompt"], row["completion"]))
        else:
            raise ValueError(f"{path}:{n}: a replay line needs 'text' or 'prompt' + 'completion'")
    if not pairs:
        raise ValueError(f"{path}: no replay examples")
    return pairs


class ReplayStream:
    """Seeded batches of replay examples, tokenized for NLL."""

    def __init__(self, pairs: list[tuple[str, str]], tokenizer, seed: int = 0):
        self.pairs, self.tokenizer, self.rng = pairs, tokenizer, random.Random(seed)
        self.order: list[int] = []

    @classmethod
    def from_file(cls, path: str | Path, tokenizer, seed: int = 0) -> "ReplayStream":
        """Load a replay JSONL."""
        return cls(load_pairs(path), tokenizer, seed)

    def next_batch(self, n: int) -> dict:
        """The next `n` examples as input_ids / attention_mask / labels."""
        from learner.sft import make_batch

        picked = []
        while len(picked) < n:
            if not self.order:
                self.order = list(range(len(self.pairs)))
                self.rng.shuffle(self.order)
            picked.append(self.pairs[self.order.pop()])
        return make_batch(self.tokenizer, picked)


def replay_nll(model, batch: dict):
    """Token-mean NLL of the supervised tokens of `batch` (a graph-connected scalar)."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
