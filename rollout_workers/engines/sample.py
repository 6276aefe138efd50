"""`Sample`: one generated completion, what every rollout engine returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sample:
    """One generated completion: the prompt's token ids, the generated ids, the behaviour
    log-prob of each generated id, the decoded text, and `stop`/`length`."""

    prompt_ids: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    text: str
    finish_reason: str
