"""vLLM rollout engine (GPU): the HFEngine interface on top of `vllm.LLM`.

Guarantees (same contract as `rollout_workers.engines.HFEngine`):
- `generate(prompts, n, max_new_tokens, temperature)` returns, per prompt, `n` samples,
  each with its generated token ids (end-of-sequence included when it stopped there),
  the behaviour log-prob of every generated token under the sampling distribution
  (softmax(logits / temperature), i.e. vLLM's `processed_logprobs`; plain softmax for
  greedy), the decoded text, and `stop`/`length`.
- All prompts and all `n` samples of a call go to vLLM in ONE `LLM.generate` call; the
  `n` samples of a prompt share its KV prefix (`SamplingParams(n=...)`, and prefix
  caching is on across calls).
- Prompts are tokenized here with the model's HF tokenizer and no special tokens, and
  passed as token ids, exactly as HFEngine sees them.
- `load_weights(blob)` swaps the weights in place (no restart, no re-read of the model
  directory): the safetensors blob (HF parameter names, as `bus.weight_blobs` writes it)
  goes to every vLLM worker through `LLM.collective_rpc` into a worker extension that
  calls the model runner's `reload_weights(weights_iterator=...)` when the installed
  vLLM has it (it re-quantizes online-quantized, e.g. fp8, layers) and plain
  `model.load_weights(...)` otherwise; the prefix cache is reset afterwards so no stale
  KV from the old weights is ever reused.
- Speed tiers from the same weights (`TIERS`): `standard` (the checkpoint's dtype, no
  speculation) and `fast` (online fp8 weight quantization and n-gram speculative
  decoding). Speculative decoding leaves the sampled distribution unchanged (rejection
  sampling); fp8 changes the numerics slightly, which `bench/vllm_tiers.py` measures.

Version assumptions: vLLM >= 0.10.2 with the V1 engine (`logprobs_mode`,
`worker_extension_cls`, `LLM.collective_rpc`, the dict form of `speculative_config`).
The V0 path `llm.llm_engine.model_executor.driver_worker.model_runner.model` is not
used: in V1 the model lives in an engine-core process by default. vLLM is imported
lazily, so this module imports on machines without it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

from rollout_workers.engines import Sample

TIERS: dict[str, dict[str, Any]] = {
    "standard": {},
    "fast": {
        "quantization": "fp8",
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    },
    "fast_fp8": {"quantization": "fp8"},
    "fast_spec": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
}
"""LLM(...) keyword arguments per speed tier (on top of the common ones)."""

EXTENSION = "rollout_workers.vllm_engine.WeightLoaderExtension"


class WeightLoaderExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`): loads a weight file in place.

    Runs inside the worker process, where `self.model_runner` is the GPU model runner.
    The blob travels as a file path (shared memory when available) rather than as a
    large RPC argument.
    """

    def rlbus_load_weights(self, path: str) -> int:
        """Load the safetensors file at `path` into the running model; returns tensors loaded."""
        import inspect

        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        runner = self.model_runner
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=iter(tensors.items()))
        else:
            runner.model.load_weights(weights=iter(tensors.items()))
        return len(tensors)


class VLLMEngine:
    """A causal LM from a local HF directory, served by vLLM on a GPU."""

    def __init__(self, model_path: str, tier: str = "standard", *, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 dtype: str = "auto", enforce_eager: bool = False, **llm_kwargs):
        if tier not in TIERS:
            raise ValueError(f"unknown vLLM tier {tier!r} (known: {', '.join(TIERS)})")
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tier = tier
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_id = self.tokenizer.eos_token_id
        kwargs = dict(model=str(model_path), tokenizer=str(model_path), seed=seed, dtype=dtype,
                      enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                      logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
                      enforce_eager=enforce_eager, skip_tokenizer_init=False)
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(TIERS[tier])
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self._shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def load_weights(self, blob: bytes) -> None:
        """Hot-load a safetensors blob into every vLLM worker, then drop cached prefixes."""
        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=self._shm, delete=False) as f:
            f.write(blob)
            path = f.name
        try:
            self.llm.collective_rpc("rlbus_load_weights", args=(path,))
        finally:
            os.unlink(path)
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[str], n: int, max_new_tokens: int, temperature: float) -> list[list[Sample]]:
        """n samples per prompt, one batched vLLM call."""
        from vllm import SamplingParams

        greedy = temperature <= 0
        params = SamplingParams(n=n, temperature=0.0 if greedy else temperature, top_p=1.0,
                                max_tokens=max_new_tokens, logprobs=0, stop_token_ids=[self.eos_id],
                                skip_special_tokens=True)
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        outs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        result: list[list[Sample]] = []
        for prompt_ids, out in zip(ids, outs):
            p_ids = np.asarray(prompt_ids, dtype=np.int32)
            group = []
            for c in out.outputs:  # n CompletionOutputs
                toks = np.asarray(c.token_ids, dtype=np.int32)
                group.append(Sample(p_ids, toks, sampled_logprobs(c.logprobs, c.token_ids), c.text,
                                    "stop" if c.finish_reason == "stop" else "length"))
            result.append(group)
        return result


def sampled_logprobs(logprobs, token_ids) -> np.ndarray:
    """Log-prob of each sampled token from vLLM's per-position {token_id: Logprob} dicts.

    With `logprobs=0` each dict holds exactly the sampled token; newer vLLM may return a
    flat container, handled by indexing it the same way.
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (SamplingParams.logprobs must be set)")
    return np.asarray([pos[t].logprob for pos, t in zip(logprobs, token_ids)], dtype=np.float32)
