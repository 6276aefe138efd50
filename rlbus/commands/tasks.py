"""`rlbus tasks show|list|build`: inspect tasks exactly as the sampler would make them, and the
repository-task cache; reads no run, no NATS.

    rlbus tasks show --domain rg-<dataset> --seed S --index I [--level L] [--hidden] [--json] [--config FILE]
    rlbus tasks list --domain repo [--json] [--cache-dir DIR]
    rlbus tasks show --domain repo --task-id ID [--files] [--gold-patch] [--json] [--cache-dir DIR]
    rlbus tasks build repo --from-sdist NAME==VERSION ... [--out DIR] [--max-per-package N]
    rlbus tasks scripts --domain repo --out DIR [--empty] [--task-id ID ...] [--cache-dir DIR]
    rlbus tasks list|show|check|scripts --domain TB --config FILE   (harbor domains: rlbus.commands.tasks_harbor)
    rlbus tasks export harbor --domain repo --out DIR

Guarantees:
- The task comes from the sampler's own code path: the domain's source
  (`producers.domains.make_source`) and its `make_task(rng, level, index)`, with the config's
  `run.seed` set to `--seed`. For a `reasoning_gym` domain a task is a pure function of
  (seed, domain, level, index), so this is the very task a run with that seed publishes
  at that index (the sampler's `rng` is not used by that kind; kinds that draw from it
  show a task of the same kind and level, not necessarily the sampler's).
- Without `--level`: the domain's start level. Without `--config`: the defaults, plus the
  domain itself when it is an `rg-<dataset>` name; a domain that neither the config nor
  the family knows is an error (exit 2) naming the configured ones.
- `--json` prints ONE JSON object `{"task": {...}}` (the task's fields without the
  per-publish `msg_id` and `created_at`), with `--hidden` also `"hidden": {...}` (the
  verifier-only payload: `answer`, `metadata`, ...; packed values shown plainly).
  Without `--json`, a readable listing. The public task never holds the hidden payload.
- Whatever a third-party generator prints goes to stderr, never into stdout's output.
- `--domain repo` reads the repository-task cache (`producers.repo_cache`; default the
  committed `producers/repo_tasks/`, or `--cache-dir` / `$RLBUS_REPO_TASKS`): `list --json`
  prints one object per line `{"task_id", "source", "files": N}`; `show --json` prints ONE
  object `{"task_id", "issue", "files", "gold_patch"}` where `files` is the list of public
  paths, or `{path: content}` with `--files`, and `gold_patch` is the diff with
  `--gold-patch`, else null. Hidden tests are never printed. An empty cache, or an id it
  lacks, is reported on stderr with the command that builds the cache (exit 1 / 2).
- `scripts` writes one `<task_id>.json` script per task (default every cached task and the
  hand-written `fixture-*` ones) for the
  `scripted` engine (`rollout_workers.engines.scripted_engine`): the gold patch through `apply_patch`
  then `submit`, or with `--empty` only `submit`. The gold patch is public cache content
  (operators and tests); nothing hidden is written.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import random
import sys
from typing import Any

from rlbus.commands.tasks_harbor import add_subcommands as register_harbor
from rlbus.commands.tasks_harbor import is_harbor_domain, list_harbor, scripts_harbor, show_harbor

EPILOG = """examples:
  rlbus tasks show --domain rg-leg_counting --seed 0 --index 7
  rlbus tasks show --domain rg-basic_arithmetic --seed 3 --index 0 --level 2 --hidden --json
  rlbus tasks show --domain arith --config examples/demo.toml --index 0

  rlbus tasks show --domain repo --task-id fixture-clamp --gold-patch

exit status: 0 printed, 2 unusable input (unknown domain, level out of range, config error,
a domain that cannot start, a task its source skips, a repo task id the cache lacks).
"""

LIST_EPILOG = """The repository tasks ship in producers/repo_tasks/ (committed), built from real
packages by `rlbus tasks build repo`; --cache-dir or $RLBUS_REPO_TASKS reads another cache.

examples:
  rlbus tasks list --domain repo
  rlbus tasks list --domain repo --json | head -3
  rlbus tasks show --domain repo --task-id $(rlbus tasks list --domain repo --json | head -1 | jq -r .task_id)

