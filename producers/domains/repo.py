"""The `repo` domain kind: repository-level coding tasks from the task cache.

Each task is a cached `schemas.repo_task.RepoTask` (`producers.repo_cache`): the policy gets
the issue, the repository's file list and how to call the repository tools; the episode's
sandbox starts with the repository (`Task.workspace`, or `Task.workspace_ref` when it is large);
the `repo` verifier scores the diff the rollout side exports against the hidden tests.

Params (`sampler.domains.<d>.params`):
- `tasks`: task ids, or `"all"` (default: every cached task; `fixture-*` ids resolve to the
  hand-written fixtures);
- `eval_tasks`: ids held out for evaluation (never trained); default: the tasks whose content
  hash falls in one bucket of `eval_set.EVAL_BUCKETS` (fewer than 2 tasks: none held out);
- `eval_n`: most eval tasks (default 16); `cache_dir`: the task cache (default
  `producers/repo_tasks/` or `$RLBUS_REPO_TASKS`);
- `verifier`: public `repo` verifier params (`timeout_s`, `memory_mb`, `pids`, `cpus`);
- `max_workspace_bytes`: largest repository a task carries inline (default 512 KiB); a larger
  one travels by reference;
- `max_workspace_ref_bytes`: largest repository a task may carry at all (default 64 MiB).

Guarantees:
- A training task is a pure function of (index, params): training id `index mod n` of a
  seeded (`run.seed`) order, so every training task flows; `rng` is unused. Eval tasks
  are never drawn for training; `eval_problems(n, seed)` gives them (sorted by content
  hash, at most min(n, eval_n)) as their own tasks, fixed by the cache's content hashes;
  `eval_set(n, seed, level)` is that list as the domain's pipeline-only `EvalSet`.
- The public task holds the prompt (issue, file list, tool usage, plus the lines
  `PROMPT_TASK_LINE` and `PROMPT_FORMAT_LINE`), the tools (`REPO_TOOLS`), the repository
  files (public: what the agent may see) in `workspace`, or, over `max_workspace_bytes`, as a
  `workspace_ref` to a payload object (`bus.payloads.pack_files`, content-addressed: the same
  repository is one object) that the `Drawn` carries in `payloads` for the publisher to store
  before the task goes out; verifier `repo` and its public params. The hidden payload is
  `{"task": <the RepoTask as a dict>}` (hidden tests, target ids, gold patch): only the verifier
  reads it (`bus.hidden`, chunked in the hidden bucket when large, never in the payload store).
- A repository over `max_workspace_ref_bytes` is not published: `TaskSkipped("workspace_too_large")`,
  counted (a bound on what one episode's sandbox is sent, not a message limit); an unknown id,
  an empty cache or no training task left is a config error naming the build command.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass, field

from bus.hidden import hidden_ref_for
from bus.payloads import pack_files, payload_ref
from bus.subjects import Registry
from producers.domains import DomainContext, Drawn, TaskSkipped, finish_task
from producers.eval_set import EvalSet, drawn_set, in_eval_slice
from producers.repo_cache import BUILD_HINT, list_tasks, load_task
from schemas import BlobRef, ChatMessage
from schemas.repo_task import PROMPT_FORMAT_LINE, PROMPT_TASK_LINE, RepoTask
from schemas.tool_protocol import REPO_TOOLS, repo_call_text

MAX_LISTED_FILES = 200


def usage(tool_format: str) -> str:
    """How to call the repository tools in `tool_format` (the prompt's tools section)."""
    examples = [
        ("list_files", {"path": "."}),
        ("read_file", {"path": "pkg/mod.py", "start": 1, "end": 40}),
        ("write_file", {"path": "pkg/mod.py", "content": "...the whole new file...\n"}),
        ("apply_patch", {"unified_diff": "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1,1 +1,1 @@\n-old\n+new\n"}),
        ("run", {"command": "python -m pytest -x -q"}),
        ("submit", {}),
    ]
    lines = [
        "Call one tool per turn; its output comes back before your next turn."
        if tool_format == "json"
        else "Call one tool per turn with its tag; its output comes back before your next turn:"
    ]
    if tool_format != "json":
        lines += [repo_call_text(tool, args, "tags") for tool, args in examples]
    lines.append("Call submit when the repository is fixed; the hidden tests then run on it.")
    return "\n".join(lines)


def render_prompt(task: RepoTask, tool_format: str) -> str:
    """The prompt text of `task` (see the module guarantees)."""
    paths = sorted(task.files)
    listed = "\n".join(paths[:MAX_LISTED_FILES])
    if len(paths) > MAX_LISTED_FILES:
        listed += f"\n... and {len(paths) - MAX_LISTED_FILES} more (list_files shows them)"
    return (
        f"{PROMPT_TASK_LINE}{task.task_id}\n{PROMPT_FORMAT_LINE}{tool_format}\n\n"
        "You are working in a Python repository at /work. Resolve the issue below; the repository's "
        f"public tests may help.\n\nIssue:\n{task.issue.strip()}\n\nFiles:\n{listed}\n\n"
        f"Tools:\n{usage(tool_format)}"
    )


def workspace_bytes(task: RepoTask) -> int:
    """Bytes of the repository the task carries inline."""
    return sum(len(p.encode()) + len(t.encode()) for p, t in task.files.items())


def _eval_bucket(task: RepoTask) -> bool:
    return in_eval_slice(task.content_hash())


@dataclass
class RepoDomain:
    """Task source of one `repo` config domain."""

    ctx: DomainContext
    skipped: Counter = field(default_factory=Counter, init=False)
    demonstrable: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        p, name = self.ctx.dc.params, self.ctx.name
        self.cache_dir = p.get("cache_dir") or None
        self.eval_n = int(p.get("eval_n", 16))
        self.max_workspace_bytes = int(p.get("max_workspace_bytes", 512 * 1024))
        self.max_workspace_ref_bytes = int(p.get("max_workspace_ref_bytes", 64 * 1024 * 1024))
        self._packed: dict[str, tuple[BlobRef, bytes]] = {}  # task_id -> its workspace payload (built once)
        self.verifier_params = dict(p.get("verifier") or {})
        chosen = p.get("tasks", "all")
        if chosen in ("all", None, []):
            tasks = list_tasks(self.cache_dir)
            if not tasks:
                raise ValueError(f"sampler.domains.{name}: the repo task cache is empty; build it: {BUILD_HINT}")
        else:
            tasks = [load_task(str(t), self.cache_dir) for t in chosen]
        by_id = {t.task_id: t for t in tasks}
        if "eval_tasks" in p:
            extra = [str(i) for i in p["eval_tasks"] if str(i) not in by_id]
            for t in (load_task(i, self.cache_dir) for i in extra):
                by_id[t.task_id] = t
            eval_ids = {str(i) for i in p["eval_tasks"]}
        else:
            eval_ids = {t.task_id for t in tasks if _eval_bucket(t)} if len(tasks) >= 2 else set()
        self.eval = sorted((by_id[i] for i in eval_ids), key=lambda t: t.content_hash())
        self.train = [t for t in tasks if t.task_id not in eval_ids]
        if not self.train:
            raise ValueError(f"sampler.domains.{name}: no training task left (every task is an eval task)")
        random.Random(f"repo-{self.ctx.cfg.run.seed}-{name}").shuffle(self.train)

    def _workspace(self, task: RepoTask) -> tuple[dict, dict[str, bytes]]:
        """(the Task's workspace fields, the payloads they name): inline, else by reference."""
        size = workspace_bytes(task)
        if size <= self.max_workspace_bytes:
            return {"workspace": dict(task.files)}, {}
        if size > self.max_workspace_ref_bytes:
            self.skipped["workspace_too_large"] += 1
            raise TaskSkipped("workspace_too_large", f"{task.task_id}: {size} bytes > max_workspace_ref_bytes")
        if task.task_id not in self._packed:
            blob = pack_files(task.files)
            self._packed[task.task_id] = (payload_ref(Registry(self.ctx.run_id), blob), blob)
        ref, blob = self._packed[task.task_id]
        return {"workspace_ref": ref}, {ref.sha256: blob}

    def _drawn(self, task: RepoTask, task_id: str, level: int) -> Drawn:
        workspace, payloads = self._workspace(task)
        digest = task.content_hash()
        fmt = self.ctx.dc.tool_format
        out = finish_task(
            self.ctx,
            task_id=task_id,
            difficulty=level,
            verifier="repo",
            prompt=[ChatMessage(role="user", content=render_prompt(task, fmt))],
            tools=list(REPO_TOOLS),
            **workspace,
            verifier_params={**self.verifier_params, "repo_task": task.task_id, "content_hash": digest},
            hidden_ref=hidden_ref_for(self.ctx.name, f"{task.task_id}-{digest[:16]}"),
        )
        return Drawn(out, {"task": asdict(task)}, payloads)

    def make_task(self, rng: random.Random, level: int, index: int) -> Drawn:
        task = self.train[index % len(self.train)]
        return self._drawn(task, f"{self.ctx.name}-{task.task_id}-{index}", level)

    def eval_set(self, n: int, seed: int, level: int | None = None) -> EvalSet:
        """The fixed held-out tasks as a pipeline-only eval set (see the module guarantees)."""
        level = self.ctx.dc.initial_level if level is None else level
        return drawn_set(self.ctx.name, seed, level, self.eval_problems(n, seed, level))

    def eval_problems(self, n: int, seed: int, level: int | None = None) -> list[Drawn]:
        """The fixed held-out tasks (see the module guarantees); `seed` does not change them."""
        level = self.ctx.dc.initial_level if level is None else level
        out = []
        for task in self.eval[: min(n, self.eval_n)]:
            try:
                out.append(self._drawn(task, f"{self.ctx.name}-eval-{task.task_id}", level))
            except TaskSkipped:
                continue
        return out
