"""Config sections of the task sampler and its domains.

Guarantees:
- `sampler.domain_sets.reasoning_gym` (present, or `enabled`) expands, when the config
  is validated, into one `sampler.domains` entry `rg-<dataset>` (`schemas.rg_family.domain_name`)
  of `kind = "reasoning_gym"` per selected dataset, with `params = {dataset, range_mode,
  eval_n[, max_prompt_chars]}` plus the dataset's override, levels 1..(its valid curriculum levels)
  and the set's shared settings. A name that is no dataset (in `include`, `exclude`,
  `heldout` or `overrides`) is an error naming the closest known ones; an empty selection
  is an error. Expanding twice (a resolved config loaded again) is a no-op; an existing
  `sampler.domains` entry of the same name that differs is an error.
- With a domain set and neither `domains` nor the legacy `domain`/`difficulty` given, no
  default `arith` domain is added.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from schemas.config.base import Section

FIELD_TARGETS = ("id", "prompt", "gold", "hidden", "params", "level")
"""Task fields a `DomainConfig.field_map` may name (besides `hidden.<key>` / `params.<key>`)."""


class DomainConfig(Section):
    """One sampled domain: curriculum settings and, for file-backed domains, its data."""

    target_reward: float | None = None
    """Reward the domain should reach; the gap to it drives its sampling share. Unset: the
    gap to the domain's baseline, its mean training reward at version 0 (the first
    `scheduler.curriculum.window` rewards), so domains falling behind it get more share."""
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
    tasks: str = ""
    """`harbor` domains: a glob of Harbor task directories (e.g. `examples/harbor/*`), relative
    to the working directory."""
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
    wraps: str = ""
    """`kind = "agent"` domains: the kind whose tasks (and verifier) the harness works on
    (`repo`, `math`, `tool_calc`, ...); its own options are this domain's `params`."""
    command: list[str] = Field(default_factory=list)
    """`kind = "agent"` domains: the harness command run per episode in the episode's sandbox;
    `{task_file}` is replaced by the path of the public task JSON (also `RLBUS_TASK_FILE`),
    `{task}` by its instruction text (for harnesses taking the task as an argument, `mini -t`)."""
    heldout: bool = False
    """Zero-shot domain: never sampled for training; the scheduler evaluates it every
    `scheduler.eval.every_versions` with the same pipeline (`eval.<domain>`, purpose `heldout`)."""

    @model_validator(mode="after")
    def _agent_fields(self):
        if self.kind == "agent":
            if not self.wraps or self.wraps == "agent":
                raise ValueError(
                    'kind = "agent" needs wraps = "<kind>": the kind whose tasks the harness solves (repo, math, ...)'
                )
            if not self.command or not all(isinstance(a, str) and a for a in self.command):
                raise ValueError('kind = "agent" needs command = ["<harness>", ..., "{task_file}"] (non-empty strings)')
        elif self.wraps or self.command:
            raise ValueError('wraps and command belong to kind = "agent" domains; set kind = "agent" or remove them')
        return self

    @model_validator(mode="after")
    def _levels_ordered(self):
        if self.min_level > self.max_level:
            raise ValueError(f"min_level {self.min_level} > max_level {self.max_level}")
        if self.start_level is not None and not self.min_level <= self.start_level <= self.max_level:
            raise ValueError(f"start_level {self.start_level} outside [{self.min_level}, {self.max_level}]")
        return self

    @model_validator(mode="after")
    def _field_map_targets(self):
        bad = [
            k
            for k, v in self.field_map.items()
            if not (v and (k in FIELD_TARGETS or (k.partition(".")[0] in ("hidden", "params") and k.partition(".")[2])))
        ]
        if bad:
            raise ValueError(
                f"field_map keys {bad} unknown (or mapped to an empty column); use "
                f"{list(FIELD_TARGETS)} or hidden.<key> / params.<key>"
            )
        if "gold" in self.field_map and "hidden.gold" in self.field_map:
            raise ValueError("field_map maps both gold and hidden.gold (the same field); keep one")
        if self.heldout_split and self.heldout_split == self.split:
            raise ValueError(f"heldout_split {self.heldout_split!r} is the training split; name another split")
        return self

    @property
    def initial_level(self) -> int:
        """start_level, else min_level."""
        return self.min_level if self.start_level is None else self.start_level


RG_PLACE = "sampler.domain_sets.reasoning_gym"
RG_FIXED = ("kind", "heldout")
"""DomainConfig fields the set decides (an override may not set them)."""