exit status: 0 listed, 1 the cache is empty (the message names the build command), 2 bad input.
"""

BUILD_EPILOG = """How a task is made: the sdist file is downloaded from the package index pip is configured
with (build time only) and checked against the index's sha256; it is never built (no setup.py
runs on this host: producers/sdist_fetch.py), only unpacked; its own test suite runs once in
the bubblewrap process sandbox and must pass; then one source site at a time is mutated (flip
a comparison, off-by-one, drop a branch, swap two call arguments) and the suite rerun; a mutant
that makes 1..--max-targets tests fail becomes a task: the failing tests are its hidden targets
(their test files are hidden), the other tests its regression guard, the issue text the failing
call and its error, the gold patch the diff back to the original. A local sdist or unpacked
directory may replace NAME==VERSION (offline builds, tests).

examples:
  rlbus tasks build repo --from-sdist inflection==0.5.1 toolz==1.0.0
  rlbus tasks build repo --from-sdist toolz==1.0.0 --out /tmp/tasks --max-per-package 3
  RLBUS_REPO_TASKS=/tmp/tasks rlbus tasks list --domain repo

exit status: 0 at least one task built, 1 none (every package skipped: the reasons are printed).
"""


class TaskInputError(ValueError):
    """The command's inputs do not name a task."""


def task_config(domain: str, seed: int, config: str | None = None):
    """The run config a task of `domain` is made with (see the module guarantees)."""
    from schemas import rg_family
    from schemas.config import load_config

    overrides = [f"run.seed={int(seed)}"]
    cfg = load_config(config, overrides)
    if domain in cfg.sampler.domains:
        return cfg
    dataset = rg_family.dataset_of(domain) if domain.startswith(rg_family.PREFIX) else None
    if dataset is None or config:
        hint = "" if config else f" (or {rg_family.PREFIX}<dataset> for a reasoning-gym dataset)"
        if domain.startswith(rg_family.PREFIX) and dataset is None:
            close = difflib.get_close_matches(domain, [rg_family.domain_name(n) for n in rg_family.dataset_names()], 3)
            hint = f" (closest reasoning-gym domains: {', '.join(close) or 'none'})"
        raise TaskInputError(f"domain {domain!r} is not in the config; configured: {sorted(cfg.sampler.domains)}{hint}")
    return load_config(None, overrides + [f"sampler.domain_sets.reasoning_gym.include={json.dumps([dataset])}"])


def draw(domain: str, seed: int, index: int | None, level: int | None = None, config: str | None = None):
    """(config, Drawn) of task `index` (default 0) of `domain` at `level` (default: its start level)."""
    from producers.domains import make_source

    index = 0 if index is None else int(index)
    cfg = task_config(domain, seed, config)
    dc = cfg.sampler.domains[domain]
    lvl = dc.initial_level if level is None else int(level)
    if not dc.min_level <= lvl <= dc.max_level:
        raise TaskInputError(f"--level {lvl} outside domain {domain!r}'s levels {dc.min_level}..{dc.max_level}")
    if index < 0:
        raise TaskInputError(f"--index {index} is negative")
    with contextlib.redirect_stdout(sys.stderr):  # generators that print must not corrupt the output
        src = make_source("cli", domain, cfg)
        drawn = src.make_task(random.Random(f"sampler-{seed}-{index}"), lvl, index)
    return cfg, drawn


def hidden_view(hidden: dict[str, Any] | None) -> dict[str, Any]:
    """The hidden payload as plain JSON data (packed reasoning-gym values unpacked)."""
    from schemas import rg_family

    return {k: rg_family.jsonable(rg_family.unpack(v)) for k, v in (hidden or {}).items()}


def task_view(task) -> dict[str, Any]:
    """The task's fields, without the per-publish envelope (`msg_id`, `created_at`)."""
    out = task.model_dump(mode="json")
    for key in ("msg_id", "created_at"):
        out.pop(key, None)
    return out


def _print_text(task: dict[str, Any], hidden: dict[str, Any] | None) -> None:
    print(
        f"domain {task['domain']}  task_id {task['task_id']}  level {task['difficulty']}  "
        f"verifier {task['verifier']}  max_tokens {task['max_tokens']}  hidden_ref {task['hidden_ref']}"
    )
    for m in task["prompt"]:
        print(f"--- {m['role']} ---")
        print(m["content"])
    if hidden is not None:
        print("--- hidden (verifier only) ---")
        print(f"answer: {json.dumps(hidden.get('answer'), ensure_ascii=False)}")
        print(f"metadata: {json.dumps(hidden.get('metadata'), ensure_ascii=False, sort_keys=True)}")


