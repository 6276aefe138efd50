"""`rlbus tail SUBJECT`: print decoded messages live from a subject wildcard.

Guarantees: what `bus.tail.tail` guarantees: a plain subscription, so it consumes nothing
and acks nothing; stops after `--max` messages or `--timeout` seconds when given.
"""

from __future__ import annotations

import argparse
import asyncio


def register(sub) -> None:
    """Add `rlbus tail` to the CLI's subparsers."""
    t = sub.add_parser("tail", help="print decoded messages live from a subject wildcard (consumes nothing)")
    t.add_argument("subject", help="subject or wildcard, e.g. 'rewards.>' or 'traj.<run>.arith'")
    t.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    t.add_argument("--json", action="store_true", help="one JSON object per line")
    t.add_argument("--max", type=int, help="stop after N messages")
    t.add_argument("--timeout", type=float, help="stop after S seconds")
    t.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Entry point of `rlbus tail`."""
    from bus.tail import tail

    asyncio.run(tail(args.nats_url, args.subject, args.json, args.max, timeout=args.timeout))
    return 0
