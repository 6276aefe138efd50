"""Config sections of the sandboxes and the verifier workers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Section


class SandboxSection(Section):
    """Sandboxes for tool calls (rollout) and tests (verifiers), and the sandbox service."""

    backend: Literal["process", "docker", "auto"] = "process"
    """`process`: bubblewrap + rlimits; `docker`: containers from `image`; `auto`: docker when an engine answers."""
    allow_degraded: bool = False
    """Let the `process` backend run commands WITHOUT isolation where bubblewrap is missing or cannot create
    namespaces (rlimits only: the command reaches the host's network and files). Off: such a sandbox refuses to
    start (an infrastructure error, never a reward of 0) and `rlbus up` stops before SFT, naming the fix
    (`apt-get install bubblewrap`, or `backend = "docker"`). `--allow-degraded-sandbox` sets it."""
    image: str = "rlbus-sandbox:latest"
    """Docker image (build it with `rlbus sandbox build-image`)."""
    repo_image: str = "rlbus-repo-sandbox:latest"
    """Docker image of repository-task episodes (tasks with a `workspace`: python + pytest + the
    offline wheelhouse; `rlbus sandbox build-image --repo`)."""
    remote: bool = False
    """Rollout workers use the sandbox service over NATS (`rlbus worker sandbox`) instead of a local backend."""
    pool: str = "default"
    """Sandbox service pool name (subjects `sandbox.<pool>.*`)."""
    memory_mb: int = Field(default=256, ge=16)
    """Memory limit per sandbox."""
    pids: int = Field(default=64, ge=4)
    """Process limit per sandbox."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Default wall-clock limit per command."""
    max_exec_timeout_s: float = Field(default=600.0, gt=0)
    """Service: the longest wall-clock limit an exec may ask for; a larger `timeout` is clamped to it."""
    warm_pool: int = Field(default=2, ge=0)
    """Docker: containers kept started and clean, ready to hand out."""
    session_ttl_s: float = Field(default=120.0, gt=0)
    """Service: a session idle this long (its client died) is closed and reaped."""
    max_sessions: int = Field(default=16, ge=1)
    """Service: most sessions one sandbox worker holds at once."""


RM_INPUT_FORM = "text+response+eos/1"
"""How a reward model reads a sample: question + response as one text with the tokenizer's EOS
appended (TRL RewardTrainer's form). `rlbus train-rm` writes it into the export's config.json as
`rlbus_rm_input`; the `model` verifier refuses an rlbus export of another form (or none)."""


class RmServingSection(Section):
    """How a verifier worker serves reward models (the `model` verifier; `verifier_workers.rm_serving`)."""

    PLACE = "verifier.rm"
    batch_size: int = Field(default=32, ge=1)
    """Trajectories scored in one forward; 1 scores each alone, in the worker's threads."""
    batch_timeout_s: float = Field(default=0.01, ge=0)
    """How long the first trajectory of a batch waits for more before the batch runs anyway."""
    max_padding: float = Field(default=1.0, ge=0)
    """Padded share of positions one forward may have: a batch is sorted by length and cut where a forward
    would pad more (0.25: at most a quarter padding). 1 (the default) runs one forward per batch and model."""
    normalize: Literal["none", "running", "group"] = "none"
    """`score` becomes the logit normalised by the running mean/std of every logit this worker scored
    (`running`, kept in the run folder and restored on restart) or by its group's mean/std (`group`: the
    group's members are held until all are in, see `group_timeout_s`); `none` keeps sigmoid(logit)."""
    group_timeout_s: float = Field(default=10.0, gt=0)
    """`normalize = "group"` and tasks with `verifier_params.mode = "pairwise"` hold a group's members
    until all `group_size` are in; past this many seconds from its first member, the members present
    are scored among themselves (a lone member: z-score 0, win rate 0.5) and counted (`rm_partial_groups`)."""


class VerifierSection(Section):
    """Verifier workers."""

    batch: int = Field(default=128, ge=1)
    """Trajectories fetched per round."""
    ack_wait_s: float = 30.0
    """Consumer ack_wait."""
    concurrency: int = Field(default=4, ge=0)
    """Verifications run at once per worker (threads; sandboxed verifiers are I/O bound); 0 runs them inline."""
    retry_base_s: float = Field(default=1.0, gt=0)
    """First retry delay of an infrastructure failure (doubles per delivery)."""
    retry_max_s: float = Field(default=60.0, gt=0)
    """Longest retry delay of an infrastructure failure."""
    max_timeout_s: float = Field(default=600.0, gt=0)
    """The operator's ceiling on a task's `verifier_params.timeout_s` (sandboxed verifiers: code, repo,
    files); a larger value is clamped to it before the verifier runs."""
    max_memory_mb: int = Field(default=4096, ge=16)
    """Ceiling on a task's `verifier_params.memory_mb` (clamped)."""
    max_cpus: float = Field(default=4.0, gt=0)
    """Ceiling on a task's `verifier_params.cpus` (clamped)."""
    max_pids: int = Field(default=512, ge=1)
    """Ceiling on a task's `verifier_params.pids` (clamped)."""
    answer_cpu_s: float = Field(default=5.0, gt=0)
    """Answer pool (`verifier_workers.answer_pool`): CPU seconds one answer's scoring may use (reasoning-gym
    `score_answer`, sympy / math-verify parsing, untrusted plugins); past it the answer scores 0, `answer_limit`."""
    answer_memory_mb: int = Field(default=1024, ge=64)
    """Answer pool: address space one answer's scoring may add to the pool's template process."""
    answer_wall_s: float = Field(default=10.0, gt=0)
    """Answer pool: wall seconds one answer's scoring may take before its job is killed."""
    rm: RmServingSection = Field(default_factory=RmServingSection)
    """Reward-model serving: batching and normalisation of the `model` verifier."""
