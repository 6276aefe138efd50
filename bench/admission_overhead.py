"""Admission overhead: fetch+ack rate of training tasks through the priority classes
(`rollout_workers.admission.PrioritySubscription`, the `eval` class idle) against the pool's one
consumer (`rollout.priority.enabled = false`), alternated on one embedded nats-server.

Run with no arguments (`python bench/admission_overhead.py`, about a minute): `REPS` alternated
rounds of each, `N` tasks a round, batches of 8 (the rollout default), no generation: the admission
path alone, where its cost is largest relative to the work. Writes
bench/results/admission_overhead.json: `ours` = median tasks/s with priority classes, `peer` =
median with one consumer, `ratio` = ours / peer.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.conn import connect, ensure_topology, pull_subscription
from bus.publish import publish_many
from bus.server import EmbeddedNats
from bus.subjects import PRIORITY_CLASSES, Registry
from rollout_workers.admission import Admission, PrioritySubscription
from schemas import ChatMessage, Task

N, REPS, BATCH = 3000, 5, 8


def task(run_id: str, i: int) -> Task:
    return Task(
        run_id=run_id,
        msg_id=f"t{i}",
        task_id=f"t{i}",
        domain="arith",
        group_size=1,
        prompt=[ChatMessage(role="user", content="1+1")],
        verifier="exact",
    )


async def one(url: str, run_id: str, priority: bool) -> float:
    """Tasks/s fetching and acking `N` published training tasks."""
    nc = await connect(url, name="bench-admission")
    js = nc.jetstream()
    try:
        reg = Registry(run_id)
        await ensure_topology(js, reg)
        for k in range(0, N, 500):
            await publish_many(js, [(reg.tasks("arith"), task(run_id, i)) for i in range(k, k + 500)])
        if priority:
            subs = {c: await pull_subscription(js, reg.rollout_consumer(30, priority=c)) for c in PRIORITY_CLASSES}
            sub = PrioritySubscription(subs, Admission(PRIORITY_CLASSES, 0.25))
        else:
            sub = await pull_subscription(js, reg.rollout_consumer(30))
        n, t0 = 0, time.perf_counter()
        while n < N:
            msgs = await sub.fetch(BATCH, timeout=1.0)
            for m in msgs:
                await m.ack()
            n += len(msgs)
        return N / (time.perf_counter() - t0)
    finally:
        await nc.close()


def main() -> int:
    load = os.getloadavg()[0]
    runs: dict[str, list[float]] = {"priority": [], "one_consumer": []}
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-admission-") as tmp:
        server = EmbeddedNats(Path(tmp) / "nats").start()
        try:
            for rep in range(REPS):
                for name in runs:
                    rate = asyncio.run(one(server.url, f"adm{name.replace('_', '')}{rep}", name == "priority"))
                    runs[name].append(round(rate, 1))
        finally:
            server.stop()
    ours, peer = statistics.median(runs["priority"]), statistics.median(runs["one_consumer"])
    out = {
        "benchmark": "admission_overhead",
        "unit": "training tasks fetched and acked per s (batches of 8, no generation)",
        "ours": ours,
        "peer": peer,
        "ratio": round(ours / peer, 3),
        "runs": runs,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {load:.1f} before, {os.getloadavg()[0]:.1f} after",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (ROOT / "bench" / "results" / "admission_overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
