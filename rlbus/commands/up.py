"""`rlbus up CONFIG`: run a whole config on this machine (`rlbus up --resume RUN_PATH`: continue one).

Guarantees:
- The flags (`--run-dir`, `--run-id`, `--max-steps`, `--max-minutes`, `--nats-url`,
  `--allow-degraded-sandbox`) are config overrides like `--set`, applied after it; an
  invalid config exits with its error and starts nothing.
- `--resume` takes the run's own config.json (a CONFIG given as well must match it, only
  run limits may change; `rlbus.run.resume`) and refuses `--run-id`/`--run-dir`.
- The run itself is `rlbus.run.launcher.up`: its exit code is this command's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FLAG_KEYS = (
    ("run_dir", "run.run_dir"),
    ("run_id", "run.run_id"),
    ("max_steps", "run.max_steps"),
    ("max_minutes", "run.max_minutes"),
    ("nats_url", "run.nats_url"),
)
"""`up` flag -> the config key it overrides."""


def register(sub) -> None:
    """Add `rlbus up` to the CLI's subparsers."""
    up = sub.add_parser(
        "up",
        help="run a whole config locally (embedded NATS unless --nats-url)",
        description="Prepare the model (build + SFT), start NATS and every role as its own process, "
        "show a live view, stop at the limits, and write <run-dir>/<run_id>/summary.json.",
    )
    up.add_argument("config", nargs="?", help="run config TOML, e.g. examples/demo.toml (optional with --resume)")
    up.add_argument(
        "--resume",
        metavar="RUN_PATH",
        help="continue the run in <run-dir>/<run_id> whose launcher died: "
        "its config, model, checkpoints and streams are reused; a CONFIG given too must match",
    )
    up.add_argument("--run-dir", help="parent folder of runs (default: run.run_dir, 'runs')")
    up.add_argument("--run-id", help="run id (default: <config>-<time>)")
    up.add_argument("--max-steps", type=int, help="stop after N learner steps")
    up.add_argument("--max-minutes", type=float, help="stop after M minutes of wall time, set-up included")
    up.add_argument("--nats-url", help="use this NATS server instead of starting an embedded one")
    up.add_argument(
        "--allow-degraded-sandbox",
        action="store_true",
        help="run tool calls and tests WITHOUT sandbox isolation where bubblewrap is missing "
        "(sets sandbox.allow_degraded=true; the console and summary.json say so)",
    )
    up.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. learner.lr=1e-4"
    )
    up.add_argument(
        "--debug",
        action="store_true",
        help="show the Python traceback when the run stops on an unexpected error (by default one "
        "plain line names the error and the command that continues the run)",
    )
    up.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus up`."""
    from rlbus.log import configure_logging
    from rlbus.run.launcher import up
    from schemas.config import ConfigError, load_config

    overrides = list(args.set)
    for flag, key in FLAG_KEYS:
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
    if args.allow_degraded_sandbox:
        overrides.append("sandbox.allow_degraded=true")
    if args.resume:
        return _resume(args, overrides)
    if not args.config:
        sys.exit("rlbus up: give a CONFIG (e.g. examples/demo.toml), or --resume <run-dir>/<run_id>")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        sys.exit(str(exc))
    configure_logging("launcher", cfg.run.run_id or None, level="WARNING")
    return up(cfg, args.config, debug=args.debug)


def _resume(args: argparse.Namespace, overrides: list[str]) -> int:
    from rlbus.log import configure_logging
    from rlbus.run.launcher import up
    from rlbus.run.resume import ResumeError, resumed_config
    from schemas.config import ConfigError

    if args.run_id or args.run_dir:
        sys.exit("rlbus up --resume: the run folder names the run; drop --run-id/--run-dir")
    try:
        cfg = resumed_config(Path(args.resume), args.config, [o for o in overrides if not o.startswith("run.nats_url")])
    except (ResumeError, ConfigError) as exc:
        sys.exit(f"rlbus up --resume: {exc}")
    if args.nats_url:
        cfg.run.nats_url = args.nats_url
    configure_logging("launcher", cfg.run.run_id or None, level="WARNING")
    try:
        return up(cfg, args.config, resume=Path(args.resume), debug=args.debug)
    except ResumeError as exc:
        sys.exit(f"rlbus up --resume: {exc}")
