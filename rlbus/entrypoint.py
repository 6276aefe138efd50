"""The entry point of every rlbus container (compose/entrypoint.sh runs it as `rlbus-entrypoint`):

    python -m rlbus.entrypoint init             # prepare the run once (`rlbus init` with the env's settings)
    python -m rlbus.entrypoint ROLE [ARGS...]   # `rlbus worker ROLE` with the run's settings
    python -m rlbus.entrypoint health ROLE      # container healthcheck

Settings come from the environment (`rlbus.run.init_run.env_settings`: RLBUS_CONFIG,
RLBUS_SET, RLBUS_RUN_ID, RLBUS_RUN_DIR, NATS_URL and the NATS login).

Guarantees:
- `init` leaves the run folder as `rlbus.run.init_run.init_run` guarantees, exit 0.
- `health ROLE` exits 0 only when a worker of ROLE in this container (same host name)
  sent a telemetry heartbeat within the last few seconds; 1 otherwise, with the reason
  on stderr (an unreachable server is unhealthy, not a crash). A learner rank > 0 of a
  per-rank pod (RLBUS_LEARNER_LAUNCH=external) talks to no bus: healthy when its
  `/metrics` (RLBUS_METRICS_PORT) answers; its collectives time out on their own.
- `ROLE` runs `rlbus worker ROLE` through `rlbus.cli.main`, with the NATS URL handed over
  in env `RLBUS_NATS_URL`, never argv.
- Anything else prints the usage and exits 2 (`-h`/`--help`: the usage, exit 0).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from bus.subjects import ROLES

USAGE = f"usage: rlbus-entrypoint init | health ROLE | ROLE [rlbus worker args]  (ROLE: {', '.join(ROLES)})"


def main(argv: list[str] | None = None) -> int:
    """Container entry: `init`, `health ROLE`, or a role."""
    from rlbus.run.init_run import env_settings, heartbeat_seen, init_run, worker_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    settings = env_settings()
    what, rest = argv[0], argv[1:]
    if what == "init":
        from rlbus.log import configure_logging

        configure_logging("init", settings["run_id"], level="WARNING")
        init_run(
            settings["config"], settings["overrides"], settings["run_id"], settings["run_dir"], settings["nats_url"]
        )
        return 0
    if what == "health":
        if len(rest) != 1 or rest[0] not in ROLES:
            print(USAGE, file=sys.stderr)
            return 2
        if rest[0] == "learner":  # a per-rank learner pod of rank > 0 has no bus heartbeat: its /metrics
            from learner.rendezvous import follower_rank, metrics_answer

            rank = follower_rank()
            if rank is not None:
                why = metrics_answer(int(os.environ.get("RLBUS_METRICS_PORT") or 0))
                if why:
                    print(f"unhealthy: learner rank {rank}: {why}", file=sys.stderr)
                return 1 if why else 0
        try:
            ok = asyncio.run(heartbeat_seen(settings["nats_url"], settings["run_id"], rest[0], socket.gethostname()))
        except Exception as exc:  # noqa: BLE001 - unreachable server: unhealthy
            print(f"unhealthy: {exc}", file=sys.stderr)
            return 1
        if not ok:
            print(f"unhealthy: no {rest[0]} heartbeat from {socket.gethostname()}", file=sys.stderr)
        return 0 if ok else 1
    if what not in ROLES:
        print(USAGE, file=sys.stderr)
        return 2
    from rlbus.cli import main as cli_main
    from schemas.redact import NATS_URL_ENV

    os.environ[NATS_URL_ENV] = settings["nats_url"]
    return cli_main(worker_argv(what, settings, rest))


if __name__ == "__main__":
    sys.exit(main())
