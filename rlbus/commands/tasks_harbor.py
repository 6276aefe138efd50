"""`rlbus tasks list|show|check|scripts --domain D` for Harbor domains, and `rlbus tasks export harbor`.

    rlbus tasks list   --domain tb --config examples/harbor.toml [--json]
    rlbus tasks show   --domain tb --config examples/harbor.toml --task-id NAME [--json]
    rlbus tasks check  --domain tb --config examples/harbor.toml [--task-id NAME ...] [--force] [--json]
    rlbus tasks scripts --domain tb --config examples/harbor.toml --out DIR [--empty]
    rlbus tasks export harbor --domain repo --out DIR [--task-id ID ...]

Guarantees:
- Tasks are read by the domain's own code (`producers.domains.harbor.load_tasks`), so a list
  shows what a run would load; `disabled` gives the reason a run would leave one out.
- `check` runs the oracle and empty checks (`sandbox_workers.harbor_check.check_task`),
  cached by content (`--force` runs them again), prints one row per task (`--json`: one object
  per line) and exits 1 when any task failed (listed with the reason), 3 when docker is not
  reachable; the failures are what `rlbus up` disables.
- `scripts` writes one scripted-engine script per runnable task: gold (the `solution/` files
  written under /solution, `bash /solution/solve.sh`, `submit`) or `--empty` (`submit` only).
- `export harbor` writes each repo task as a Harbor directory (`rlbus.commands.harbor_export`).
- `show` never prints the tests or the solution, only their file names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def harbor_domain(args: argparse.Namespace):
    """(config, domain context, tasks, skipped) of `--domain` in `--config`, or SystemExit(2)."""
    from producers.domains import DomainContext, kind_of
    from producers.domains.harbor import load_tasks
    from schemas.config import load_config

    cfg = load_config(getattr(args, "config", None))
    dc = cfg.sampler.domains.get(args.domain)
    if dc is None or kind_of(args.domain, dc) != "harbor":
        print(
            f"rlbus tasks: {args.domain!r} is not a harbor domain of {args.config or 'the default config'}; "
            'pass --config with a kind = "harbor" domain (e.g. --config examples/harbor.toml --domain tb)',
            file=sys.stderr,
        )
        raise SystemExit(2)
    ctx = DomainContext(run_id="cli", name=args.domain, cfg=cfg, dc=dc)
    try:
        tasks, skipped = load_tasks(ctx)
    except ValueError as exc:
        print(f"rlbus tasks: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg, ctx, tasks, skipped


def is_harbor_domain(args: argparse.Namespace) -> bool:
    """Whether `--domain` names a harbor domain of `--config` (False without a config)."""
    if not getattr(args, "config", None):
        return False
    from producers.domains import kind_of
    from schemas.config import load_config

    dc = load_config(args.config).sampler.domains.get(args.domain)
    return dc is not None and kind_of(args.domain, dc) == "harbor"


def _row(t, disabled: dict[str, str]) -> dict:
    return {
        "name": t.name,
        "task_id": t.task_id,
        "version": t.version,
        "image": t.docker_image or "environment/Dockerfile",
        "internet": t.allow_internet,
        "disabled": disabled.get(t.name, ""),
        "metadata": t.metadata,
    }


def list_harbor(args: argparse.Namespace) -> int:
    from producers.domains.harbor import disabled_reasons

    cfg, _, tasks, skipped = harbor_domain(args)
    disabled = disabled_reasons(tasks, cfg.harbor)
    if args.json:
        for t in tasks:
            print(json.dumps(_row(t, disabled), ensure_ascii=False))
        return 0
    width = max([len(t.name) for t in tasks] + [4])
    print(f"{'NAME':<{width}}  {'TASK_ID':<32} {'IMAGE':<24} DISABLED")
    for t in tasks:
        r = _row(t, disabled)
        print(f"{t.name:<{width}}  {t.task_id:<32} {r['image'][:24]:<24} {r['disabled'][:70]}")
    print(f"{len(tasks)} tasks, {len(disabled)} disabled, {sum(skipped.values())} skipped as invalid")
    return 0


def find_task(tasks: list, task_id: str, command: str):
    """The task named `task_id` (directory name or task id), or None after saying which exist."""
    for t in tasks:
        if task_id in (t.name, t.task_id):
            return t
    print(f"{command}: no task {task_id!r}; tasks: {[t.name for t in tasks]}", file=sys.stderr)
    return None


def show_harbor(args: argparse.Namespace) -> int:
    from producers.domains.harbor import disabled_reasons

    cfg, _, tasks, _ = harbor_domain(args)
    t = find_task(tasks, args.task_id, "rlbus tasks show")
    if t is None:
        return 2
    row = _row(t, disabled_reasons([t], cfg.harbor)) | {
        "instruction": t.instruction,
        "tests": sorted(t.tests),
        "solution": sorted(t.solution),
        "limits": {"cpus": t.cpus, "memory_mb": t.memory_mb, "storage_mb": t.storage_mb},
        "timeouts": {"agent_s": t.agent_timeout_s, "verifier_s": t.verifier_timeout_s, "build_s": t.build_timeout_s},
        "content_hash": t.content_hash,
    }
    if args.json:
        print(json.dumps(row, ensure_ascii=False))
        return 0
    for key, value in row.items():
        if key != "instruction":
            print(f"{key}: {value}")
    print("--- instruction ---")
    print(t.instruction.rstrip("\n"))
    return 0


def check_harbor(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from sandbox_workers.harbor_box import HarborEngineError
    from sandbox_workers.harbor_check import cached_check, check_task

    cfg, _, tasks, _ = harbor_domain(args)
    chosen = [t for t in tasks if not args.task_id or t.name in args.task_id or t.task_id in args.task_id]
    results = []
    try:
        with Progress(transient=True, console=_stderr_console()) as bar:
            job = bar.add_task("checking tasks", total=len(chosen))
            for t in chosen:
                bar.update(job, description=f"checking {t.name}")
                cached = None if args.force else cached_check(t, cfg.harbor)
                results.append(cached or check_task(t, cfg.harbor))
                bar.advance(job)
    except HarborEngineError as exc:
        print(f"rlbus tasks check: docker is not usable: {exc}", file=sys.stderr)
        return 3
    for r in results:
        if args.json:
            print(json.dumps(r.__dict__, ensure_ascii=False))
    if not args.json:
        print_check_table(results)
    return 1 if any(not r.ok for r in results) else 0


def print_check_table(results) -> None:
    width = max([len(r.name) for r in results] + [4])
    print(f"{'TASK':<{width}}  {'OK':<5} {'ORACLE':>7} {'EMPTY':>6}  {'SECONDS':>7}  REASON")
    for r in results:
        o = "-" if r.oracle is None else f"{r.oracle:g}"
        e = "-" if r.empty is None else f"{r.empty:g}"
        print(f"{r.name:<{width}}  {'yes' if r.ok else 'NO':<5} {o:>7} {e:>6}  {r.seconds:>7.1f}  {r.reason[:90]}")
    bad = [r for r in results if not r.ok]
    print(f"{len(results)} tasks checked, {len(bad)} failed" + (f": {', '.join(r.name for r in bad)}" if bad else ""))


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def scripts_harbor(args: argparse.Namespace) -> int:
    from producers.domains.harbor import disabled_reasons
    from rollout_workers.engines.scripted_engine import EMPTY_STEPS, write_script

    cfg, _, tasks, _ = harbor_domain(args)
    disabled = disabled_reasons(tasks, cfg.harbor)
    n = 0
    for t in tasks:
        if t.name in disabled:
            continue
        steps = list(EMPTY_STEPS) if args.empty else gold_steps(t.solution)
        write_script(Path(args.out), t.task_id, steps)
        n += 1
    print(
        f"wrote {n} {'empty' if args.empty else 'gold'} scripts to {args.out} ({len(disabled)} disabled tasks left out)"
    )
    return 0


def gold_steps(solution: dict[str, bytes]) -> list[dict]:
    """The scripted oracle: write the solution files under /solution, run solve.sh, submit."""
    steps = [
        {"tool": "write_file", "args": {"path": f"/solution/{rel}", "content": data.decode("utf-8", "replace")}}
        for rel, data in sorted(solution.items())
    ]
    steps.append({"tool": "bash", "args": {"command": "bash /solution/solve.sh"}})
    return steps + [{"tool": "submit", "args": {}}]


def export_harbor(args: argparse.Namespace) -> int:
    from producers import repo_cache
    from rlbus.commands.harbor_export import export_repo_task

    if args.kind != "harbor" or args.domain != "repo":
        print("rlbus tasks export: only `export harbor --domain repo` is supported", file=sys.stderr)
        return 2
    tasks = (
        [repo_cache.load_task(i, args.cache_dir) for i in args.task_id]
        if args.task_id
        else repo_cache.list_tasks(args.cache_dir)
    )
    if not tasks:
        print(f"rlbus tasks export: the repo task cache is empty; build it: {repo_cache.BUILD_HINT}", file=sys.stderr)
        return 1
    out = Path(args.out)
    for t in tasks:
        export_repo_task(t, out)
    print(f"wrote {len(tasks)} Harbor task directories to {out}")
    return 0


def verify_harbor_script(args: argparse.Namespace) -> int:
    """`rlbus verify --domain TB --config FILE --task-id NAME --script F`: one JSON line (see verify.py)."""
    from sandbox_workers.harbor_box import HarborEngineError
    from sandbox_workers.harbor_check import box_spec, run_script, verify_job
    from sandbox_workers.harbor_images import TaskBuildFailed, ensure_task_image
    from sandbox_workers.harbor_verify import VerifyRefused

    cfg, _, tasks, _ = harbor_domain(args)
    t = find_task(tasks, args.task_id, f"rlbus verify --domain {args.domain}")
    if t is None:
        return 2
    try:
        script = sys.stdin.read() if args.script == "-" else Path(args.script).read_text()
    except OSError as exc:
        print(f"rlbus verify: cannot read --script: {exc}", file=sys.stderr)
        return 2
    if t.refusal:
        print(f"rlbus verify: task {t.name} cannot run: {t.refusal}", file=sys.stderr)
        return 2
    try:
        job = verify_job(t, cfg.harbor, box_spec(t, cfg.harbor, ensure_task_image(t, dict(cfg.harbor.image_map))))
        run = run_script(job, script, t.agent_timeout_s, run_id="cli")
    except VerifyRefused as exc:
        print(f"rlbus verify: task {t.name} cannot be verified as written: {exc}", file=sys.stderr)
        return 2
    except (HarborEngineError, TaskBuildFailed) as exc:
        print(f"rlbus verify: docker failure: {exc}", file=sys.stderr)
        return 3
    out = {"reward": run.reward, "components": run.components, "status": run.status, "details": run.details}
    print(json.dumps(out | {"backend": "docker"}))
    return 0


def add_subcommands(tsub) -> None:
    """Add `check` and `export` to `rlbus tasks` (list/show/scripts dispatch here for harbor domains)."""
    c = tsub.add_parser(
        "check",
        help="run each Harbor task's oracle and an empty episode (cached by content)",
        description="Run solution/solve.sh and an empty episode on every task of a harbor domain: the oracle "
        "must reach the top score (1.0), the empty episode must score below it. Failing tasks are listed "
        "and disabled at `rlbus up`.",
    )
    c.add_argument("--domain", required=True, help='a kind = "harbor" domain of --config')
    c.add_argument("--config", required=True, help="run config TOML naming the domain (e.g. examples/harbor.toml)")
    c.add_argument("--task-id", action="append", default=[], help="only this task (name or id; repeatable)")
    c.add_argument("--force", action="store_true", help="check again even when a cached result exists")
    c.add_argument("--json", action="store_true", help="one JSON object per task")
    c.set_defaults(func=check_harbor)
    e = tsub.add_parser(
        "export",
        help="write rlbus's repository tasks as Harbor task directories",
        description="Write each cached repo task as a Harbor task directory (instruction.md, task.toml, "
        "environment/ with the repository, tests/ with the hidden tests, solution/ with the gold patch).",
    )
    e.add_argument("kind", choices=["harbor"], help="the format to write: harbor")
    e.add_argument("--domain", required=True, help="repo")
    e.add_argument("--out", required=True, help="directory to write the task directories into")
    e.add_argument("--task-id", action="append", default=[], help="only this repo task (repeatable)")
    e.add_argument("--cache-dir", help="the repo task cache (default producers/repo_tasks/ or $RLBUS_REPO_TASKS)")
    e.set_defaults(func=export_harbor)
