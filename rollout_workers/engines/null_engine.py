"""The model-free engines: `null` (`NullEngine`, a fixed answer) and `sleep` (`SleepEngine`).

Guarantees: the engine contract of `rollout_workers.engines` (n samples per prompt, one
call), with log-prob 0 for every token and no weights (any blob is accepted and ignored).
"""

from __future__ import annotations

import numpy as np

from rollout_workers.engines.sample import Sample


class NullEngine:
    """No model: answers the text `answer` (default `"0"`) with log-prob 0 (for bus benchmarks, tests and
    the fault matrix's answer flood); its generated ids are always those of `"0"` and an end token.
    Its "tokenizer" maps each byte to its value (ids < 256)."""

    def __init__(self, answer: str = "0") -> None:
        self.answer = answer

    def load_weights(self, blob: bytes) -> None:
        """Accept any blob (nothing to load)."""

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode(errors="replace")

    def generate(
        self, prompts: list[str] | list[list[int]], n: int, max_new_tokens: int, temperature: float
    ) -> list[list[Sample]]:
        """n identical fixed samples per prompt."""
        # the ids stay the default answer's pair ("0", end) whatever the text: any model's vocabulary has
        # them, and the learner trains on ids (the text is what the verifier scores)
        ids = np.array([ord("0"), 1], dtype=np.int32)
        lp = np.zeros(2, dtype=np.float32)
        return [
            [
                Sample(
                    self.encode(p) if isinstance(p, str) else np.asarray(p, dtype=np.int32),
                    ids,
                    lp,
                    self.answer,
                    "stop",
                )
                for _ in range(n)
            ]
            for p in prompts
        ]


class SleepEngine(NullEngine):
    """No model: a batch takes as long as its slowest `sleep:<seconds>` prompt (benchmarks of
    scheduling: episodes of known, very different durations; see the `sleep` domain)."""

    def generate(self, prompts, n: int, max_new_tokens: int, temperature: float) -> list[list[Sample]]:
        import time

        seconds = [float(p.split("sleep:", 1)[1].split()[0]) for p in prompts if isinstance(p, str) and "sleep:" in p]
        time.sleep(max(seconds, default=0.0))
        return super().generate(prompts, n, max_new_tokens, temperature)