class ReasoningGymSet(Section):
    """`[sampler.domain_sets.reasoning_gym]`: reasoning-gym datasets as domains `rg-<dataset>`
    (one `reasoning_gym` domain kind and verifier for all of them)."""

    PLACE = RG_PLACE
    enabled: bool = False
    """Expand the set into `sampler.domains` (true as soon as the table is given)."""
    include: list[str] = Field(default_factory=lambda: ["*"])
    """Datasets to include: names or fnmatch globs over `reasoning_gym.factory.DATASETS` names
    (`*` matches every dataset except `composite` and the slow `sokoban`, which must be named;
    a glob skips a dataset none of whose levels validates in `range_mode`, a name is an error)."""
    exclude: list[str] = Field(default_factory=list)
    """Datasets (names or globs) taken out of `include`."""
    heldout: list[str] = Field(default_factory=list)
    """Datasets (names or globs) that become zero-shot domains (`heldout = true`: never
    trained, only evaluated), whether or not `include` selects them."""
    weight: float = Field(default=1.0, ge=0.0)
    """Static sampling weight of each domain of the set (see `sampler.domains.<d>.weight`)."""
    sft_weight: float | None = Field(default=None, ge=0.0)
    """SFT share of each domain of the set (default: `weight`; datasets without a single gold
    answer never demonstrate)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Generated-token budget of each domain of the set (default: sampler.max_tokens)."""
    target_reward: float | None = None
    """Reward each domain of the set should reach (see `sampler.domains.<d>.target_reward`;
    unset: as there)."""
    floor_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Minimum sampling share of each domain of the set."""
    pool: str = "short"
    """Duration pool of each domain of the set (a `rollout.pools` name)."""
    range_mode: Literal["inclusive", "upper_bound"] = "inclusive"
    """How a curriculum level bounds a dataset's range attributes: `inclusive` (from the
    easiest value up to the level's: reasoning-gym's default) or `upper_bound` (the level's
    own segment only). Levels whose config a dataset rejects are skipped."""
    max_prompt_chars: int | None = Field(default=None, ge=1)
    """Longest question (characters) a domain of the set trains on: longer ones are skipped by
    the sampler and counted (`skipped_prompt_too_long`), never truncated. None: no limit."""
    eval_n: int = Field(default=32, ge=1)
    """Most held-out eval problems per domain of the set (its source's `eval_problems` gives at
    most min(this, `scheduler.eval.n`), at its start level; fewer when that level's question
    space is small): drawn only from the content-hash eval slice (one hash bucket in 8)
    that training never draws from."""
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per dataset (its reasoning-gym name), `sampler.domains.<d>` fields over the set's, e.g.
    `{ weight = 2.0, min_level = 2, max_level = 3, start_level = 2, max_tokens = 64 }`;
    `params` merge into the domain's (`range_mode`, `config`: extra fields of the dataset's
    own config, `max_prompt_chars`, `eval_n`). `kind` and `heldout` are the set's."""

    @model_validator(mode="before")
    @classmethod
    def _given_means_enabled(cls, data: Any) -> Any:
        if isinstance(data, dict) and "enabled" not in data:
            data = {**data, "enabled": True}
        return data


class DomainSets(Section):
    """Families of domains expanded into `sampler.domains` when the config is validated."""

    reasoning_gym: ReasoningGymSet = Field(default_factory=lambda: ReasoningGymSet(enabled=False))
    """Every (selected) reasoning-gym dataset as a domain `rg-<dataset>`."""


