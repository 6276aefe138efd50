"""`rlbus init`: prepare a run folder for workers started without `rlbus up` (compose, several hosts).

Registered in `rlbus.cli.COMMANDS`; the work is `rlbus.run.init_run.init_run`.
"""

from __future__ import annotations

EPILOG = """examples:
  rlbus init examples/demo.toml --run-id demo --run-dir /runs --nats-url nats://nats:4222
  rlbus init examples/smoke.toml --run-id smoke --run-dir runs --set learner.lr=1e-4
then, on any host that sees the run folder:
  rlbus worker rollout --config /runs/demo/config.json --run-id demo --run-dir /runs --nats-url nats://nats:4222
"""


def register(sub) -> None:
    """Add `rlbus init` to the CLI."""
    import argparse

    p = sub.add_parser(
        "init",
        help="prepare a run folder (config.json, model/start, secret) for separately started workers",
        description="Resolve the config, build + warm-start the model into <run-dir>/<run-id>/model/start "
        "(kept if it exists), create the tool secret and, with --nats-url, the run's streams.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="run config TOML, e.g. examples/demo.toml")
    p.add_argument("--run-id", required=True, help="run id every worker will be given")
    p.add_argument("--run-dir", default="runs", help="parent folder of runs (shared with the workers)")
    p.add_argument("--nats-url", help="also create the run's streams and buckets on this server")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from rlbus.run.init_run import init_run
    from schemas.config import ConfigError

    try:
        init_run(args.config, args.set, args.run_id, args.run_dir, args.nats_url)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    return 0
