"""What both sides of a harness-owned episode (`kind = "agent"`) agree on: the public task file
the harness reads, and the record the rollout worker leaves for the verifier.

Guarantees:
- `public_task(task)` is everything a harness is given about a task (`RLBUS_TASK_FILE`): id,
  domain, level, the chat messages, the last user message as `instruction`, the work dir, the
  repository's file list, the token budget of one reply. Never `hidden_ref`, verifier params,
  reward weights or anything of the hidden bucket.
- `artifacts[AGENT_ARTIFACT]` (JSON, written by the rollout worker only) says how the harness
  ended: `status` (`ok`, `timeout`, `harness_error`), `exit_code`, `stderr_tail`, `seconds`,
  `calls`. A `harness_error` is scored 0 with that status by the verifier worker; the others
  are scored by the wrapped verifier.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.episode import Task, Trajectory

WORK_DIR = "/work"
"""Where the harness runs (the sandbox's work dir; a repository task's files are there)."""
AGENT_ARTIFACT = "agent"
HARNESS_ERROR = "harness_error"


def public_task(task: Task) -> dict[str, Any]:
    """The task as the harness sees it (see the module guarantees)."""
    messages = [{"role": m.role, "content": m.content} for m in task.prompt]
    users = [m["content"] for m in messages if m["role"] == "user"]
    return {
        "task_id": task.task_id,
        "domain": task.domain,
        "difficulty": task.difficulty,
        "messages": messages,
        "instruction": users[-1] if users else "",
        "workdir": WORK_DIR,
        "files": sorted(task.workspace),
        "max_tokens": task.max_tokens,
    }


def agent_record(traj: Trajectory) -> dict[str, Any] | None:
    """The harness record of a trajectory (None: not a harness-owned episode, or unreadable)."""
    raw = traj.artifacts.get(AGENT_ARTIFACT)
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None
