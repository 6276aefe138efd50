"""`rlbus worker ROLE --config FILE`: run exactly one role as one process.

Guarantees:
- ROLE is one of the roles of `bus.roles.ROLES`; its module (`Role.module`) is imported
  only when it runs, and its `run(cfg, ctx)` is the whole process.
- The run id is `--run-id`, else `run.run_id`; without either the command exits saying so.
- The NATS URL is `--nats-url`, else env `RLBUS_NATS_URL` (how `rlbus up` and the container
  entry hand over credentials), else `run.nats_url`, else nats://127.0.0.1:4222; a URL
  whose password is redacted (`***`, as the run folder keeps it) is refused with what to
  pass instead.
- `sandbox.allow_degraded` reaches the code verifiers through the environment.
- Started by `rlbus up` with a start gate (`rlbus.run.startgate`), it does its imports and then
  waits for the launcher to open the gate before it connects or reads the model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bus.roles import NAMES, ROLES, role


def register(sub) -> None:
    """Add `rlbus worker` to the CLI's subparsers."""
    w = sub.add_parser(
        "worker",
        help="run one role as one process",
        description="Run exactly one role. Workers talk only over NATS; the run folder holds the prepared model.",
    )
    w.add_argument("role", choices=NAMES, help="which role")
    w.add_argument("--config", required=True, help="run config (TOML, or the config.json `up` writes)")
    w.add_argument("--nats-url", help="NATS server URL (default: run.nats_url, else nats://127.0.0.1:4222)")
    w.add_argument("--run-id", help="run id (default: run.run_id)")
    w.add_argument("--run-dir", help="parent folder of runs (default: run.run_dir)")
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    w.add_argument(
        "--max-messages",
        type=int,
        metavar="N",
        help="stop after N units of the role's work (tests): " + "; ".join(f"{r.name}: {r.limit_unit}" for r in ROLES),
    )
    w.add_argument("--until-idle", type=float, help="stop after S seconds without work (tests)")
    w.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus worker`."""
    import importlib

    from bus.session import WorkerContext
    from rlbus.log import configure_logging
    from rlbus.run.folder import RunFolder
    from schemas.config import load_config

    cfg = load_config(args.config, args.set)
    run_id = args.run_id or cfg.run.run_id
    if not run_id:
        sys.exit("worker needs a run id: --run-id ID or run.run_id in the config")
    configure_logging(args.role, run_id)
    if cfg.sandbox.allow_degraded:  # code verifiers open sandboxes without the config: they read the env
        from sandbox_workers.process import ALLOW_DEGRADED_ENV

        os.environ[ALLOW_DEGRADED_ENV] = "1"
    folder = RunFolder.of(Path(args.run_dir or cfg.run.run_dir), run_id)
    ctx = WorkerContext(
        run_id=run_id,
        nats_url=worker_url(args, cfg),
        run_path=folder.path,
        max_messages=args.max_messages,
        until_idle=args.until_idle,
        configured_model=cfg.model.path,
    )
    from rlbus.run.startgate import pass_gate

    pass_gate(args.role, role(args.role).module, cfg)  # started by `up` before the model was ready: wait
    asyncio.run(importlib.import_module(role(args.role).module).run(cfg, ctx))
    return 0


def worker_url(args, cfg) -> str:
    """--nats-url, else env RLBUS_NATS_URL, else the config's (see the module guarantees)."""
    from schemas.redact import NATS_URL_ENV, is_redacted

    url = args.nats_url or os.environ.get(NATS_URL_ENV) or cfg.run.nats_url or "nats://127.0.0.1:4222"
    if is_redacted(url):
        sys.exit(
            f"rlbus worker: the NATS URL's password is redacted ('***', as the run folder keeps it); pass the "
            f"real URL in env {NATS_URL_ENV} or --nats-url, or a URL without credentials and the login in "
            "RLBUS_NATS_USER / RLBUS_NATS_PASSWORD"
        )
    return url
