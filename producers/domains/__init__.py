"""Task domains by name: built-ins first, then plugins from the `rlbus.domains` entry points.

A domain kind is a factory `make(ctx: DomainContext) -> DomainSource`; a source makes
tasks with `make_task(rng, level, index) -> Drawn`. A `Drawn` carries the public `Task`
and, separately, its `hidden` payload (gold answers, unit tests) that the sampler puts in
the run's hidden bucket under `task.hidden_ref` (see `bus.hidden`); the task itself
never carries hidden content.

Guarantees:
- A config domain's kind is `DomainConfig.kind`, else its name when registered, else
  `math` when it has a `data` file; anything else is a `ValueError` listing the kinds.
- Kinds resolve through one `schemas.registry.Registry` (the verifiers' mechanism too):
  built-ins are imported on first use; an entry point may not shadow a built-in; entry
  points are discovered once per process (`reset_entry_points()` forgets them).
- `finish_task` applies the per-domain config every kind shares: verifier override,
  reward weights (`Task.reward_weights`), token and turn budgets, group size and temperature.
- A factory that raises `DomainUnavailable` cannot start its domain but lets the run go
  on without it: `make_sources` logs the reason and leaves that domain out (returned in
  `disabled`); any other exception is a config error and propagates, as before.
- A source that cannot make one task raises `TaskSkipped(reason)`: the sampler draws
  another; a source may count the problems it skips in `skipped` (reason -> count), and
  may set `demonstrable = False` when it has no demonstrations after all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from schemas import Task
from schemas.registry import Registry

if TYPE_CHECKING:
    from producers.eval_set import EvalSet

log = structlog.get_logger()

GROUP = "rlbus.domains"

BUILTINS: dict[str, str] = {
    "arith": "producers.domains.arith:ArithDomain",
    "math": "producers.domains.math:MathDomain",
    "tool_calc": "producers.domains.tool_calc:ToolCalcDomain",
    "code": "producers.domains.code:CodeDomain",
    "extract": "producers.domains.extract:ExtractDomain",
    "files": "producers.domains.files:FilesDomain",
    "jsonl": "producers.domains.jsonl:JsonlDomain",
    "judge": "producers.domains.judge:JudgeDomain",
    "sleep": "producers.domains.sleep:SleepDomain",
    "reasoning_gym": "producers.domains.reasoning_gym:ReasoningGymDomain",
    "repo": "producers.domains.repo:RepoDomain",
    "harbor": "producers.domains.harbor:HarborDomain",
    "openenv": "producers.domains.openenv:OpenEnvDomain",
    "agent": "producers.domains.agent:AgentDomain",
    "findoc": "producers.domains.findoc:FindocDomain",
    "recall": "producers.domains.recall:RecallDomain",
    "rlhf": "producers.domains.rlhf:RlhfDomain",
}
"""Built-in domain kinds as `module:factory` (a module may be absent until it is built)."""


@dataclass(frozen=True)
class DomainContext:
    """What a domain source is built from."""

    run_id: str
    name: str
    """The config key (the task's `domain`)."""
    cfg: Any
    """The whole RunConfig."""
    dc: Any
    """This domain's DomainConfig."""


@dataclass
class Drawn:
    """A task plus its verifier-only payload, and the public payloads its refs name."""

    task: Task
    hidden: dict[str, Any] | None = None
    payloads: dict[str, bytes] = field(default_factory=dict)
    """sha256 -> bytes of each public payload the task names by reference (`Task.workspace_ref`):
    whoever publishes the task stores them first (`bus.payloads.put_payloads`)."""


class DomainUnavailable(ValueError):
    """A domain that cannot start here (its generator fails to build): the run goes on without it."""


class TaskSkipped(RuntimeError):
    """A source could not make this one task; `reason` is a short counter name."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class DomainSource(Protocol):
    """A domain's task source: `make_task` draws training tasks.

    Optional methods, looked up by name (a source without them still conforms):
    `demonstration(rng, level)` for SFT demos, and `eval_set(n, seed, level) -> EvalSet | None`
    (`producers.eval_set`), the domain's fixed held-out eval set: at most n items, a pure
    function of (n, seed, level) and the domain's config, never drawn by `make_task`; level
    None is the domain's own eval level. Each item is a task like a training one (verifier,
    public `verifier_params`, gold in `hidden`); the set says how it is scored: locally by
    the scheduler's engine (`local`, `answer`, each item's `gold`) and/or through the
    pipeline as greedy `purpose=eval` tasks with their verifiers (`scheduler.pipeline_eval`)."""

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn: ...


Factory = Callable[[DomainContext], DomainSource]


KINDS = Registry(GROUP, BUILTINS, what="domain kind")
"""The built-in kinds and the `rlbus.domains` entry points."""


def reset_entry_points() -> None:
    """Forget the discovered domain plugins (tests; after installing a plugin)."""
    KINDS.reset()


def kinds() -> list[str]:
    """Every known domain kind."""
    return KINDS.names()


def kind_of(name: str, dc) -> str:
    """The kind a config domain resolves to (see the module docstring)."""
    if dc.kind:
        return dc.kind
    if name in KINDS:
        return name
    if dc.data:
        return "math"
    raise ValueError(f"domain {name!r} is not a registered kind; set sampler.domains.{name}.kind to one of {kinds()}")


def get_factory(kind: str) -> Factory:
    """The factory of `kind` (ValueError naming the known kinds when unknown or broken)."""
    return KINDS.load(kind)


def make_source(run_id: str, name: str, cfg) -> DomainSource:
    """The task source of config domain `name`."""
    dc = cfg.sampler.domains[name]
    return get_factory(kind_of(name, dc))(DomainContext(run_id=run_id, name=name, cfg=cfg, dc=dc))


def eval_set_for(
    cfg, name: str, n: int, seed: int, level: int | None = None, *, kind: str | None = None, dc=None
) -> EvalSet | None:
    """The eval set of config domain `name` (its source's `eval_set(n, seed, level)`, at most n
    items), or None when its kind has no such hook, its factory raises `DomainUnavailable`
    (the sampler disables it too, and logs why) or the set is empty. `kind` and `dc` default
    to the config domain's; a kind that is a class without `eval_set` builds no source."""
    dc = cfg.sampler.domains[name] if dc is None else dc
    factory = get_factory(kind or kind_of(name, dc))
    if isinstance(factory, type) and not hasattr(factory, "eval_set"):
        return None
    try:
        source = factory(DomainContext(run_id="eval", name=name, cfg=cfg, dc=dc))
    except DomainUnavailable:
        return None
    hook = getattr(source, "eval_set", None)
    found = None if hook is None else hook(n, seed, level)
    return found.head(n) if found is not None and len(found) else None


