"""Run configuration: one pydantic model per role, loaded from TOML, overridable.

Guarantees:
- Every model rejects unknown keys (a typo is an error that names the key) and every
  field has a docstring (shown by `rlbus config-help`).
- `load_config(path, overrides)` reads TOML (or the JSON the launcher writes), applies
  `--set a.b=c` overrides (values parsed as TOML literals, else taken as strings) and
  validates the result.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys rejected, field docstrings kept."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class RunSection(Section):
    """Identity and limits of a run."""

    run_id: str = ""
    """Run id ([A-Za-z0-9_-]); empty = generated from the config name and time."""
    run_dir: str = "runs"
    """Parent folder; each run writes only under <run_dir>/<run_id>/."""
    max_steps: int = Field(default=0, ge=0)
    """Stop after this many learner steps (0 = no step limit)."""
    max_minutes: float = Field(default=0.0, ge=0.0)
    """Stop after this much wall time, set-up included (0 = no time limit)."""
    seed: int = 0
    """Seed for task generation, model init and sampling."""
    nats_url: str = ""
    """Connect to this NATS server; empty = start an embedded one."""
    drain_seconds: float = Field(default=20.0, ge=0.0)
    """At stop, how long the pipeline may drain after the sampler stops."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Prometheus /metrics port of each worker (0 = off). Several workers on one host take
    the first free port from here upward; env RLBUS_METRICS_PORT sets one process's port."""
    nats_tls_ca: str = ""
    """CA file that verifies the NATS server's certificate (empty = plain TCP unless env RLBUS_NATS_TLS_CA)."""
    nats_tls_cert: str = ""
    """Client certificate for mutual TLS (with nats_tls_key; empty = none). Paths, never the secrets themselves."""
    nats_tls_key: str = ""
    """Private key of nats_tls_cert (mount it from a secret; never bake it into an image)."""


class ModelSection(Section):
    """The policy model: an existing HF checkpoint or a tiny one built locally."""

    path: str = ""
    """Local HF model dir to start from; empty = build a tiny model in the run dir."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the tiny model when building one."""
    hidden_size: int = 128
    """Tiny model width."""
    num_layers: int = 4
    """Tiny model depth."""
    num_heads: int = 4
    """Tiny model attention heads."""


class SFTSection(Section):
    """Supervised warm start before RL."""

    enabled: bool = True
    """Run SFT on the domain's demonstrations before RL."""
    seconds: float = 75.0
    """Wall-time budget of SFT."""
    max_steps: int = 100_000
    """Step cap of SFT."""
    batch_size: int = 64
    """Demonstrations per SFT step."""
    lr: float = 3e-3
    """SFT learning rate."""
    difficulty: int = 3
    """Difficulty of the demonstrations."""
    threads: int = 2
    """torch threads for SFT (nothing else runs then)."""


class DomainConfig(Section):
    """One sampled domain: curriculum settings and, for file-backed domains, its data."""

    target_reward: float = 0.8
    """Reward the domain should reach; the gap to it drives its sampling share."""
    floor_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Minimum sampling share, so the domain never starves."""
    min_level: int = 1
    """Lowest difficulty level."""
    max_level: int = 1
    """Highest difficulty level."""
    start_level: int | None = None
    """Level before any curriculum update (default: min_level)."""
    weight: float = Field(default=1.0, ge=0.0)
    """Static sampling weight, used until the scheduler publishes the first curriculum update."""
    sft_weight: float | None = Field(default=None, ge=0.0)
    """Share of SFT warm-start batches from this domain (default: `weight`; 0: no demonstrations)."""
    data: str = ""
    """JSONL file of problems for file-backed domains (`math`; empty = examples/data/math.jsonl)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Generated-token budget of this domain's tasks (default: sampler.max_tokens)."""
    kind: str = ""
    """Registered domain that makes the tasks (default: the domain's own name; `math` for
    unregistered names with a `data` file). Lets two config entries share one kind."""
    verifier: str = ""
    """Verifier override (e.g. `jsonl` tasks paired with any registered verifier)."""
    reward_weights: dict[str, float] = Field(default_factory=dict)
    """Weights of the verifier's named components in the scalar reward (empty: the verifier's default)."""
    max_turns: int = Field(default=1, ge=1)
    """Model turns per episode (more than 1 for tool-using domains)."""
    pool: str = "short"
    """Expected-duration class of the domain's tasks (a `rollout.pools` name)."""
    long_after_s: float = Field(default=30.0, gt=0)
    """Measured mean episode seconds (per level, KV `durations`) above which tasks go to the `long` pool."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Domain-specific options (see the domain's docstring)."""

    @model_validator(mode="after")
    def _levels_ordered(self):
        if self.min_level > self.max_level:
            raise ValueError(f"min_level {self.min_level} > max_level {self.max_level}")
        if self.start_level is not None and not self.min_level <= self.start_level <= self.max_level:
            raise ValueError(f"start_level {self.start_level} outside [{self.min_level}, {self.max_level}]")
        return self

    @property
    def initial_level(self) -> int:
        """start_level, else min_level."""
        return self.min_level if self.start_level is None else self.start_level


