"""The `rlbus` command line: parser assembly and dispatch, nothing else.

    rlbus up CONFIG            run every role of a config on this machine
    rlbus worker ROLE ...      run one role as one process (what `up` and compose start)
    rlbus status | top | tail  watch a run;  rlbus dlq list|show|replay  its dead letters
    rlbus export | report | samples | rescore   read a run back
    rlbus init-model | sft | generate | init | tasks | verify | config-help | sandbox

Guarantees:
- Every command is a module in `COMMANDS`, imported here at import time: a missing or
  broken command module is an ImportError of `rlbus` itself, never a silently absent
  command. Each module's `register(subparsers)` adds its parser and sets `func`.
- `main(argv)` runs the parsed command's `func` and returns its exit code. Before it:
  `--nats-creds` becomes env RLBUS_NATS_CREDS (for every connection, child processes
  too), models load offline (HF_HUB_OFFLINE=1 unless set), and every command but `up`
  and `worker` logs at WARNING to stderr (stdout holds only its answer).
- A refused NATS login or permission exits with its reason; a closed stdout (`| head`)
  ends quietly with 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rlbus.commands import (
    config_help,
    dlq,
    export,
    generate,
    init,
    init_model,
    k8s,
    report,
    rescore,
    rlhf_pairs,
    samples,
    sft,
    slurm,
    status,
    tail,
    tasks,
    top,
    train_rm,
    up,
    verify,
    worker,
)
from sandbox_workers import cli as sandbox_cli

COMMANDS = (
    up,
    worker,
    init_model,
    sft,
    train_rm,
    rlhf_pairs,
    generate,
    status,
    top,
    tail,
    dlq,
    export,
    report,
    samples,
    rescore,
    tasks,
    verify,
    init,
    k8s,
    slurm,
    config_help,
    sandbox_cli,
)
"""Every command module, in the order `rlbus --help` lists them (`sandbox_workers.cli`:
`rlbus sandbox`, which lives with its subsystem)."""

EPILOG = """examples:
  rlbus up examples/demo.toml                      # the demo: tiny model, SFT, then RL on arith
  rlbus up examples/demo.toml --max-minutes 5 --set learner.lr=5e-4
  rlbus worker rollout --config runs/<id>/config.json --nats-url nats://host:4222 --run-id <id>
  rlbus tail 'rewards.>' --max 5                   # watch rewards of every run, consuming nothing
  rlbus dlq list --run-dir runs --run-id <id>      # dead letters of a run
  set -a; . compose/.env; set +a; rlbus status --nats-url nats://127.0.0.1:4222   # as the compose stack's monitor user
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlbus",
        description="RLVR post-training where every role is a process on NATS JetStream.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nats-creds",
        metavar="FILE",
        help="log in to NATS with this .creds file (user JWT + nkey seed, as `nsc` writes it; needs the "
        "nkeys package); sets RLBUS_NATS_CREDS for every connection of the command. Without it, "
        "RLBUS_NATS_USER and RLBUS_NATS_PASSWORD (or RLBUS_NATS_PASSWORD_FILE) are used, if set",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the command; a refused NATS login or permission exits with its reason."""
    from bus.conn import NatsAuthError, PermissionDenied

    args = _parser().parse_args(argv)
    if args.nats_creds:
        from bus.auth import ENV_CREDS

        os.environ[ENV_CREDS] = str(Path(args.nats_creds).resolve())  # every connection, child processes too
    try:
        return _dispatch(args)
    except (NatsAuthError, PermissionDenied) as exc:
        sys.exit(f"rlbus {args.command}: {exc}")
    except BrokenPipeError:  # `rlbus ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    # models load from local paths only; transformers' own progress bars are noise here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.command not in ("worker", "up"):
        from rlbus.log import configure_logging

        # one-shot commands: stdout holds only their answer, warnings go to stderr
        configure_logging(args.command, level="WARNING")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
