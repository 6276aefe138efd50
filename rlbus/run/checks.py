"""Start-up checks of `rlbus up`: everything that must hold before a run folder, a server or
SFT exists.

Guarantees:
- `preflight(cfg, console)` runs every check in order (model folder, tracking packages,
  rollout engine, learner ranks, domain sources, sandbox isolation, tokenizer coverage)
  and returns the sandbox isolation this run gets ("bwrap", "docker" or "degraded"), or
  None after printing each problem and what to change. It writes nothing (but Harbor
  domains' images and check cache, `rlbus.run.harbor_start`), starts no process (beyond the
  probe sandbox and Harbor checks' containers) and touches no NATS server.
- Sandboxes fail closed: where the configured backend cannot isolate (no usable
  bubblewrap) and `sandbox.allow_degraded` is false, the check prints the reason and the
  fix and returns None. With degraded mode allowed, `DEGRADED_WARNING` is printed in red.
- `kind = "agent"` domains need bubblewrap for their harnesses, or `agent.allow_host` (said in
  red), and existing `agent.python_path` directories.
- A domain that is unavailable here (`DomainUnavailable`) is not a problem: the sampler
  leaves it out and reports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from rlbus.run.harbor_start import check_harbor
from schemas.config import RunConfig

DEGRADED_WARNING = (
    "[bold red]sandbox isolation: DEGRADED: tool calls and tests run WITHOUT network or "
    "filesystem isolation (rlimits only), because sandbox.allow_degraded=true. "
    "Install bubblewrap (apt-get install -y bubblewrap) to isolate them.[/]"
)


def check_engine(cfg: RunConfig, console: Console) -> bool:
    """Whether the configured rollout engine can start in this Python (before SFT, before NATS)."""
    from rollout_workers.engines import VLLMMissing, require_engine

    try:
        require_engine(cfg.rollout.engine)
    except VLLMMissing as exc:
        console.print(f"[bold red]rlbus up: {exc}[/]")
        return False
    return True


def check_learner(cfg: RunConfig, console: Console) -> bool:
    """Whether the learner's ranks fit this machine (`learner.world_size`, `learner.backend`;
    before SFT, before NATS); False after printing what to set."""
    from learner.distributed import world_problem

    problem = world_problem(cfg.learner)
    if cfg.learner.world_size > 1 and cfg.learner.launch == "external":
        problem = (
            "learner.launch = 'external' means every learner rank is started from outside (pods of `rlbus k8s "
            "render`, srun tasks of `rlbus slurm render`), but `rlbus up` starts one learner; set "
            "learner.launch = 'auto' (rank 0 starts the others on this machine)"
        )
    if problem:
        console.print(f"rlbus up: {problem}", style="bold red", markup=False, highlight=False, soft_wrap=True)
    return problem is None


def check_tokenizer(cfg: RunConfig, console: Console) -> bool:
    """Whether the run's tokenizer encodes every character its domains produce (before SFT,
    before NATS); False after printing the domains and characters it cannot encode."""
    from rlbus.model.tokenizer_check import run_tokenizer, template_problems, tokenizer_problems

    tok = run_tokenizer(cfg)
    problems = tokenizer_problems(cfg, tok)
    for problem in problems:
        console.print(
            f"rlbus up: {problem}; use a tokenizer that covers them (model.tokenizer = 'bpe' encodes any text)",
            style="bold red",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    missing = template_problems(cfg, tok)
    for problem in missing:
        console.print(f"rlbus up: {problem}", style="bold red", markup=False, highlight=False, soft_wrap=True)
    return not problems and not missing


def check_sandbox(cfg: RunConfig, console: Console) -> str | None:
    """The isolation this run's sandboxes get (probed with one real sandbox), or None, after
    printing the reason and the fix, when they cannot isolate and degraded mode is not allowed."""
    from sandbox_workers.base import SandboxRefused
    from sandbox_workers.factory import probe_isolation

    sc = cfg.sandbox
    try:  # remote: tool calls go to the sandbox service; the scheduler's evaluation runs local process sandboxes
        isolation = probe_isolation("process" if sc.remote else sc.backend, sc.allow_degraded, image=sc.image)
    except SandboxRefused as exc:
        console.print(f"[bold red]rlbus up: {exc}[/]", highlight=False)
        return None
    if isolation == "degraded":
        console.print(DEGRADED_WARNING, highlight=False)
    return isolation


def check_tracking(cfg: RunConfig, console: Console) -> bool:
    """False, after printing which extra to install, when a configured tracking backend's
    package is missing (the tracker would only crash-loop); True otherwise."""
    from rlbus.tracking.backends import TrackingUnavailable, check_installed

    try:
        check_installed(cfg.tracking.backends)
    except TrackingUnavailable as exc:
        console.print(f"rlbus up: {exc}", style="bold red", markup=False, highlight=False, soft_wrap=True)
        return False
    return True


def check_model(cfg: RunConfig, console: Console) -> bool:
    """Whether `model.path` (when set) is a local HF model folder; False after saying what to do."""
    if not cfg.model.path or (Path(cfg.model.path) / "config.json").is_file():
        return True
    console.print(
        f"rlbus up: model.path {cfg.model.path!r} is not a local Hugging Face model folder (no config.json "
        "there); point it at a checkpoint folder, build a small one with `rlbus init-model DIR`, or leave "
        "model.path empty to build the tiny model",
        style="bold red",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return False


def check_domains(cfg: RunConfig, console: Console) -> bool:
    """Whether every configured domain's task source builds (its kind, `params` and data;
    before SFT, before NATS): False after printing each domain's problem and the table to fix.
    A domain that is unavailable here (`DomainUnavailable`) is not a problem: the sampler
    leaves it out and reports it."""
    from producers.domains import DomainUnavailable, make_source

    ok = True
    for name in cfg.sampler.domains:
        try:
            make_source("check", name, cfg)
        except DomainUnavailable:
            continue
        except (ValueError, OSError) as exc:
            console.print(
                f"rlbus up: {exc}; fix [sampler.domains.{name}] in the config (or the --set that "
                "changed it), then run it again",
                style="bold red",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            ok = False
    return ok


WORKSPACE_KINDS = frozenset({"repo", "findoc"})
"""Kinds whose tasks may carry a workspace: a harness wrapping them runs in `sandbox.repo_image`
(`rollout_workers.agent_harness`); every other harness in `sandbox.image`."""


def agent_images(cfg: RunConfig) -> list[str]:
    """The docker images the run's agent harnesses run in (sorted, each once)."""
    agents = [dc for dc in cfg.sampler.domains.values() if dc.kind == "agent"]
    images = {cfg.sandbox.repo_image if dc.wraps in WORKSPACE_KINDS else cfg.sandbox.image for dc in agents}
    return sorted(images)


