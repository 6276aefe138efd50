"""The `harbor` domain kind: Harbor task directories, each run in its own container.

Config: `[sampler.domains.<d>] kind = "harbor"`, `tasks = "examples/harbor/*"` (a glob of task
directories; also accepted as `params.tasks`), `max_turns`, `tool_format`; the operator's
settings are the run's `[harbor]` section (`schemas.config.harbor`). Params: `eval_n` (most
held-out tasks, default 16), `eval_tasks` (names held out instead of the hash buckets),
`sft_from_solution` (true: `solve.sh` as a one-call `bash` demonstration for SFT).

Guarantees:
- A task's identity is its directory name plus its content hash (`HarborTask.task_id`);
  held-out tasks are those whose content hash falls in one of `eval_set.EVAL_BUCKETS` buckets (fewer
  than 2 runnable tasks: none), never drawn for training; `eval_set` gives them.
- A directory without `instruction.md` or `task.toml`, or with a TOML error, is a config error
  naming the file, unless `harbor.skip_invalid` (then skipped, counted in `skipped`).
- Disabled, with the reason in `disabled` (the run goes on): tasks refused as written
  (`HarborTask.refusal`: no `tests/test.sh`, `[[steps]]`) and tasks whose cached oracle /
  empty check failed (`sandbox_workers.harbor_check`, run by `rlbus tasks check` and at
  `rlbus up` start). No runnable task left raises `DomainUnavailable`.
- The public task: the prompt is `instruction.md` with the task line, the format line and the
  tools' usage; tools `HARBOR_TOOLS` (declared to the chat template under `json`);
  verifier `harbor`; `verifier_params` = the container spec (`harbor`), `agent_timeout_s`
  and `tool_timeout_s`. The hidden payload (tests, verifier user, env, timeout, `verify_in`,
  protected paths, toolchain) is only in the hidden bucket.
- A task that wants the internet but runs without it (the operator did not consent) is
  logged once per task when the domain starts.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import structlog

from bus.hidden import hidden_ref_for
from producers.domains import DomainContext, DomainUnavailable, Drawn, finish_task
from producers.eval_set import EvalSet, drawn_set, in_eval_slice
from sandbox_workers.harbor_check import box_spec, cached_check, hidden_payload, network_for, verify_job
from schemas import ChatMessage
from schemas.harbor_task import HarborTask, HarborTaskError, find_tasks, read_task
from schemas.repo_task import PROMPT_FORMAT_LINE, PROMPT_TASK_LINE
from schemas.tool_protocol import HARBOR_TOOLS, repo_call_text

log = structlog.get_logger()


def usage(tool_format: str) -> str:
    """How to call the container tools in `tool_format` (the prompt's tools section)."""
    lines = ["You act in the task's Linux container. Call one tool per turn; its output comes back."]
    if tool_format != "json":
        for tool, args in (
            ("bash", {"command": "ls -la", "timeout": 30}),
            ("read_file", {"path": "/app/notes.txt"}),
            ("write_file", {"path": "/app/out.txt", "content": "...the whole file...\n"}),
            ("submit", {}),
        ):
            lines.append(repo_call_text(tool, args, "tags"))
    lines.append("Call submit when the task is done; the hidden tests then check the container.")
    return "\n".join(lines)


def render_prompt(task: HarborTask, tool_format: str) -> str:
    return (
        f"{PROMPT_TASK_LINE}{task.task_id}\n{PROMPT_FORMAT_LINE}{tool_format}\n\n"
        f"{task.instruction.strip()}\n\nTools:\n{usage(tool_format)}"
    )


def load_tasks(ctx: DomainContext) -> tuple[list[HarborTask], Counter]:
    """The task directories of the domain's glob, read (see the guarantees); (tasks, skipped)."""
    pattern = ctx.dc.tasks or ctx.dc.params.get("tasks") or ""
    if not pattern:
        raise ValueError(f'sampler.domains.{ctx.name}: a harbor domain needs tasks = "<glob of task directories>"')
    paths = find_tasks(str(pattern))
    if not paths:
        raise ValueError(f"sampler.domains.{ctx.name}: tasks = {pattern!r} matches no task directory")
    tasks, skipped = [], Counter()
    for path in paths:
        try:
            tasks.append(read_task(path))
        except HarborTaskError as exc:
            if not ctx.cfg.harbor.skip_invalid:
                raise ValueError(f"sampler.domains.{ctx.name}: {exc} (or set harbor.skip_invalid = true)") from None
            log.warning("harbor task skipped", domain=ctx.name, reason=str(exc))
            skipped["invalid"] += 1
    return tasks, skipped


def disabled_reasons(tasks: list[HarborTask], hcfg) -> dict[str, str]:
    """name -> why, for tasks refused as written or whose cached check failed."""
    out = {}
    for t in tasks:
        if t.refusal:
            out[t.name] = t.refusal
            continue
        check = cached_check(t, hcfg)
        if check is not None and not check.ok:
            out[t.name] = f"check failed: {check.reason}"
    return out


@dataclass
class HarborDomain:
    """Task source of one `harbor` config domain."""

    ctx: DomainContext
    skipped: Counter = field(default_factory=Counter, init=False)
    disabled: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        hcfg, p = self.ctx.cfg.harbor, self.ctx.dc.params
        tasks, self.skipped = load_tasks(self.ctx)
        self.disabled = disabled_reasons(tasks, hcfg)
        for name, why in self.disabled.items():
            log.warning("harbor task disabled", domain=self.ctx.name, task=name, reason=why[:300])
        runnable = sorted((t for t in tasks if t.name not in self.disabled), key=lambda t: t.content_hash)
        for t in runnable:
            if t.allow_internet and not network_for(t, hcfg):
                log.warning(
                    "harbor task runs without network (set harbor.allow_internet = true to consent)", task=t.name
                )
        if not runnable:
            raise DomainUnavailable(
                f"no runnable harbor task in {self.ctx.dc.tasks or p.get('tasks')}: {self.disabled}"
            )
        if "eval_tasks" in p:
            eval_names = {str(x) for x in p["eval_tasks"]}
        else:
            bucket = [t.name for t in runnable if in_eval_slice(t.content_hash)]
            eval_names = set(bucket) if len(runnable) >= 2 else set()
        self.eval = [t for t in runnable if t.name in eval_names][: int(p.get("eval_n", 16))]
        self.train = [t for t in runnable if t.name not in eval_names]
        if not self.train:
            raise ValueError(f"sampler.domains.{self.ctx.name}: no training task left (every task is held out)")
        random.Random(f"harbor-{self.ctx.cfg.run.seed}-{self.ctx.name}").shuffle(self.train)
        # one bash call can carry solve.sh, not other solution files it reads (those are not demonstrated)
        self.demonstrated = [t for t in self.train if t.oracle and set(t.solution) == {"solve.sh"}]
        self.demonstrable = bool(p.get("sft_from_solution")) and bool(self.demonstrated)

    def _drawn(self, task: HarborTask, task_id: str, level: int) -> Drawn:
        hcfg, fmt = self.ctx.cfg.harbor, self.ctx.dc.tool_format
        spec = box_spec(task, hcfg)
        out = finish_task(
            self.ctx,
            task_id=task_id,
            difficulty=level,
            verifier="harbor",
            prompt=[ChatMessage(role="user", content=render_prompt(task, fmt))],
            tools=list(HARBOR_TOOLS),
            verifier_params={
                "harbor": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
                "agent_timeout_s": task.agent_timeout_s,
                "tool_timeout_s": hcfg.tool_timeout_s,
                "harbor_task": task.task_id,
            },
            hidden_ref=hidden_ref_for(self.ctx.name, task.task_id),
        )
        return Drawn(out, hidden_payload(verify_job(task, hcfg, spec)))

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        task = self.train[index % len(self.train)]
        return self._drawn(task, f"{self.ctx.name}-{task.task_id}-{index}", level)

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """The held-out tasks as a pipeline-only eval set (fixed by content hashes; `seed` unused)."""
        level = self.ctx.dc.initial_level if level is None else level
        drawn = [self._drawn(t, f"{self.ctx.name}-eval-{t.task_id}", level) for t in self.eval[:n]]
        return drawn_set(self.ctx.name, seed, level, drawn)

    def demonstration(self, rng: random.Random, level: int) -> list[tuple[str, bool | None]]:
        """`solve.sh` as one `bash` call, then `submit` (SFT segments: prompt, then the calls).
        Only training tasks whose solution is `solve.sh` alone; never a held-out one."""
        if not self.demonstrable:
            raise ValueError(f"sampler.domains.{self.ctx.name}: set params.sft_from_solution = true to demonstrate")
        task = rng.choice(self.demonstrated)
        fmt = self.ctx.dc.tool_format
        call = repo_call_text("bash", {"command": task.oracle}, fmt)
        return [(render_prompt(task, fmt), False), (call, True), (repo_call_text("submit", {}, fmt), True)]
