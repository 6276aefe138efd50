"""Run configuration: one pydantic model per role, loaded from TOML, overridable.

Guarantees:
- Every model rejects unknown keys (a typo is an error that names the key) and every
  field has a docstring.
- A renamed key (each section's `RENAMED` table) is an error that names its new key,
  e.g. "learner.lora_rank was renamed: use learner.lora.rank", in a file and in `--set`.
- `load_config(path, overrides)` reads TOML (or the JSON the launcher writes), applies
  `--set a.b=c` overrides (values parsed as TOML literals, else taken as strings) and
  validates the result.
- Values several roles share are derived once, when the config is resolved
  (`RunConfig`'s validators): `sampler.inflight_caps`.

One module per role: `run` (run, model, sft), `sampler`, `rollout`, `workers` (sandbox,
verifier), `learner`, `scheduler`, `tracking`.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from schemas.config.agent import AgentSection
from schemas.config.base import Section
from schemas.config.deploy import DeploySection
from schemas.config.harbor import HarborSection
from schemas.config.learner import LearnerSection, LoraSection, OffPolicySection, ReplaySection
from schemas.config.rollout import HFEngineSection, PoolConfig, RolloutSection, VLLMEngineSection, default_pools
from schemas.config.run import ModelSection, RunSection, SFTSection
from schemas.config.sampler import DomainConfig, SamplerSection, default_domains
from schemas.config.scheduler import CurriculumSection, EvalSection, ForgettingSection, PlateauSection, SchedulerSection
from schemas.config.tracking import TrackingSection
from schemas.config.workers import SandboxSection, VerifierSection

__all__ = [
    "AgentSection",
    "ConfigError",
    "CurriculumSection",
    "DeploySection",
    "DomainConfig",
    "EvalSection",
    "ForgettingSection",
    "HFEngineSection",
    "LearnerSection",
    "LoraSection",
    "ModelSection",
    "OffPolicySection",
    "PlateauSection",
    "PoolConfig",
    "ReplaySection",
    "RolloutSection",
    "RunConfig",
    "RunSection",
    "SFTSection",
    "SamplerSection",
    "SandboxSection",
    "SchedulerSection",
    "Section",
    "TrackingSection",
    "VLLMEngineSection",
    "VerifierSection",
    "apply_overrides",
    "default_domains",
    "default_pools",
    "dump_config",
    "inflight_caps",
    "load_config",
    "parse_override",
]

DERIVED = {
    ("sampler", "inflight_caps"): "sampler.max_inflight_tasks, rollout.pools.<pool>.max_inflight and "
    "learner.groups_per_step / publish_every / max_staleness"
}
"""Fields `RunConfig` derives -> what they come from; a config that sets one is refused."""


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
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    """Experiment tracking (TensorBoard, wandb) by the `tracker` role."""
    harbor: HarborSection = Field(default_factory=HarborSection)
    """Harbor task directories (`kind = "harbor"` domains): image map, network, verification."""
    agent: AgentSection = Field(default_factory=AgentSection)
    """Harness-owned episodes (`kind = "agent"` domains): where harnesses may run, their limits."""
    deploy: DeploySection = Field(default_factory=DeploySection)
    """Deployment past one machine (`rlbus k8s render`, `rlbus slurm render`); no role reads it at run time."""

    @model_validator(mode="before")
    @classmethod
    def _derived_not_set(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for (section, name), source in DERIVED.items():
                if isinstance(data.get(section), dict) and name in data[section]:
                    raise ValueError(
                        f"{section}.{name} is derived when the config is resolved, never set: set {source} instead"
                    )
        return data

    @model_validator(mode="after")
    def _resolve(self):
        _check_pools(self)
        caps = inflight_caps(self)
        if self.sampler.inflight_caps != caps:
            self.sampler.inflight_caps = caps
        return self


def _check_pools(cfg: RunConfig) -> RunConfig:
    unknown = {d: dc.pool for d, dc in cfg.sampler.domains.items() if dc.pool not in cfg.rollout.pools}
    if unknown:
        raise ValueError(f"sampler.domains pools {unknown} are not rollout.pools {sorted(cfg.rollout.pools)}")
    return cfg


def inflight_caps(cfg: RunConfig) -> dict[str, int]:
    """The in-flight task bound per pool (see `SamplerSection.inflight_caps`)."""
    lc = cfg.learner
    staleness_cap = lc.groups_per_step * lc.publish_every * max(1, lc.max_staleness)
    caps = {p: pc.max_inflight for p, pc in cfg.rollout.pools.items()}
    caps["short"] = min(cfg.sampler.max_inflight_tasks, staleness_cap)
    return caps


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


def _message(err: ErrorDetails) -> str:
    where = ".".join(map(str, err["loc"]))
    msg = err["msg"].removeprefix("Value error, ")
    return f"  {msg}" if not where or msg.startswith(f"{where}.") else f"  {where}: {msg}"


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
        raise ConfigError(
            f"invalid config {path or '(defaults)'}:\n" + "\n".join(map(_message, exc.errors()))
        ) from None


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config as JSON (what the launcher hands to each worker; derived
    fields are left out and derived again when a worker loads it)."""
    path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
