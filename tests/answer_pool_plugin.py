"""Test helper: plugin verifiers that declare themselves untrusted (tests/test_answer_pool.py)."""

from __future__ import annotations

import os

from verifier_workers.verdict import Verdict


def env_peek(traj, hidden=None) -> Verdict:
    """Scores 1.0 when it can see the planted credential or the gold is in its memory as asked; reports its pid."""
    seen = os.environ.get("NATS_PASSWORD", "")
    gold = (hidden or {}).get("gold")
    return Verdict(
        {"correct": float(traj.final_text == gold), "saw_secret": float(seen == "planted")},
        details=f"pid={os.getpid()}",
    )


env_peek.untrusted = True


def spin(traj, hidden=None) -> Verdict:
    """Never returns (a CPU-bound loop): the pool's limits must end it."""
    while True:
        pass


spin.untrusted = True