def show(args: argparse.Namespace) -> int:
    """Run `rlbus tasks show`."""
    from producers.domains import TaskSkipped

    if args.domain == REPO_DOMAIN:
        return show_repo(args)
    if is_harbor_domain(args):
        return show_harbor(args) if args.task_id else _need_task_id()

    try:
        _, drawn = draw(args.domain, args.seed, args.index, args.level, args.config)
    except (ValueError, TaskSkipped) as exc:  # TaskInputError, ConfigError, DomainUnavailable, a skipped draw
        print(f"rlbus tasks show: {exc}", file=sys.stderr)
        return 2
    task = task_view(drawn.task)
    hidden = hidden_view(drawn.hidden) if args.hidden else None
    if args.json:
        out: dict[str, Any] = {"task": task}
        if hidden is not None:
            out["hidden"] = hidden
        print(json.dumps(out, ensure_ascii=False))
    else:
        _print_text(task, hidden)
    return 0


REPO_DOMAIN = "repo"


def _empty_cache(cmd: str, cache_dir) -> int:
    from producers import repo_cache

    where = cache_dir or repo_cache.default_cache_dir()
    print(
        f"rlbus tasks {cmd}: the repo task cache {where} is empty; build it with: {repo_cache.BUILD_HINT}",
        file=sys.stderr,
    )
    return 1


def list_repo(args: argparse.Namespace) -> int:
    """Run `rlbus tasks list --domain repo` (see the module guarantees)."""
    from producers import repo_cache

    if is_harbor_domain(args):
        return list_harbor(args)
    if args.domain != REPO_DOMAIN:
        print(
            f"rlbus tasks list: only --domain {REPO_DOMAIN} and harbor domains have a task list; other domains generate "
            "their tasks: see `rlbus tasks show --domain D --index I`",
            file=sys.stderr,
        )
        return 2
    tasks = repo_cache.list_tasks(args.cache_dir)
    if not tasks:
        return _empty_cache("list", args.cache_dir)
    if args.json:
        for t in tasks:
            print(json.dumps({"task_id": t.task_id, "source": t.source, "files": len(t.files)}))
        return 0
    width = max(len(t.task_id) for t in tasks)
    print(f"{'TASK_ID':<{width}}  {'SOURCE':<28} FILES TARGETS REGRESSION")
    for t in tasks:
        print(
            f"{t.task_id:<{width}}  {t.source:<28} {len(t.files):>5} {len(t.target_tests):>7} "
            f"{len(t.regression_tests):>10}"
        )
    print(
        f"{len(tasks)} tasks; licences: "
        + ", ".join(f"{k} {v}" for k, v in sorted(repo_cache.package_licences(args.cache_dir).items()))
    )
    return 0


def show_repo(args: argparse.Namespace) -> int:
    """Run `rlbus tasks show --domain repo --task-id ID` (see the module guarantees)."""
    from producers import repo_cache

    if not args.task_id:
        print(
            "rlbus tasks show: --domain repo needs --task-id ID (see `rlbus tasks list --domain repo`)", file=sys.stderr
        )
        return 2
    try:
        task = repo_cache.load_task(args.task_id, args.cache_dir)
    except repo_cache.TaskNotCached as exc:
        if not repo_cache.read_index(args.cache_dir)["tasks"]:
            _empty_cache("show", args.cache_dir)
        print(f"rlbus tasks show: {exc}", file=sys.stderr)
        return 2
    files = dict(sorted(task.files.items())) if args.files else sorted(task.files)
    if args.json:
        print(
            json.dumps(
                {
                    "task_id": task.task_id,
                    "issue": task.issue,
                    "files": files,
                    "gold_patch": task.gold_patch if args.gold_patch else None,
                },
                ensure_ascii=False,
            )
        )
        return 0
    print(
        f"task_id {task.task_id}  source {task.source}  files {len(task.files)}  "
        f"targets {len(task.target_tests)}  regression {len(task.regression_tests)}"
    )
    print("--- issue ---")
    print(task.issue.rstrip("\n"))
    print("--- files ---")
    for path in sorted(task.files):
        print(path)
    if args.files:
        for path, text in files.items():
            print(f"--- {path} ---")
            print(text.rstrip("\n"))
    if args.gold_patch:
        print("--- gold patch ---")
        print(task.gold_patch.rstrip("\n"))
    return 0


