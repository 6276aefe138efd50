"""What both sides of `bench/e2e_vs_trl.py` share: the settings, the SFT start, the held-out
evaluation and the reward (also used by `bench/async_vs_trl.py` and `bench/vllm_tiers.py`).

Guarantees:
- `heldout(n)` is the scheduler's fixed held-out set (`producers.domains.arith.heldout_set`
  at `EVAL_SEED`, difficulty `DIFFICULTY`); `prepare_start` never trains on it, and the
  TRL side's prompts exclude it too (`bench.e2e_runs.trl_dataset`).
- `accuracy` scores every model (the start, each side's final policy, each curve point) the
  same way: greedy decoding (`scheduler.evaluation.greedy_accuracy`, HFEngine on CPU) on
  that set, with `max_tokens` new tokens.
- `arith_reward` is an exact integer match, the same as the `arith` verifier.
- Importing this module imports nothing heavy (torch, transformers, trl load inside the calls).
"""

from __future__ import annotations

import os
from pathlib import Path

EVAL_SEED, DIFFICULTY, MAX_TOKENS = 1234, 3, 6  # MAX_TOKENS: the default of --max-tokens
GROUP, PROMPTS_PER_STEP, TEMPERATURE = 8, 16, 1.0
EVAL_N, LR = (
    1000,
    3e-5,
)  # defaults of --eval-n and --lr (3e-4 degraded both sides in scouting; 1e-4 gains about the same)


def heldout(n: int | None = None) -> list:
    """The held-out problems (`producers.domains.arith.heldout_set`); both sides never train on them."""
    from producers.domains import arith

    return arith.heldout_set(EVAL_SEED, n or EVAL_N, DIFFICULTY)


def prepare_start(
    tmp: Path, sft_seconds: float, sft_steps: int, eval_n: int, seed: int = 0, hidden: int = 128, layers: int = 4
) -> tuple[Path, dict]:
    """Tiny model + SFT warm start (held-out problems excluded); returns (dir, sft summary)."""
    from learner.sft import run_sft
    from producers.demos import batches_of
    from producers.domains import arith
    from rlbus.model.tiny_model import build_tiny_model

    base = build_tiny_model(tmp / "base", arch="qwen2", hidden_size=hidden, num_layers=layers, num_heads=4, seed=seed)
    held = {p.expression for p in heldout(eval_n)}

    def demo(rng):
        while True:
            p = arith.generate(rng, DIFFICULTY)
            if p.expression not in held:
                return p.prompt, p.completion

    stats = run_sft(
        base,
        tmp / "start",
        batches_of(demo, seed, 64),
        seconds=sft_seconds,
        max_steps=sft_steps,
        lr=3e-3,
        seed=seed,
        threads=os.cpu_count() or 2,
        progress=False,
    )
    return tmp / "start", stats


def accuracy(
    model_dir: Path,
    eval_n: int,
    state_dict=None,
    threads: int = 2,
    blob: bytes | None = None,
    max_tokens: int = MAX_TOKENS,
) -> float:
    """Greedy held-out accuracy of a model dir (optionally with another state dict, or a
    published weight blob, loaded)."""
    from bus.weight_blobs import load_state_bytes
    from producers.domains import arith
    from rollout_workers.engines.hf_engine import HFEngine
    from scheduler.evaluation import greedy_accuracy

    engine = HFEngine(str(model_dir), "cpu", threads)
    if state_dict is not None:
        engine.model.load_state_dict(state_dict)
    if blob is not None:
        load_state_bytes(engine.model, blob)
    if state_dict is not None or blob is not None:
        engine.model.eval()
    return greedy_accuracy(engine, arith.fixed_eval_set(EVAL_SEED, eval_n or EVAL_N, DIFFICULTY, max_tokens=max_tokens))


def arith_reward(completions, answer, **_) -> list[float]:
    """TRL reward function: 1.0 when the completion is exactly the integer answer."""
    from schemas.answers import arith_answer

    return [float(arith_answer(c) == int(a)) for c, a in zip(completions, answer)]
