"""Config sections of the task sampler and its domains."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from schemas.config.base import Section

FIELD_TARGETS = ("id", "prompt", "gold", "hidden", "params", "level")
"""Task fields a `DomainConfig.field_map` may name (besides `hidden.<key>` / `params.<key>`)."""


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
    """Data of a file-backed domain (`math`, `extract`, `jsonl`, `judge`): a `.jsonl` file, a
    `.parquet` file, or a directory (an HF `datasets.save_to_disk` dir, or split-named files
    such as `train.jsonl`, `test-00000-of-00001.parquet`, `data/train-*.parquet`). Local
    only, never a hub name. Empty: the kind's example file (`math`: examples/data/math.jsonl)."""
    split: str = "train"
    """Split of `data` to train on (a single file is split `train`)."""
    field_map: dict[str, str] = Field(default_factory=dict)
    """Task field -> column of `data`, over the kind's default format (`math`: id, problem,
    answer, level; the JSONL kinds: id, prompt, hidden, params, level). Fields: `id`
    (default: a hash of the row when the data has no `id` column), `prompt` (text or chat
    messages), `gold` (the answer, verifier-only), `hidden` / `params` (object columns,
    verifier-only / public), `hidden.<key>` / `params.<key>` (one column into that
    object), `level`. Example: `{ prompt = "question", gold = "answer", level = "difficulty" }`."""
    heldout_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of the split's rows held out of training, chosen by a hash of each row's
    prompt (the same rows every run; identical prompts fall on the same side)."""
    heldout_split: str = ""
    """A split of `data` held out as a whole (e.g. `test`); training rows whose prompt it
    also holds are dropped. Empty: none."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Generated-token budget of this domain's tasks (default: sampler.max_tokens)."""
    kind: str = ""
    """Registered domain that makes the tasks (default: the domain's own name; `math` for
    unregistered names with a `data` file). Lets two config entries share one kind."""
    verifier: str = ""
    """Verifier override (e.g. `jsonl` tasks paired with any registered verifier)."""
    reward_weights: dict[str, Annotated[float, Field(strict=True, allow_inf_nan=False)]] = Field(default_factory=dict)
    """Weights of the verifier's named components in the scalar reward (empty: the verifier's
    default); they travel as `Task.reward_weights`."""
    max_turns: int = Field(default=1, ge=1)
    """Model turns per episode (more than 1 for tool-using domains)."""
    tool_format: Literal["tags", "json"] = "tags"
    """How the policy calls tools (`schemas.tool_protocol`): `tags`, the compact `<py>...</py>`
    for tiny models; `json`, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` with the
    tools declared in the system turn by the chat template, results as tool messages.
    Travels as `Task.tool_format`."""
    pool: str = "short"
    """Expected-duration class of the domain's tasks (a `rollout.pools` name)."""
    long_after_s: float = Field(default=30.0, gt=0)
    """Measured mean episode seconds (per level, KV `durations`) above which tasks go to the `long` pool."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Domain-specific options (see the domain's docstring)."""
    heldout: bool = False
    """Zero-shot domain: never sampled for training; the scheduler evaluates it every
    `scheduler.eval.every_versions` with the same pipeline (`eval.<domain>`, purpose `heldout`)."""

    @model_validator(mode="after")
    def _levels_ordered(self):
        if self.min_level > self.max_level:
            raise ValueError(f"min_level {self.min_level} > max_level {self.max_level}")
        if self.start_level is not None and not self.min_level <= self.start_level <= self.max_level:
            raise ValueError(f"start_level {self.start_level} outside [{self.min_level}, {self.max_level}]")
        return self

    @model_validator(mode="after")
    def _field_map_targets(self):
        bad = [k for k, v in self.field_map.items() if not (v and (k in FIELD_TARGETS or (
            k.partition(".")[0] in ("hidden", "params") and k.partition(".")[2])))]
        if bad:
            raise ValueError(f"field_map keys {bad} unknown (or mapped to an empty column); use "
                             f"{list(FIELD_TARGETS)} or hidden.<key> / params.<key>")
        if "gold" in self.field_map and "hidden.gold" in self.field_map:
            raise ValueError("field_map maps both gold and hidden.gold (the same field); keep one")
        if self.heldout_split and self.heldout_split == self.split:
            raise ValueError(f"heldout_split {self.heldout_split!r} is the training split; name another split")
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
    inflight_caps: dict[str, int] = Field(default_factory=dict, exclude=True)
    """Derived when the run config is resolved (never set it): the in-flight task bound per
    duration pool. `short`: `max_inflight_tasks`, and never more than the learner consumes
    within `learner.max_staleness` versions (`groups_per_step` x `publish_every` x
    max(1, `max_staleness`) tasks), so nothing waits long enough to go stale; every other
    pool: its own `rollout.pools.<name>.max_inflight`, so long episodes never fill the
    short pool's room."""

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
