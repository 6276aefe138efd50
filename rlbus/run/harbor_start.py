"""`rlbus up`'s start for Harbor domains: images built, oracle / empty checks run, failures disabled.

Guarantees:
- For each `kind = "harbor"` domain: the task directories are read (an invalid one stops the
  run naming the file, unless `harbor.skip_invalid`); with `harbor.check_at_start`, every task
  without a cached check is checked (`sandbox_workers.harbor_check.check_task`: its image is
  built, its oracle and an empty episode run), with a progress bar; the console then prints
  the domain's task count and each disabled task with its reason. The sampler leaves those
  tasks out (`producers.domains.harbor`): the run goes on without them.
- No docker engine (or another infrastructure failure) stops the run before anything
  starts, saying what to do; it never disables a task.
- `reap_harbor_run` (the launcher's shutdown) removes the run's episode containers still
  waiting for a verifier (a resumed run dead-letters those trajectories: "container gone").
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import Progress

from schemas.config import RunConfig


def harbor_domains(cfg: RunConfig) -> list[str]:
    from producers.domains import kind_of

    return [
        n
        for n, dc in cfg.sampler.domains.items()
        if dc.kind == "harbor" or (not dc.kind and kind_of(n, dc) == "harbor")
    ]


def check_harbor(cfg: RunConfig, console: Console) -> bool:
    """Build and check the Harbor domains' tasks (see the module guarantees); False after printing why not."""
    from producers.domains import DomainContext
    from producers.domains.harbor import disabled_reasons, load_tasks
    from sandbox_workers.harbor_box import HarborEngineError
    from sandbox_workers.harbor_check import cached_check, check_task

    for name in harbor_domains(cfg):
        ctx = DomainContext(run_id="check", name=name, cfg=cfg, dc=cfg.sampler.domains[name])
        try:
            tasks, skipped = load_tasks(ctx)
            todo = [t for t in tasks if not t.refusal and cached_check(t, cfg.harbor) is None]
            if cfg.harbor.check_at_start and todo:
                with Progress(console=console, transient=True) as bar:
                    job = bar.add_task(f"harbor {name}: building and checking tasks", total=len(todo))
                    for t in todo:
                        bar.update(job, description=f"harbor {name}: checking {t.name}")
                        check_task(t, cfg.harbor)
                        bar.advance(job)
        except ValueError as exc:
            console.print(f"rlbus up: {exc}", style="bold red", markup=False, highlight=False, soft_wrap=True)
            return False
        except HarborEngineError as exc:
            console.print(
                f"rlbus up: harbor domain {name} needs a docker engine: {exc}; start one (or remove the domain)",
                style="bold red",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return False
        disabled = disabled_reasons(tasks, cfg.harbor)
        line = f"harbor {name}: {len(tasks)} tasks, {len(tasks) - len(disabled)} runnable, {len(disabled)} disabled"
        console.print(line + (f", {sum(skipped.values())} invalid skipped" if skipped else ""), highlight=False)
        for task_name, why in sorted(disabled.items()):
            console.print(
                f"  disabled {task_name}: {why.splitlines()[0][:160]}", style="yellow", highlight=False, markup=False
            )
    return True


def reap_harbor_run(cfg: RunConfig, run_id: str, console: Console) -> int:
    """Remove the run's Harbor containers (none when the run has no harbor domain); how many."""
    if not harbor_domains(cfg):
        return 0
    try:
        from sandbox_workers.harbor_box import RUN_LABEL, client, remove_container

        ids = [c["Id"] for c in client().api.containers(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})]
    except Exception as exc:  # noqa: BLE001 - the engine is gone: its containers are too
        console.print(f"harbor: could not list the run's containers: {exc}", style="yellow", markup=False)
        return 0
    for cid in ids:
        remove_container(cid)
    if ids:
        console.print(f"harbor: removed {len(ids)} episode container(s) no verifier took", highlight=False)
    return len(ids)
