"""`rlbus slurm render`: an sbatch script running a whole run on N nodes (the work: `rlbus.deploy.slurm`).

Registered in `rlbus.cli.COMMANDS`.
"""

from __future__ import annotations

EPILOG = """examples:
  rlbus slurm render examples/demo.toml --run-id exp7 --nodes 4 --run-dir /shared/runs > exp7.sbatch
  sbatch exp7.sbatch
  rlbus slurm render run.toml --run-id exp7 --nodes 2 --set deploy.slurm_placement.learner=1 --out exp7.sbatch

The script starts nats-server (JetStream, monitoring on 8222) on the first node, runs `rlbus init`
once, then one `srun` step per role on the node deploy.slurm_placement names (else round-robin;
rollout and learner from the last node down), each as its own NATS user; the URL travels as
RLBUS_NATS_URL. --run-dir must be shared by every node. After a lost node: `sbatch` the same
script again; init keeps model/start and the server restarts on the run's JetStream store.
docs/deploy.md, "Slurm".
"""


def register(sub) -> None:
    """Add `rlbus slurm` (with `render`) to the CLI."""
    import argparse

    p = sub.add_parser(
        "slurm",
        help="render an sbatch script that runs a run on N nodes (nats-server on the first, srun per role)",
        description="Slurm deployment of a run. `render` writes the script; nothing talks to Slurm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = p.add_subparsers(dest="slurm_cmd", required=True, metavar="VERB")
    r = verbs.add_parser(
        "render",
        help="write the sbatch script of this config on N nodes",
        description="Render the run's sbatch script (to stdout, or --out FILE).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("config", metavar="CONFIG", help="run config TOML, e.g. examples/demo.toml")
    r.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes of the allocation (>= 1)")
    r.add_argument("--run-id", default="", help="the run id (default: run.run_id of the config, else `run`)")
    r.add_argument("--run-dir", default="runs", help="parent folder of runs, shared by every node")
    r.add_argument("--out", default="", metavar="FILE", help="write the script here (default: stdout)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    r.set_defaults(func=_render)


def _render(args) -> int:
    from pathlib import Path

    from rlbus.deploy.slurm import render
    from schemas.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set)
        run_id = args.run_id or cfg.run.run_id or "run"
        text = render(cfg, run_id, args.nodes, args.config, args.set, args.run_dir)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"rlbus slurm render: {exc}") from None
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}; submit with: sbatch {args.out}")
    else:
        print(text, end="")
    return 0
