"""Generate NATS credentials and the per-role server config for compose/Kubernetes.

    python -m rlbus.natsauth write-env compose/.env                  # random passwords (0600), kept if present
    python -m rlbus.natsauth write-conf compose/nats-auth.conf --run-id R [--run-id R2 ...]
    python -m rlbus.natsauth show --run-id R                         # the authorization block, to stdout

Guarantees:
- `write-env` writes one `RLBUS_NATS_PASSWORD_<USER>` per user (`bus.auth.USERS`), 32
  random url-safe characters each, mode 0600; existing values are kept unless `--rotate`,
  so re-running it (e.g. from `make images`) never locks out a running server.
- `write-conf` renders `compose/nats-auth.conf.tmpl` with `bus.auth.server_auth_config`:
  the rendered file names `$RLBUS_NATS_PASSWORD_<USER>` variables, never a secret, and
  is safe to commit or mount from a ConfigMap.
- Nothing here runs at import.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bus.auth import USERS, password_env, random_passwords, server_auth_config, write_env

TEMPLATE = Path(__file__).resolve().parents[1] / "compose" / "nats-auth.conf.tmpl"
PLACEHOLDER = "@RLBUS_AUTHORIZATION@"


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE pairs of a .env file (comments and blank lines skipped)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                out[key.strip()] = value.strip()
    return out


def write_env_file(path: Path, rotate: bool = False) -> Path:
    """Create/refresh the .env with a password per user; keep existing ones unless `rotate`."""
    existing = {} if rotate else read_env(path)
    fresh = random_passwords()
    passwords = {u: existing.get(password_env(u)) or fresh[u] for u in USERS}
    others = {k: v for k, v in existing.items() if not k.startswith("RLBUS_NATS_PASSWORD_")}
    return write_env(path, passwords, extra=others)


def render_conf(runs: list[str], template: Path = TEMPLATE) -> str:
    """The server config: the template with the authorization block of `runs`."""
    text = template.read_text()
    if PLACEHOLDER not in text:
        raise ValueError(f"{template} has no {PLACEHOLDER} line")
    return text.replace(PLACEHOLDER, server_auth_config(runs).rstrip("\n"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlbus.natsauth", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("write-env", help="write a .env with a random password per NATS user (mode 0600)")
    e.add_argument("path", type=Path)
    e.add_argument("--rotate", action="store_true", help="replace existing passwords (restart the server and workers)")
    c = sub.add_parser("write-conf", help="render the nats-server config with per-role permissions for the runs")
    c.add_argument("path", type=Path)
    c.add_argument("--run-id", action="append", required=True, help="a run the users may reach (repeatable)")
    c.add_argument("--template", type=Path, default=TEMPLATE)
    s = sub.add_parser("show", help="print the authorization block for the runs")
    s.add_argument("--run-id", action="append", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "write-env":
            print(f"wrote {write_env_file(args.path, args.rotate)} ({len(USERS)} users)")
        elif args.cmd == "write-conf":
            args.path.write_text(render_conf(args.run_id, args.template))
            print(f"wrote {args.path} for runs {', '.join(args.run_id)}")
        else:
            sys.stdout.write(server_auth_config(args.run_id))
    except ValueError as exc:
        sys.exit(f"rlbus.natsauth: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
