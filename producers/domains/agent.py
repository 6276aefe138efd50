"""The `agent` domain kind: another kind's tasks, solved by an agent harness that owns its loop.

Config:

    [sampler.domains.swe]
    kind = "agent"
    wraps = "repo"                       # or math, tool_calc, harbor, ...: the tasks and the verifier
    command = ["python3", "-m", "my_agent", "--task-file", "{task_file}"]
    params = { tasks = "all" }           # the wrapped kind's own params

Guarantees:
- Tasks are exactly the wrapped kind's (same prompt, hidden payload, `hidden_ref`, verifier,
  public `verifier_params`, workspace, eval set), built by that kind's factory with this
  domain's config (`kind` = `wraps`); only `domain` is this domain's name. So the wrapped
  verifier scores the episode on the controlled side, unchanged.
- Which command runs is never read from a task: the rollout worker takes it from its own
  config (`sampler.domains.<d>.command`), so a task cannot choose what runs on a worker.
- What the harness is given about a task is `schemas.agent_task.public_task` (never hidden data).
- No SFT demonstrations: a harness's own prompts and action format are not the wrapped kind's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from producers.domains import DomainContext, Drawn, get_factory


def wrapped_context(ctx: DomainContext) -> DomainContext:
    """The context the wrapped kind's factory is built from: this domain's config as that kind."""
    dc = ctx.dc.model_copy(update={"kind": ctx.dc.wraps, "wraps": "", "command": []})
    return DomainContext(run_id=ctx.run_id, name=ctx.name, cfg=ctx.cfg, dc=dc)


@dataclass
class AgentDomain:
    """Task source of one `agent` config domain: the wrapped kind's source, passed through."""

    ctx: DomainContext
    skipped: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        wraps = self.ctx.dc.wraps
        if not wraps or wraps == "agent":
            raise ValueError(f'sampler.domains.{self.ctx.name}: kind = "agent" needs wraps = "<another kind>"')
        self.inner = get_factory(wraps)(wrapped_context(self.ctx))
        self.skipped = getattr(self.inner, "skipped", self.skipped)

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        return self.inner.make_task(rng, level, index)

    def eval_set(self, n: int, seed: int, level: int | None = None):
        hook = getattr(self.inner, "eval_set", None)
        return None if hook is None else hook(n, seed, level)