def default_domains(domain: str = "arith", difficulty: int = 3) -> dict[str, DomainConfig]:
    """The single domain the legacy `sampler.domain`/`sampler.difficulty` fields describe."""
    return {domain: DomainConfig(min_level=1, max_level=max(6, difficulty), start_level=difficulty)}


class SamplerSection(Section):
    """The task sampler."""

    domain: str = "arith"
    """Domain to sample when `domains` is not given (legacy single-domain setting)."""
    difficulty: int = 3
    """Starting difficulty when `domains` is not given (legacy single-domain setting)."""
    domains: dict[str, DomainConfig] = Field(default_factory=default_domains)
    """Domains to sample, by name (`arith`, `math`); default: `domain` at levels 1..6 starting at `difficulty`."""
    group_size: int = Field(default=8, ge=1)
    """Samples per task (G)."""
    max_tokens: int = Field(default=8, ge=1)
    """Generated-token budget per sample."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature of training tasks."""
    max_inflight_tasks: int = Field(default=64, ge=1)
    """Bound on tasks published but not yet consumed by the learner (backpressure)."""
    publish_batch: int = Field(default=16, ge=1)
    """Tasks published per round."""
    poll_seconds: float = 0.1
    """How often the gate re-reads the learner's progress when full."""

    @model_validator(mode="before")
    @classmethod
    def _derive_domains(cls, data: Any) -> Any:
        if isinstance(data, dict) and "domains" not in data:
            domain, difficulty = data.get("domain", "arith"), data.get("difficulty", 3)
            if isinstance(domain, str) and isinstance(difficulty, int):
                data = {**data, "domains": {domain: {"min_level": 1, "max_level": max(6, difficulty),
                                                     "start_level": difficulty}}}
        return data

    @model_validator(mode="after")
    def _some_domain(self):
        if not self.domains:
            raise ValueError("sampler.domains must name at least one domain")
        return self


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


class RolloutSection(Section):
    """Rollout workers."""

    engine: Literal["hf", "null", "sleep", "vllm"] = "hf"
    """`hf`: transformers/torch; `null`: fixed output without a model (benchmarks); `sleep`: like null, but
    each batch takes its `sleep` tasks' seconds (scheduling benchmarks); `vllm`: GPU (the gpu extra)."""
    device: str = "cpu"
    """torch device of the hf engine."""
    vllm_tier: Literal["standard", "fast", "fast_fp8", "fast_spec"] = "standard"
    """vLLM speed tier from the same weights: `fast` adds fp8 quantization and ngram speculative decoding."""
    threads: int = 1
    """torch threads of this process."""
    batch_tasks: int = Field(default=8, ge=1)
    """Tasks fetched and generated in one batch."""
    ack_wait_s: float = 60.0
    """Consumer ack_wait; in_progress is sent at a third of it."""
    sandbox_slots: int = Field(default=8, ge=1)
    """Tool calls run at once by one rollout worker (each in its episode's own sandbox)."""
    pools: dict[str, PoolConfig] = Field(default_factory=default_pools)
    """Duration pools this worker serves, each pulled by its own loop and consumer (`short`
    is always served: a config naming only other pools gets the default `short` too)."""

    @model_validator(mode="after")
    def _short_pool_always(self):
        if "short" not in self.pools:
            self.pools = {"short": default_pools()["short"], **self.pools}
        return self