def make_sources(run_id: str, cfg, names=None) -> tuple[dict[str, DomainSource], dict[str, str]]:
    """(sources, disabled) of the config's domains (or of `names`): a domain whose factory
    raises `DomainUnavailable` is logged and left out, with its reason in `disabled`."""
    sources: dict[str, DomainSource] = {}
    disabled: dict[str, str] = {}
    for name in cfg.sampler.domains if names is None else names:
        try:
            sources[name] = make_source(run_id, name, cfg)
        except DomainUnavailable as exc:
            log.warning("domain disabled", domain=name, reason=str(exc))
            disabled[name] = str(exc)
    return sources, disabled


def finish_task(ctx: DomainContext, **fields: Any) -> Task:
    """A Task with the shared per-domain settings applied (fields given explicitly win)."""
    sc, dc = ctx.cfg.sampler, ctx.dc
    base: dict[str, Any] = dict(
        run_id=ctx.run_id,
        domain=ctx.name,
        group_size=sc.group_size,
        temperature=sc.temperature,
        max_tokens=dc.max_tokens or sc.max_tokens,
        max_turns=dc.max_turns,
        tool_format=dc.tool_format,
    )
    base.update(fields)
    if dc.verifier:
        base["verifier"] = dc.verifier
    if dc.reward_weights:
        base["reward_weights"] = dict(dc.reward_weights)
    return Task(**base)


@dataclass
class StaticSource:
    """A source over a fixed list of (task fields, hidden) pairs, drawn by level (helper for file domains)."""

    ctx: DomainContext
    items: list[tuple[dict[str, Any], dict[str, Any] | None, int | None]] = field(default_factory=list)

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        at_level = [it for it in self.items if it[2] == level] or self.items
        fields, hidden, _ = rng.choice(at_level)
        fields = dict(fields)
        fields.setdefault("task_id", f"{self.ctx.name}-{index}")
        fields.setdefault("difficulty", level)
        return Drawn(finish_task(self.ctx, **fields), hidden)