def check_agent(cfg: RunConfig, console: Console) -> bool:
    """`kind = "agent"` domains: every `agent.python_path` directory must exist; harnesses in
    docker (`agent.sandbox`) need an engine holding the images they use, whose python3 is this
    one's major.minor when `agent.python_path` binds packages; in bwrap they need
    bubblewrap, or the operator's `agent.allow_host` (then said in red)."""
    if not any(dc.kind == "agent" for dc in cfg.sampler.domains.values()):
        return True
    from rollout_workers.agent_harness import harness_sandbox
    from sandbox_workers.base import SandboxRefused
    from sandbox_workers.factory import probe_isolation

    missing = [p for p in cfg.agent.python_path if p != "purelib" and not Path(p).is_dir()]
    if missing:
        console.print(f"[bold red]rlbus up: agent.python_path directories {missing} do not exist[/]", highlight=False)
        return False
    if harness_sandbox(cfg) == "docker":
        from sandbox_workers.docker_harness import image_python

        here = "%d.%d" % sys.version_info[:2]
        try:
            for image in agent_images(cfg):
                probe_isolation("docker", image=image)
                there = image_python(image) if cfg.agent.python_path else here
                if there != here:
                    raise RuntimeError(
                        f"image {image!r} has python3 {there}, but agent.python_path binds packages of this "
                        f"Python {here}: build it from python:{here}-slim, or set agent.python_path = []"
                    )
        except Exception as exc:  # noqa: BLE001 - no engine, no image: refuse and say why
            console.print(
                f"[bold red]rlbus up: agent harnesses run in docker (agent.sandbox): {exc}[/]", highlight=False
            )
            return False
        return True
    try:
        probe_isolation("process", False)
    except SandboxRefused as exc:
        if not cfg.agent.allow_host:
            console.print(
                f"[bold red]rlbus up: agent harnesses need bubblewrap ({exc}); or set agent.allow_host = true "
                "to run them as plain host processes[/]",
                highlight=False,
            )
            return False
        console.print(
            "[bold red]agent harnesses: PLAIN HOST PROCESSES (agent.allow_host = true; no bubblewrap): they see "
            "this host's network and files, a local NATS bus included[/]",
            highlight=False,
        )
    return True


def preflight(cfg: RunConfig, console: Console) -> str | None:
    """Every check before anything starts; the sandbox isolation, or None after printing why not."""
    if not (
        check_model(cfg, console)
        and check_tracking(cfg, console)
        and check_engine(cfg, console)
        and check_learner(cfg, console)
        and check_domains(cfg, console)
        and check_harbor(cfg, console)
        and check_agent(cfg, console)
    ):
        return None
    isolation = check_sandbox(cfg, console)
    if isolation is None or not check_tokenizer(cfg, console):
        return None
    return isolation