class SandboxSection(Section):
    """Sandboxes for tool calls (rollout) and tests (verifiers), and the sandbox service."""

    backend: Literal["process", "docker", "auto"] = "process"
    """`process`: bubblewrap + rlimits; `docker`: containers from `image`; `auto`: docker when an engine answers."""
    image: str = "rlbus-sandbox:latest"
    """Docker image (build it with `rlbus sandbox build-image`)."""
    remote: bool = False
    """Rollout workers use the sandbox service over NATS (`rlbus worker sandbox`) instead of a local backend."""
    pool: str = "default"
    """Sandbox service pool name (subjects `sandbox.<pool>.*`)."""
    memory_mb: int = Field(default=256, ge=16)
    """Memory limit per sandbox."""
    pids: int = Field(default=64, ge=4)
    """Process limit per sandbox."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Default wall-clock limit per command."""
    warm_pool: int = Field(default=2, ge=0)
    """Docker: containers kept started and clean, ready to hand out."""
    session_ttl_s: float = Field(default=120.0, gt=0)
    """Service: a session idle this long (its client died) is closed and reaped."""
    max_sessions: int = Field(default=16, ge=1)
    """Service: most sessions one sandbox worker holds at once."""


class VerifierSection(Section):
    """Verifier workers."""

    batch: int = Field(default=128, ge=1)
    """Trajectories fetched per round."""
    ack_wait_s: float = 30.0
    """Consumer ack_wait."""
    concurrency: int = Field(default=4, ge=0)
    """Verifications run at once per worker (threads; sandboxed verifiers are I/O bound); 0 runs them inline."""
    retry_base_s: float = Field(default=1.0, gt=0)
    """First retry delay of an infrastructure failure (doubles per delivery)."""
    retry_max_s: float = Field(default=60.0, gt=0)
    """Longest retry delay of an infrastructure failure."""


