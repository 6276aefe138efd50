"""`[agent]`: the operator's settings for harness-owned episodes (`kind = "agent"` domains)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Section


class AgentSection(Section):
    """How `kind = "agent"` harnesses run (every agent domain shares it)."""

    PLACE = "agent"
    sandbox: Literal["auto", "bwrap", "docker"] = "auto"
    """Where each harness runs. `docker`: a per-episode container of `sandbox.image`
    (`sandbox.repo_image` for repository tasks) with the docker backend's isolation (no
    network, read-only root, memory/pids limits, every capability dropped, uid 65534), the
    episode's files, the endpoint's socket and `python_path` bound read-only; an engine that
    does not answer is an infrastructure error (retried), never a host process. `bwrap`: the
    bubblewrap process sandbox (`allow_host` below). `auto`: docker when `sandbox.backend`
    resolves to docker (`auto` backends: once per process), else bwrap."""
    allow_host: bool = False
    """Run harnesses as plain host processes (rlimits and a dedicated uid only: they see this
    host's network and files) where the bubblewrap sandbox is unavailable. Off: such an
    episode is refused (retried, then dead-lettered). On: the console says so in red."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Wall time of one harness run; past it every process of the harness is killed and the
    episode ends with `timeout` (verified as it stands)."""
    memory_mb: int = Field(default=4096, ge=64)
    """Address-space limit of the harness's processes (a Python harness with its libraries
    needs far more than a tool call's `sandbox.memory_mb`)."""
    pids: int = Field(default=256, ge=8)
    """Most processes and threads of one harness."""
    python_path: list[str] = Field(default_factory=lambda: ["purelib"])
    """Host directories bound read-only into the sandbox and put on the harness's PYTHONPATH
    (the sandbox's `python3` is the system one). `purelib`: the rollout worker's own
    site-packages (where the `agents` extra put `openai` and `mini-swe-agent`); [] for none.
    In docker the image's `python3` must have this interpreter's major.minor version (both
    3.11 by default; checked once per image and process, else an error naming both)."""
    env: dict[str, str] = Field(
        default_factory=lambda: {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_CONFIGURED": "true",
        }
    )
    """Extra variables of every harness (the defaults keep mini-swe-agent and its litellm offline
    and non-interactive);
    `OPENAI_*`, `RLBUS_TASK_FILE`, `PYTHONPATH` and `HOME` are set by rlbus and win."""
    stderr_chars: int = Field(default=4000, ge=200, le=65536)
    """Tail of the harness's stderr kept with a `harness_error`."""