def scripts_repo(args: argparse.Namespace) -> int:
    """Run `rlbus tasks scripts --domain repo --out DIR [--empty]` (see the module guarantees)."""
    from pathlib import Path

    from producers import repo_cache
    from rollout_workers.engines.scripted_engine import EMPTY_STEPS, gold_steps, write_script

    if is_harbor_domain(args):
        return scripts_harbor(args)
    if args.domain != REPO_DOMAIN:
        print(f"rlbus tasks scripts: only --domain {REPO_DOMAIN} and harbor domains have scripts", file=sys.stderr)
        return 2
    try:
        if args.task_id:
            tasks = [repo_cache.load_task(i, args.cache_dir) for i in args.task_id]
        else:
            from producers.repo_fixtures import fixture_tasks

            tasks = repo_cache.list_tasks(args.cache_dir)
            tasks += (
                [t for i, t in sorted(fixture_tasks().items()) if i not in {x.task_id for x in tasks}] if tasks else []
            )
    except repo_cache.TaskNotCached as exc:
        print(f"rlbus tasks scripts: {exc}", file=sys.stderr)
        return 2
    if not tasks:
        return _empty_cache("scripts", args.cache_dir)
    for t in tasks:
        write_script(Path(args.out), t.task_id, list(EMPTY_STEPS) if args.empty else gold_steps(t.gold_patch))
    print(f"wrote {len(tasks)} {'empty' if args.empty else 'gold'} scripts to {args.out}")
    return 0


def _fetched(spec: str, tmp) -> str:
    """A local sdist / directory as is; else NAME==VERSION's sdist downloaded (never built: no
    setup.py runs on this host) and verified against the index's sha256 (`producers.sdist_fetch`)."""
    from pathlib import Path

    from producers.sdist_fetch import fetch_sdist

    if Path(spec).exists():
        return spec
    got = fetch_sdist(spec, Path(tmp))
    print(f"{spec}: fetched {got.path.name} sha256 {got.sha256} (verified against the index)", flush=True)
    return str(got.path)


def build_repo(args: argparse.Namespace) -> int:
    """Run `rlbus tasks build repo` (see BUILD_EPILOG and `producers.repo_build`)."""
    import tempfile
    from pathlib import Path

    from producers import repo_build, repo_cache
    from producers.sdist_fetch import SdistFetchError
    from rlbus.log import configure_logging

    configure_logging("tasks-build", level="WARNING")  # stdout is the per-package summary
    limits = repo_build.BuildLimits(
        max_per_package=args.max_per_package,
        max_tries=args.max_tries,
        max_targets=args.max_targets,
        timeout=args.timeout,
        seed=args.seed,
        allow_degraded=args.allow_degraded_sandbox,
    )
    out = Path(args.out) if args.out else repo_cache.default_cache_dir()

    def progress(r) -> None:
        status = f"skipped: {r.skipped}" if r.skipped else f"{len(r.tasks)} tasks"
        print(
            f"{r.spec}: {status} (licence {r.licence or '?'}, {r.tried} mutants tried, {r.survived} survived, "
            f"{r.rejected} rejected, {r.seconds} s)",
            flush=True,
        )

    total = 0
    for spec in args.from_sdist:
        with tempfile.TemporaryDirectory(prefix="rlbus-sdist-") as tmp:
            try:
                local = _fetched(spec, Path(tmp))
            except SdistFetchError as exc:
                print(f"{spec}: skipped: {exc}", flush=True)
                continue
            total += sum(len(r.tasks) for r in repo_build.build([local], out, limits, progress))
    print(f"{total} tasks written to {out}")
    return 0 if total else 1


def add_task_args(p: argparse.ArgumentParser, *, domain: bool = True) -> None:
    """The flags that name one task (shared with `rlbus verify`)."""
    if domain:
        p.add_argument("--domain", required=True, help="a configured domain, or rg-<dataset> (reasoning-gym)")
    p.add_argument("--seed", type=int, default=0, help="the run seed (run.seed; default 0)")
    p.add_argument("--index", type=int, help="the task's index in the sampler's stream (default 0)")
    p.add_argument("--level", type=int, help="difficulty level (default: the domain's start level)")
    p.add_argument("--config", help="run config TOML (default: the defaults, plus an rg-* domain)")