class LearnerSection(Section):
    """The learner (GRPO-style step)."""

    policy: Literal["hf", "null"] = "hf"
    """`hf`: train the model; `null`: consume and account without a model (bus benchmarks)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    beta: float = 0.0
    """k3 KL coefficient to the frozen reference; 0 skips the reference model."""
    clip_low: float = 0.2
    """Lower PPO clip (ratio >= 1 - clip_low)."""
    clip_high: float = 0.28
    """Upper PPO clip (ratio <= 1 + clip_high)."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group std (GRPO)."""
    objective: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "grpo"
    """GRPO-family objective (learner/objectives.py): aggregation, advantages, ratio level."""
    kl_estimator: Literal["k3", "k1"] = "k3"
    """KL estimator to the reference when beta > 0."""
    groups_per_step: int = Field(default=8, ge=1)
    """Complete groups that make a step."""
    group_deadline_s: float = 30.0
    """A group incomplete after this long is trained if it has >= 2 samples, else filtered."""
    min_groups_per_step: int = Field(default=1, ge=1)
    """Fewest ready groups a closed time window may step on; below it the window is logged
    with its reason (how many ready, pending, expired) and extended."""
    step_window_s: float = 5.0
    """A step starts once this long has passed with at least one ready group."""
    max_staleness: int = Field(default=4, ge=0)
    """Samples older than this many versions are filtered with a reason."""
    publish_every: int = Field(default=1, ge=1)
    """Publish a WeightVersion every K steps."""
    checkpoint_every: int = Field(default=20, ge=1)
    """Checkpoint every C steps (and at stop)."""
    threads: int = 1
    """torch threads of this process."""
    skip_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no signal)."""
    refill_skipped: bool = False
    """With skip_zero_variance: only groups whose rewards differ count towards
    groups_per_step, so a step waits for that many (DAPO's dynamic sampling fills the
    batch); off: a step pops groups_per_step groups and trains the ones that differ.
    A step then consumes groups_per_step / (share of groups that differ) tasks, and the
    sampler bounds tasks in flight by groups_per_step x publish_every x max_staleness:
    raise sampler.max_inflight_tasks and max_staleness with it (the e2e bench ran it with
    112 and 7 for 16 groups a step, where about 38 % of groups differ)."""
    skipped_keep_scale: bool = False
    """With skip_zero_variance: normalise each step's loss over every sample of the groups it
    popped, the skipped all-equal ones included, as if they had been trained (their
    advantages are 0, so they add only to the normaliser). Skipping is then a pure
    speed-up: with beta = 0 the step's gradient equals the full-batch GRPO/DAPO gradient,
    which is what TRL computes by training them (with beta > 0 the skipped samples' KL
    terms are missing either way). Off: normalised over the trained samples only (DAPO)."""
    off_policy: Literal["none", "tis", "decoupled"] = "none"
    """Correction for stale samples (learner/offpolicy.py): `none` clips the ratio against the behaviour
    log-probs; `tis` truncated importance sampling; `decoupled` PPO with a proximal policy (AReaL)."""
    tis_cap: float = Field(default=2.0, gt=0.0)
    """Truncation cap C of the behaviour->proximal importance weight (tis and decoupled)."""
    replay_share: float = Field(default=0.0, ge=0.0)
    """Coefficient of the NLL loss on a replay batch added to each step (0 = off; learner/replay.py)."""
    replay_data: str = ""
    """JSONL of general text/demonstrations for replay ({"prompt","completion"} or {"text"})."""
    replay_batch_size: int = Field(default=8, ge=1)
    """Replay examples per step."""
    pcgrad: bool = False
    """Project conflicting per-domain gradients (PCGrad) before the optimizer step."""
    micro_batch_tokens: int = Field(default=0, ge=0)
    """Max padded tokens (rows x width) per micro-batch, gradients accumulated; 0 = no token cap."""
    micro_batch_size: int = Field(default=0, ge=0)
    """Max sequences per micro-batch; 0 = no cap (with micro_batch_tokens 0 too: one batch)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward (model.gradient_checkpointing_enable)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype: bf16 runs forward passes under torch.autocast (fp32 master weights)."""
    lora_rank: int = Field(default=0, ge=0)
    """LoRA rank (peft); 0 = full fine-tuning. With LoRA only adapter weights are published."""
    lora_alpha: float = Field(default=16.0, gt=0.0)
    """LoRA alpha (scaling alpha / rank)."""
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """LoRA dropout."""
    lora_target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters."""
    weight_store: str = "nats"
    """Where weight blobs go: `nats` (run object store), `file:///dir`, or `s3://bucket/prefix` (boto3)."""
    keep_versions: int = Field(default=16, ge=0)
    """Weight versions kept in the store: after each publish, versions older than the newest
    `keep_versions` are deleted, except version 0 and the released one (learner/retention.py);
    0 keeps every version. Readers load only the newest, so a small number is safe."""