def _unknown(field: str, name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"closest: {', '.join(close)}" if close else "see reasoning_gym.factory.DATASETS"
    return f"{RG_PLACE}.{field}: unknown dataset {name!r} ({hint})"


def _select(
    field: str,
    patterns: list[str],
    known: list[str],
    errors: list[str],
    skip=frozenset(),
    named: set[str] | None = None,
) -> set[str]:
    """The datasets `patterns` select (names given exactly are added to `named`)."""
    out: set[str] = set()
    for pat in patterns:
        if any(c in pat for c in "*?["):
            hits = {n for n in known if fnmatch.fnmatchcase(n, pat) and n not in skip}
            if not hits:
                errors.append(f"{RG_PLACE}.{field}: {pat!r} matches no dataset")
            out |= hits
        elif pat in known:
            out.add(pat)
            if named is not None:
                named.add(pat)
        else:
            errors.append(_unknown(field, pat, known))
    return out


def _rg_domain(rs: ReasoningGymSet, dataset: str, heldout: bool, named: bool, errors: list[str]) -> DomainConfig | None:
    """The domain of `dataset`, or None (with an error, unless only a glob chose a dataset
    that has no valid level)."""
    from schemas import rg_family

    override = dict(rs.overrides.get(dataset) or {})
    fixed = [k for k in RG_FIXED if k in override]
    if fixed:
        errors.append(f"{RG_PLACE}.overrides.{dataset}: {fixed} are set by the domain set, not per dataset")
        return None
    params: dict[str, Any] = {"dataset": dataset, "range_mode": rs.range_mode, "eval_n": rs.eval_n}
    if rs.max_prompt_chars is not None:
        params["max_prompt_chars"] = rs.max_prompt_chars
    params.update(override.pop("params", None) or {})
    mode, extra = params.get("range_mode", "inclusive"), params.get("config") or {}
    try:
        valid = rg_family.levels(dataset, mode, extra)
    except ValueError as exc:
        errors.append(f"{RG_PLACE}.overrides.{dataset}: {exc}")
        return None
    if not valid:
        if not named and dataset not in rs.overrides:
            return None
        errors.append(
            f"{RG_PLACE}: dataset {dataset!r} has no level whose config validates in range_mode {mode!r} "
            f"({rg_family.level_problem(dataset, mode, extra)}); exclude it or set "
            f"overrides.{dataset}.params.range_mode"
        )
        return None
    fields: dict[str, Any] = dict(
        kind="reasoning_gym",
        min_level=1,
        max_level=len(valid),
        weight=rs.weight,
        sft_weight=rs.sft_weight,
        max_tokens=rs.max_tokens,
        target_reward=rs.target_reward,
        floor_share=rs.floor_share,
        pool=rs.pool,
        heldout=heldout,
        params=params,
    )
    fields.update(override)
    try:
        dc = DomainConfig(**fields)
    except ValidationError as exc:
        errors.append(
            f"{RG_PLACE}.overrides.{dataset}: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e["loc"] else e["msg"] for e in exc.errors())
        )
        return None
    if dc.max_level > len(valid):
        errors.append(
            f"{RG_PLACE}.overrides.{dataset}: max_level {dc.max_level} > the dataset's {len(valid)} "
            f"levels in range_mode {mode!r}"
        )
        return None
    return dc


def expand_reasoning_gym(rs: ReasoningGymSet) -> dict[str, DomainConfig]:
    """The `sampler.domains` entries of the set (see the module guarantees); ValueError
    naming every problem at once."""
    from schemas import rg_family

    known = rg_family.dataset_names()
    errors: list[str] = []
    named: set[str] = set()
    members = _select("include", rs.include, known, errors, skip=frozenset(rg_family.EXPLICIT_ONLY), named=named)
    members -= _select("exclude", rs.exclude, known, errors)
    held = _select("heldout", rs.heldout, known, errors, named=named)
    if not members and not errors:
        errors.append(f"{RG_PLACE}: include {rs.include} minus exclude {rs.exclude} selects no dataset")
    for name in rs.overrides:
        if name not in known:
            errors.append(_unknown("overrides", name, known))
        elif name not in members | held:
            errors.append(f"{RG_PLACE}.overrides: {name!r} is not selected by include/heldout")
    out = {}
    for dataset in sorted(members | held):
        dc = _rg_domain(rs, dataset, dataset in held, dataset in named, errors)
        if dc is not None:
            out[rg_family.domain_name(dataset)] = dc
    if errors:
        raise ValueError("; ".join(errors))
    return out


def _set_given(data: dict) -> bool:
    sets = data.get("domain_sets")
    rs = sets.get("reasoning_gym") if isinstance(sets, dict) else getattr(sets, "reasoning_gym", None)
    if isinstance(rs, dict):
        return bool(rs.get("enabled", True))
    return bool(getattr(rs, "enabled", False))


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
    """Domains to sample, by name (`arith`, `math`); default: `domain` at levels 1..6 starting at `difficulty`
    (none when a domain set is given without `domain`). Domain sets add theirs here."""
    domain_sets: DomainSets = Field(default_factory=DomainSets)
    """Families of domains expanded into `domains` (`reasoning_gym`)."""
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
            if _set_given(data) and "domain" not in data and "difficulty" not in data:
                return {**data, "domains": {}}
            domain, difficulty = data.get("domain", "arith"), data.get("difficulty", 3)
            if isinstance(domain, str) and isinstance(difficulty, int):
                data = {
                    **data,
                    "domains": {domain: {"min_level": 1, "max_level": max(6, difficulty), "start_level": difficulty}},
                }
        return data

    @model_validator(mode="after")
    def _expand_domain_sets(self):
        rs = self.domain_sets.reasoning_gym
        if rs.enabled:
            for name, dc in expand_reasoning_gym(rs).items():
                have = self.domains.get(name)
                if have is None:
                    self.domains[name] = dc  # in place: no re-validation of the section
                elif have.model_dump() != dc.model_dump():
                    raise ValueError(
                        f"sampler.domains.{name} is also made by {RG_PLACE} and differs from it; "
                        f"set its fields in {RG_PLACE}.overrides instead"
                    )
        return self

    @model_validator(mode="after")
    def _some_domain(self):
        if not self.domains:
            raise ValueError("sampler.domains must name at least one domain")
        if all(d.heldout for d in self.domains.values()):
            raise ValueError("every sampler domain is heldout: at least one must be trained on")
        return self