def register(sub) -> None:
    """Add `tasks` to the `rlbus` subcommands."""
    p = sub.add_parser(
        "tasks",
        help="inspect the tasks a domain makes; list/build the repo task cache (no NATS)",
        description="Inspect tasks exactly as the sampler makes them; list, show and build the "
        "repository-task cache (--domain repo).",
    )
    tsub = p.add_subparsers(dest="tasks_command", required=True, metavar="SUBCOMMAND")
    s = tsub.add_parser(
        "show",
        help="print one task (and, with --hidden, its verifier-only payload)",
        description="Print task --index of --domain for run seed --seed, as the sampler makes it.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_task_args(s)
    s.add_argument("--hidden", action="store_true", help="also print the hidden payload (gold answer, metadata)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.add_argument("--task-id", help="with --domain repo: the cached repo task to show")
    s.add_argument("--files", action="store_true", help="with --domain repo: add the public files' contents")
    s.add_argument("--gold-patch", action="store_true", help="with --domain repo: add the gold patch (unified diff)")
    s.add_argument(
        "--cache-dir", help="with --domain repo: the task cache (default producers/repo_tasks/ or $RLBUS_REPO_TASKS)"
    )
    s.set_defaults(func=show)
    _register_repo(tsub)
    register_harbor(tsub)


def _need_task_id() -> int:
    print("rlbus tasks show: a harbor domain needs --task-id NAME (see `rlbus tasks list`)", file=sys.stderr)
    return 2


def _register_repo(tsub) -> None:
    ls = tsub.add_parser(
        "list",
        help="list the cached repository tasks (--domain repo)",
        description="List the repository tasks in the task cache.",
        epilog=LIST_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ls.add_argument("--domain", required=True, help="repo (the only domain with a task cache)")
    ls.add_argument("--json", action="store_true", help='one object per line: {"task_id", "source", "files": N}')
    ls.add_argument("--config", help='run config TOML: a kind = "harbor" domain lists its task directories')
    ls.add_argument("--cache-dir", help="the task cache (default producers/repo_tasks/ or $RLBUS_REPO_TASKS)")
    ls.set_defaults(func=list_repo)
    b = tsub.add_parser(
        "build",
        help="build repository tasks from real packages (build time: downloads sdists, never builds them)",
        description="Build repository tasks by mutating packages' sources and running their suites.",
        epilog=BUILD_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("kind", choices=[REPO_DOMAIN], help="what to build: repo")
    b.add_argument(
        "--from-sdist",
        nargs="+",
        required=True,
        metavar="NAME==VERSION",
        help="pure-Python packages whose sdists carry their test suite (or a local sdist / directory)",
    )
    b.add_argument("--out", help="the task cache to write (default producers/repo_tasks/ or $RLBUS_REPO_TASKS)")
    b.add_argument("--max-per-package", type=int, default=10, help="most tasks per package (default 10)")
    b.add_argument("--max-tries", type=int, default=80, help="most mutants run per package (default 80)")
    b.add_argument(
        "--max-targets", type=int, default=20, help="a mutant failing more tests than this is rejected (default 20)"
    )
    b.add_argument("--timeout", type=float, default=120.0, help="wall seconds per suite run (default 120)")
    b.add_argument("--seed", type=int, default=0, help="the mutation-site shuffle seed (default 0)")
    b.add_argument(
        "--allow-degraded-sandbox",
        action="store_true",
        help="run the suites without bubblewrap (rlimits only; NOT isolated)",
    )
    b.set_defaults(func=build_repo)
    sc = tsub.add_parser(
        "scripts",
        help="write scripted-engine scripts for repo tasks (gold patch, or --empty)",
        description="Write one <task_id>.json script per repository task for rollout.engine = "
        "'scripted' (rollout.scripted.dir).",
    )
    sc.add_argument("--domain", required=True, help="repo")
    sc.add_argument("--out", required=True, help="the script directory to write")
    sc.add_argument("--empty", action="store_true", help="scripts that only submit (the repository untouched)")
    sc.add_argument("--task-id", action="append", default=[], help="only this task (repeatable; fixture-* ids too)")
    sc.add_argument("--config", help='run config TOML: scripts for a kind = "harbor" domain')
    sc.add_argument("--cache-dir", help="the task cache (default producers/repo_tasks/ or $RLBUS_REPO_TASKS)")
    sc.set_defaults(func=scripts_repo)