class SchedulerSection(Section):
    """The scheduler (regression evaluation for now)."""

    eval_n: int = Field(default=200, ge=1)
    """Problems in the fixed held-out eval set."""
    eval_seed: int = 1234
    """Seed of the eval set (fixed across runs)."""
    eval_difficulty: int = 3
    """Difficulty of the eval set."""
    eval_every_versions: int = Field(default=5, ge=1)
    """Evaluate every N-th version (the first and the last always)."""
    eval_mode: Literal["local", "pipeline"] = "local"
    """`pipeline`: publish `purpose=eval` tasks through rollout and verifier workers and score
    their rewards; `local`: the scheduler generates with its own engine. The version-0
    baseline is always local (it must be exactly the start weights)."""
    eval_timeout_s: float = Field(default=600.0, gt=0)
    """Pipeline mode: how long a round waits for its rewards (missing ones count as wrong)."""
    threads: int = 1
    """torch threads of this process."""
    db_url: str = ""
    """Run store URL (SQLAlchemy, e.g. postgresql://user@host/db); empty = $RLBUS_DB_URL, else SQLite <run>/run.db."""
    curriculum: bool = True
    """Run the curriculum (domain weights and difficulty levels from the rewards)."""
    curriculum_temperature: float = Field(default=0.1, gt=0.0)
    """Softmax temperature over the domains' reward gaps."""
    curriculum_every_s: float = Field(default=5.0, gt=0.0)
    """How often a changed curriculum is published to KV `curriculum` and recorded."""
    curriculum_ema_alpha: float = Field(default=0.1, gt=0.0, le=1.0)
    """EMA factor of each domain's reward (per sample)."""
    curriculum_promote_at: float = 0.8
    """Promote a domain's level when its recent success rate is at least this."""
    curriculum_demote_at: float = 0.2
    """Demote a domain's level when its recent success rate is at most this."""
    curriculum_window: int = Field(default=64, ge=1)
    """Samples per level behind the success rate (also the minimum between level changes)."""
    eval_floors: dict[str, float] = Field(default_factory=dict)
    """Release gate: minimum eval score per eval domain, e.g. {arith = 0.5}; a domain without one must not fall below its baseline minus `release_margin`."""
    release_margin: float = Field(default=0.02, ge=0.0)
    """Release gate: how far below its version-0 baseline an eval domain may fall (when it has no `eval_floors` entry)."""
    general_eval: str = ""
    """Forgetting guard: kind of the general regression set evaluated with every version (`arith` or `tool_calc`; empty = off). Published as eval domain `general_<kind>`."""
    general_eval_level: int = Field(default=1, ge=1)
    """Forgetting guard: fixed difficulty level of the general set."""
    general_eval_n: int = Field(default=100, ge=1)
    """Forgetting guard: problems in the general set."""
    forgetting_margin: float = Field(default=0.05, ge=0.0)
    """Forgetting guard: trips when the general score is more than this below its baseline."""
    forgetting_replay_step: float = Field(default=0.1, ge=0.0)
    """Forgetting guard: added to the learner's replay share each time it trips (KV `learner.overrides`)."""
    forgetting_replay_max: float = Field(default=1.0, ge=0.0)
    """Forgetting guard: the replay share it never raises above."""
    forgetting_beta_step: float = Field(default=0.01, ge=0.0)
    """Forgetting guard: added to the learner's KL beta each time it trips (KV `learner.overrides`)."""
    forgetting_beta_max: float = Field(default=0.2, ge=0.0)
    """Forgetting guard: the KL beta it never raises above."""
    plateau_threshold: float = Field(default=0.01, ge=0.0)
    """Plateau: eval-score gain per 1000 trained samples (least-squares slope over the window) below which the run has plateaued."""
    plateau_window: int = Field(default=4, ge=2)
    """Plateau: number of most recent evaluations the slope is fitted over."""
    stop_on_plateau: bool = False
    """Plateau: ask the launcher to stop the run (KV `status` = "stop-requested") once a plateau is detected."""


class RunConfig(Section):
    """A whole run: one section per role plus the run's identity."""

    run: RunSection = Field(default_factory=RunSection)
    """Identity and limits."""
    model: ModelSection = Field(default_factory=ModelSection)
    """The policy model."""
    sft: SFTSection = Field(default_factory=SFTSection)
    """Warm start."""
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    """Task sampler."""
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    """Rollout workers."""
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    """Sandboxes and the sandbox service."""
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    """Verifier workers."""
    learner: LearnerSection = Field(default_factory=LearnerSection)
    """Learner."""
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    """Scheduler."""

    @model_validator(mode="after")
    def _pools_known(self):
        return _check_pools(self)


def _check_pools(cfg: "RunConfig") -> "RunConfig":
    unknown = {d: dc.pool for d, dc in cfg.sampler.domains.items() if dc.pool not in cfg.rollout.pools}
    if unknown:
        raise ValueError(f"sampler.domains pools {unknown} are not rollout.pools {sorted(cfg.rollout.pools)}")
    return cfg


class ConfigError(ValueError):
    """A config file or override that does not validate; the message says what to fix."""


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=c` -> (["a", "b"], parsed c). Values are TOML literals when they parse, else strings."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set learner.lr=1e-4")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--set` overrides to a raw config dict (in place) and return it."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML (or JSON) run config, apply overrides, validate."""
    data: dict = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} not found (examples live in examples/*.toml)")
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    apply_overrides(data, overrides or [])
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"invalid config {path or '(defaults)'}:\n" + "\n".join(lines)) from None


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config as JSON (what the launcher hands to each worker)."""
    path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
