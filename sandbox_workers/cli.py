"""`rlbus sandbox ...`: build the sandbox image, run one command in a fresh sandbox, reap.

    rlbus sandbox build-image [--tag T] [--repo [--with REQ ...]]
    rlbus sandbox exec [--backend docker|process|auto] [--image I] [--timeout S]
                       [--memory-mb M] [--allow-degraded-sandbox] -- CMD ...
    rlbus sandbox reap [--all]

Guarantees:
- `exec` prints exactly ONE JSON line on stdout: exit_code, stdout, stderr, timed_out,
  oom, truncated, duration_ms, isolation (the command's own status is `exit_code`;
  `rlbus` itself exits 0 whenever the sandbox ran the command, 1 when it could not
  start one, with the reason and the fix on stderr: among others when the process
  backend cannot isolate, i.e. no usable bubblewrap, and `--allow-degraded-sandbox`
  was not given; it then runs nothing).
- `exec` uses `sandbox_workers.factory.open_sandbox`, so it gets exactly what rollout
  workers and verifiers get; with docker it keeps no warm pool (one-shot) and leaves
  no container behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sandbox_workers.base import Limits

EPILOG = """examples:
  rlbus sandbox build-image                          # build rlbus-sandbox:latest (offline)
  rlbus sandbox build-image --repo                   # build rlbus-repo-sandbox:latest (pytest inside)
  rlbus sandbox exec -- python3 -c 'print(6 * 7)'    # process backend (bubblewrap)
  rlbus sandbox exec --backend docker --timeout 2 -- sh -c 'while :; do :; done'
  rlbus sandbox exec --backend docker --memory-mb 128 -- python3 -c 'b = b"x" * (1 << 30)'
  rlbus sandbox reap --all                           # remove every labelled sandbox container

`exec` prints one JSON line:
  {"exit_code": 0, "stdout": "42\\n", "stderr": "", "timed_out": false, "oom": false,
   "truncated": false, "duration_ms": 71.3, "isolation": "docker"}
"""

RESULT_FIELDS = ("exit_code", "stdout", "stderr", "timed_out", "oom", "truncated", "duration_ms", "isolation")


def register(sub) -> None:
    """Add `rlbus sandbox` and its subcommands to the `rlbus` parser."""
    p = sub.add_parser(
        "sandbox",
        help="build the sandbox image, run one command in a sandbox, reap containers",
        description="Sandboxes run untrusted commands (tool calls, tests of generated code).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")

    b = actions.add_parser(
        "build-image",
        help="build the docker backend's image from compose/sandbox.Dockerfile",
        description="Build offline (no pull, no network in RUN steps) from a base image already on the engine.",
    )
    b.add_argument("--tag", help="image tag (default: rlbus-sandbox:latest, or rlbus-repo-sandbox:latest with --repo)")
    b.add_argument(
        "--repo",
        action="store_true",
        help="build the repository-task image (pytest inside, from a wheelhouse fetched on the host) "
        "from compose/repo-sandbox.Dockerfile",
    )
    b.add_argument(
        "--with",
        dest="extra",
        action="append",
        default=[],
        metavar="REQ",
        help="--repo: also put REQ's wheels in the image's wheelhouse (task deps); repeatable",
    )
    b.set_defaults(func=_build_image)

    e = actions.add_parser(
        "exec",
        help="run one command in a fresh sandbox; print the result as one JSON line",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument(
        "--backend",
        choices=("process", "docker", "auto"),
        default="process",
        help="process: bubblewrap + rlimits; docker: a container; auto: docker if an engine answers",
    )
    e.add_argument("--image", help="docker image (default: rlbus-sandbox:latest)")
    e.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit in seconds (default 10)")
    e.add_argument("--memory-mb", type=int, default=Limits.memory_mb, help=f"memory limit (default {Limits.memory_mb})")
    e.add_argument(
        "--allow-degraded-sandbox",
        action="store_true",
        help="process backend: run WITHOUT isolation (rlimits only) where bubblewrap is missing; "
        "else it refuses and exits 1",
    )
    e.add_argument(
        "cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments, after `--`"
    )
    e.set_defaults(func=_exec)

    r = actions.add_parser("reap", help="remove orphaned sandbox containers (label rlbus.sandbox=1)")
    r.add_argument("--all", action="store_true", help="remove every labelled container, also those of live processes")
    r.set_defaults(func=_reap)


def _build_image(args) -> int:
    from sandbox_workers.images import DEFAULT_TAG, ImageBuildError, build_image

    try:
        if args.repo:
            from sandbox_workers.repo_image import REPO_TAG, build_repo_image

            args.tag = args.tag or REPO_TAG
            image_id = build_repo_image(args.tag, extra=args.extra, on_line=lambda line: print(line, file=sys.stderr))
        else:
            args.tag = args.tag or DEFAULT_TAG
            image_id = build_image(args.tag, on_line=lambda line: print(line, file=sys.stderr))
    except (ImageBuildError, RuntimeError) as exc:
        print(f"rlbus sandbox build-image: {exc}", file=sys.stderr)
        return 1
    print(f"built {args.tag} ({image_id})")
    return 0


def _exec(args) -> int:
    from sandbox_workers.factory import open_sandbox

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print(
            "rlbus sandbox exec: give the command after `--`, e.g. rlbus sandbox exec -- python3 -c 'print(1)'",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("RLBUS_SANDBOX_WARM_POOL", "0")  # one command: no containers kept warm
    limits = Limits(memory_mb=args.memory_mb)
    try:
        sandbox = open_sandbox(
            args.backend,
            image=args.image,
            limits=limits,
            timeout=args.timeout,
            allow_degraded=args.allow_degraded_sandbox,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"rlbus sandbox exec: {exc}", file=sys.stderr)
        return 1
    with sandbox:
        result = sandbox.execute(cmd, timeout=args.timeout)
    row = result.to_dict()
    print(json.dumps({k: row[k] for k in RESULT_FIELDS}))
    return 0


def _reap(args) -> int:
    from sandbox_workers.docker_engine import reap

    try:
        removed = reap(all_owners=args.all)
    except RuntimeError as exc:
        print(f"rlbus sandbox reap: {exc}", file=sys.stderr)
        return 1
    print(f"removed {len(removed)} container(s)")
    return 0
