"""The `rlbus` command line: one entry point per process.

    rlbus up CONFIG            run every role of a config on this machine
    rlbus worker ROLE ...      run one role as one process (what `up` and compose start)
    rlbus init-model OUT       build a tiny HF-format causal LM locally
    rlbus sft MODEL OUT        supervised warm start on a domain's demonstrations
    rlbus tail SUBJECT         print decoded messages live from a subject wildcard
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROLES = ("sampler", "rollout", "sandbox", "verifier", "learner", "scheduler")

EPILOG = """examples:
  rlbus up examples/demo.toml                      # the demo: tiny model, SFT, then RL on arith
  rlbus up examples/demo.toml --max-minutes 5 --set learner.lr=5e-4
  rlbus worker rollout --config runs/<id>/config.json --nats-url nats://host:4222 --run-id <id>
  rlbus tail 'rewards.>' --max 5                   # watch rewards of every run, consuming nothing
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbus", description="RLVR post-training where every role is a process on NATS JetStream.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run a whole config locally (embedded NATS unless --nats-url)",
                        description="Prepare the model (build + SFT), start NATS and every role as its own process, "
                                    "show a live view, stop at the limits, and write <run-dir>/<run_id>/summary.json.")
    up.add_argument("config", help="run config TOML, e.g. examples/demo.toml")
    up.add_argument("--run-dir", help="parent folder of runs (default: run.run_dir, 'runs')")
    up.add_argument("--run-id", help="run id (default: <config>-<time>)")
    up.add_argument("--max-steps", type=int, help="stop after N learner steps")
    up.add_argument("--max-minutes", type=float, help="stop after M minutes of wall time, set-up included")
    up.add_argument("--nats-url", help="use this NATS server instead of starting an embedded one")
    up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field, e.g. learner.lr=1e-4")

    w = sub.add_parser("worker", help="run one role as one process",
                       description="Run exactly one role. Workers talk only over NATS; the run folder holds the prepared model.")
    w.add_argument("role", choices=ROLES, help="which role")
    w.add_argument("--config", required=True, help="run config (TOML, or the config.json `up` writes)")
    w.add_argument("--nats-url", help="NATS server URL (default: run.nats_url, else nats://127.0.0.1:4222)")
    w.add_argument("--run-id", help="run id (default: run.run_id)")
    w.add_argument("--run-dir", help="parent folder of runs (default: run.run_dir)")
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    w.add_argument("--max-messages", type=int, help="stop after N messages/steps (tests)")
    w.add_argument("--until-idle", type=float, help="stop after S seconds without work (tests)")

    im = sub.add_parser("init-model", help="build a tiny HF-format causal LM (char tokenizer) locally")
    im.add_argument("out", help="output folder")
    im.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    im.add_argument("--hidden-size", type=int, default=128)
    im.add_argument("--num-layers", type=int, default=4)
    im.add_argument("--num-heads", type=int, default=4)
    im.add_argument("--seed", type=int, default=0)

    sft = sub.add_parser("sft", help="supervised warm start on arith demonstrations (progress bar)")
    sft.add_argument("model", help="HF model folder to start from")
    sft.add_argument("out", help="output folder")
    sft.add_argument("--seconds", type=float, default=75.0)
    sft.add_argument("--max-steps", type=int, default=100_000)
    sft.add_argument("--difficulty", type=int, default=3)
    sft.add_argument("--batch-size", type=int, default=64)
    sft.add_argument("--lr", type=float, default=3e-3)
    sft.add_argument("--threads", type=int, default=2)
    sft.add_argument("--seed", type=int, default=0)

    t = sub.add_parser("tail", help="print decoded messages live from a subject wildcard (consumes nothing)")
    t.add_argument("subject", help="subject or wildcard, e.g. 'rewards.>' or 'traj.<run>.arith'")
    t.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    t.add_argument("--json", action="store_true", help="one JSON object per line")
    t.add_argument("--max", type=int, help="stop after N messages")
    t.add_argument("--timeout", type=float, help="stop after S seconds")
    return p


def _worker(args) -> int:
    from rlbus.config import load_config
    from rlbus.log import configure_logging
    from rlbus.runtime import WorkerContext

    cfg = load_config(args.config, args.set)
    run_id = args.run_id or cfg.run.run_id
    if not run_id:
        sys.exit("worker needs a run id: --run-id ID or run.run_id in the config")
    configure_logging(args.role, run_id)
    run_dir = Path(args.run_dir or cfg.run.run_dir)
    ctx = WorkerContext(run_id=run_id, nats_url=args.nats_url or cfg.run.nats_url or "nats://127.0.0.1:4222",
                        run_path=run_dir / run_id, max_messages=args.max_messages, until_idle=args.until_idle,
                        configured_model=cfg.model.path)
    if args.role == "sandbox":
        sys.exit("the sandbox service role is not built yet (issue #3); arith needs no sandbox")
    module = {"sampler": "producers.sampler", "rollout": "rollout_workers.worker", "verifier": "verifier_workers.worker",
              "learner": "learner.worker", "scheduler": "scheduler.worker"}[args.role]
    import importlib

    asyncio.run(importlib.import_module(module).run(cfg, ctx))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the command."""
    args = _parser().parse_args(argv)
    # models load from local paths only; transformers' own progress bars are noise here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.command == "worker":
        return _worker(args)
    if args.command == "up":
        from rlbus.config import ConfigError, load_config
        from rlbus.launcher import up
        from rlbus.log import configure_logging

        overrides = list(args.set)
        for flag, key in (("run_dir", "run.run_dir"), ("run_id", "run.run_id"), ("max_steps", "run.max_steps"),
                          ("max_minutes", "run.max_minutes"), ("nats_url", "run.nats_url")):
            value = getattr(args, flag)
            if value is not None:
                overrides.append(f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}")
        try:
            cfg = load_config(args.config, overrides)
        except ConfigError as exc:
            sys.exit(str(exc))
        configure_logging("launcher", cfg.run.run_id or None)
        return up(cfg, args.config)
    if args.command == "init-model":
        from rlbus.tiny_model import build_tiny_model

        path = build_tiny_model(Path(args.out), arch=args.arch, hidden_size=args.hidden_size,
                                num_layers=args.num_layers, num_heads=args.num_heads, seed=args.seed)
        print(f"tiny model written to {path}")
        return 0
    if args.command == "sft":
        from learner.sft import run_sft
        from producers import arith

        def demo(rng):
            p = arith.generate(rng, args.difficulty)
            return p.prompt, p.completion

        stats = run_sft(Path(args.model), Path(args.out), demo, seconds=args.seconds, max_steps=args.max_steps,
                        batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads, progress=True)
        print(stats)
        return 0
    if args.command == "tail":
        from bus.tail import tail

        asyncio.run(tail(args.nats_url, args.subject, args.json, args.max, timeout=args.timeout))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
