"""`rlbus tasks show`: print one task exactly as the sampler would make it; reads no run, no NATS.

    rlbus tasks show --domain rg-<dataset> --seed S --index I [--level L] [--hidden] [--json] [--config FILE]

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
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import random
import sys
from typing import Any

EPILOG = """examples:
  rlbus tasks show --domain rg-leg_counting --seed 0 --index 7
  rlbus tasks show --domain rg-basic_arithmetic --seed 3 --index 0 --level 2 --hidden --json
  rlbus tasks show --domain arith --config examples/demo.toml --index 0

exit status: 0 printed, 2 unusable input (unknown domain, level out of range, config error,
a domain that cannot start, a task its source skips).
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
    print(f"domain {task['domain']}  task_id {task['task_id']}  level {task['difficulty']}  "
          f"verifier {task['verifier']}  max_tokens {task['max_tokens']}  hidden_ref {task['hidden_ref']}")
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
    p = sub.add_parser("tasks", help="inspect the tasks a domain makes (no run, no NATS)",
                       description="Inspect tasks exactly as the sampler makes them.")
    tsub = p.add_subparsers(dest="tasks_command", required=True, metavar="SUBCOMMAND")
    s = tsub.add_parser("show", help="print one task (and, with --hidden, its verifier-only payload)",
                        description="Print task --index of --domain for run seed --seed, as the sampler makes it.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_args(s)
    s.add_argument("--hidden", action="store_true", help="also print the hidden payload (gold answer, metadata)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.set_defaults(func=show)
