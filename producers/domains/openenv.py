"""The `openenv` domain kind: episodes in an OpenEnv environment server, rlbus owning the loop.

Config (`[sampler.domains.<d>] kind = "openenv"`, with `max_turns`, `max_tokens`, `tool_format`):

    [sampler.domains.guess.params]
    url = "http://127.0.0.1:8000"      # or docker_image = "guess-env:latest" (one container per episode)
    mode = "text"                      # each model turn is the action {action_field: text}; or "mcp"
    action_field = "message"           # text mode: the action field that gets the turn
    observation_field = "text"         # the observation field the model sees ("": all of it, JSON)
    prompt = "reset"                   # "reset" | "dataset" | "both" (default: "dataset" with data)
    instructions = "Guess the number." # the system turn's text (default: how to act)
    reset = { }                        # reset() kwargs of every task (a task's seed is added)
    level_kwarg = ""                   # a reset() kwarg that gets the curriculum level
    tools = []                         # mcp: the tools offered (empty: all that tools/list names)
    step_timeout_s = 60                # also connect_timeout_s, ready_timeout_s
    eval_n = 16                        # most held-out tasks

Prompts come from `reset()`'s observation (`prompt = "reset"`: each task is a seed, passed to
`reset`), or from the domain's `data` (the JSONL task format of `producers.file_source`; a row's
`params.reset` are its reset() kwargs; `prompt = "both"` also shows the reset observation).

Guarantees:
- Every task carries its environment as the public `verifier_params["openenv"]`
  (`schemas.openenv_env.EnvSpec`, checked here: a bad spec or an unknown param is a ValueError
  naming the key); MCP mode needs `tool_format = "json"`. The verifier is `openenv` (the domain's
  `verifier` may override it), which scores the rewards the environment gave.
- The prompt is a system turn (the scripted engine's task and format lines, then the
  instructions), then the row's messages (`dataset`, `both`); the reset observation is added
  by the rollout side. Rows' hidden data goes to the hidden bucket only (`hidden_ref`).
- Held out, never drawn for training: seeds whose sha256 falls in `eval_set.in_eval_slice`
  (`eval_set` gives the first `eval_n` of them), or the data's held-out rows.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from bus.hidden import hidden_ref_for
from producers.datafile import TaskLine, domain_split
from producers.domains import DomainContext, Drawn, finish_task
from producers.eval_set import EvalSet, drawn_set, in_eval_slice
from producers.file_source import JSONL
from schemas import ChatMessage
from schemas.openenv_env import SPEC_KEY, EnvSpec
from schemas.repo_task import PROMPT_FORMAT_LINE, PROMPT_TASK_LINE

SPEC_PARAMS = (
    "url",
    "docker_image",
    "mode",
    "action_field",
    "observation_field",
    "reset",
    "tools",
    "connect_timeout_s",
    "step_timeout_s",
    "ready_timeout_s",
)
KNOWN = (*SPEC_PARAMS, "prompt", "instructions", "level_kwarg", "eval_n")
PROMPTS = ("reset", "dataset", "both")
SEEDS = 2**31
INSTRUCTIONS = {
    "text": "You act in an environment: each of your turns is sent to it as your action, and its "
    "observation comes back. The episode ends when the environment says it is over.",
    "mcp": "You act in an environment through its tools. Call one tool per turn; its result comes "
    "back. The episode ends when the environment says it is over, or when you answer without a tool call.",
}


def held_out(seed: int) -> bool:
    """Whether reset seed `seed` is an eval seed (never drawn for training)."""
    return in_eval_slice(hashlib.sha256(str(seed).encode()).hexdigest())


def _params(ctx: DomainContext) -> tuple[dict[str, Any], str]:
    """(the spec params, the prompt source) of the domain, checked."""
    p, where = dict(ctx.dc.params), f"sampler.domains.{ctx.name}.params"
    unknown = sorted(set(p) - set(KNOWN))
    if unknown:
        raise ValueError(f"{where}: unknown params {unknown}; the openenv kind takes {list(KNOWN)}")
    prompt = p.get("prompt") or ("dataset" if ctx.dc.data else "reset")
    if prompt not in PROMPTS:
        raise ValueError(f"{where}.prompt must be one of {PROMPTS}, got {prompt!r}")
    if prompt != "reset" and not ctx.dc.data:
        raise ValueError(f"{where}: prompt = {prompt!r} needs sampler.domains.{ctx.name}.data (a JSONL task file)")
    spec = {k: p[k] for k in SPEC_PARAMS if k in p}
    spec["observe_reset"] = prompt != "dataset"
    EnvSpec.from_params(spec, where)  # fails here, at start, not in a rollout worker
    if spec.get("mode") == "mcp" and ctx.dc.tool_format != "json":
        raise ValueError(
            f'sampler.domains.{ctx.name}: mode = "mcp" declares the environment\'s tools to the chat template: '
            'set tool_format = "json"'
        )
    return spec, prompt


@dataclass
class OpenEnvDomain:
    """Task source of one `openenv` config domain."""

    ctx: DomainContext
    skipped: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.spec, self.prompt = _params(self.ctx)
        p = self.ctx.dc.params
        mode = self.spec.get("mode", "text")
        self.instructions = str(p.get("instructions") or INSTRUCTIONS[mode])
        self.level_kwarg = str(p.get("level_kwarg") or "")
        self.eval_n = int(p.get("eval_n", 16))
        self.rows: tuple[TaskLine, ...] = ()
        self.heldout: tuple[TaskLine, ...] = ()
        if self.ctx.dc.data:
            split = domain_split(self.ctx, JSONL)
            self.rows, self.heldout, self.skipped = split.train, split.heldout, dict(split.skipped)
            if not self.rows:
                raise ValueError(f"sampler.domains.{self.ctx.name}: no training row in {self.ctx.dc.data}")

    def _system(self, problem: str) -> ChatMessage:
        fmt = self.ctx.dc.tool_format
        return ChatMessage(
            role="system", content=f"{PROMPT_TASK_LINE}{problem}\n{PROMPT_FORMAT_LINE}{fmt}\n\n{self.instructions}"
        )

    def _drawn(self, problem: str, task_id: str, level: int, reset: dict, row: TaskLine | None) -> Drawn:
        reset = {**(self.spec.get("reset") or {}), **reset}
        if self.level_kwarg:
            reset[self.level_kwarg] = level
        spec = {**self.spec, "reset": reset}
        prompt = [self._system(problem)]
        params: dict[str, Any] = {SPEC_KEY: spec, "problem_id": problem}
        hidden_ref = None
        if row is not None and self.prompt != "reset":
            prompt += list(row.prompt)
        if row is not None:
            params.update({k: v for k, v in row.params.items() if k != "reset"})
            hidden_ref = hidden_ref_for(self.ctx.name, row.id) if row.hidden else None
        task = finish_task(
            self.ctx,
            task_id=task_id,
            difficulty=level,
            verifier="openenv",
            prompt=prompt,
            verifier_params=params,
            hidden_ref=hidden_ref,
        )
        return Drawn(task, row.hidden if row is not None else None)

    def _row(self, row: TaskLine, task_id: str, level: int) -> Drawn:
        reset = row.params.get("reset") or {}
        if not isinstance(reset, dict):
            raise ValueError(f"sampler.domains.{self.ctx.name}: row {row.id}: params.reset must be an object")
        return self._drawn(f"{self.ctx.name}-{row.id}", task_id, level, dict(reset), row)

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        if self.rows:
            at_level = [r for r in self.rows if r.level == level] or list(self.rows)
            row = rng.choice(at_level)
            return self._row(row, f"{self.ctx.name}-{row.id}-{index}", level)
        seed = rng.randrange(SEEDS)
        while held_out(seed):
            seed = rng.randrange(SEEDS)
        problem = f"{self.ctx.name}-seed{seed}"
        return self._drawn(problem, f"{problem}-{index}", level, {"seed": seed}, None)

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet | None:
        """The held-out seeds (or rows) as a pipeline-only set, scored by their environment's
        rewards; fixed by the domain's config (`seed` unused: eval seeds are a fixed slice)."""
        level = self.ctx.dc.initial_level if level is None else level
        n = min(n, self.eval_n)
        if self.ctx.dc.data:
            drawn = [self._row(r, f"{self.ctx.name}-eval-{r.id}", level) for r in self.heldout[:n]]
        else:
            seeds = [s for s in range(64 * max(1, n)) if held_out(s)][:n]
            drawn = [
                self._drawn(f"{self.ctx.name}-seed{s}", f"{self.ctx.name}-eval-seed{s}", level, {"seed": s}, None)
                for s in seeds
            ]
        return drawn_set(self.ctx.name, seed, level, drawn) if drawn else None
