"""`Sample`: one generated completion, what every rollout engine returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sample:
    """One generated completion: the prompt's token ids, the generated ids, the behaviour
    log-prob of each generated id, the decoded text, and `stop`/`length`; `runs`: the weight
    versions that generated its ids, `[(version, n_tokens), ...]` in order, when generated in
    chunks with in-flight weight updates (`rollout_workers.inflight`), else None."""

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    finish_reason: str
    runs: list[tuple[int, int]] | None = None
