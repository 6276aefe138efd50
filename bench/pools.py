"""Pools benchmark: short-task throughput when 20 s tasks share the pipeline, vs short tasks alone.

What it measures (run with no arguments: `python bench/pools.py`; about 3 minutes):

Three runs of the REAL worker processes (`rlbus worker sampler|rollout|verifier|learner`,
one embedded nats-server each, rollout engine `sleep`: a batch takes as long as its
slowest `sleep` task, verifier `constant`, learner `policy="null"`):

- `short_only`: one domain of 0.1 s tasks.
- `mixed_pools`: the same 0.1 s domain plus, at equal sampling weight, a domain of 20 s
  tasks in the `long` pool. The long pool has its own consumer, pull loop, ack_wait,
  budget and in-flight gate, so long episodes hold only their own pool.
- `mixed_one_pool` (for contrast): both domains in the `short` pool, as a pipeline
  without duration pools would run them.

The rate of each run is 0.1 s-domain rewards stored in REWARDS per second over a fixed
window after a warm-up (read from the stream's per-subject counts: nothing is consumed).
Writes bench/results/pools.json with `ours` = mixed_pools short rate, `peer` =
short_only rate, `ratio` = ours / peer (target >= 0.8), and the contrast run.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.table import Table

from bench import start_roles, stop_procs
from bus.conn import connect
from bus.server import EmbeddedNats
from bus.subjects import Registry

WARMUP_S, WINDOW_S, LONG_S, SHORT_S = 10.0, 40.0, 20.0, 0.1

BASE = f"""
[sampler]
group_size = 2
max_inflight_tasks = 32
publish_batch = 16
[sampler.domains.quick]
kind = "sleep"
params = {{ seconds = {SHORT_S} }}
[rollout]
engine = "sleep"
batch_tasks = 8
[rollout.pools.long]
ack_wait_s = 120
batch_tasks = 2
max_inflight = 4
budget_s = 120
[verifier]
concurrency = 0
[learner]
policy = "null"
groups_per_step = 4
step_window_s = 0.5
max_staleness = 100000
checkpoint_every = 1000000
"""

SLOW = f"""
[sampler.domains.slow]
kind = "sleep"
pool = "{{pool}}"
params = {{{{ seconds = {LONG_S} }}}}
"""

SCENARIOS = {
    "short_only": BASE,
    "mixed_pools": BASE + SLOW.format(pool="long"),
    "mixed_one_pool": BASE + SLOW.format(pool="short"),
}


async def stored(url: str, reg: Registry, subject: str) -> int:
    from nats.js.errors import NotFoundError

    nc = await connect(url, name="bench-pools")
    try:
        info = await nc.jetstream().stream_info(reg.stream("REWARDS"), subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))
    except NotFoundError:  # the workers have not created the run's streams yet
        return 0
    finally:
        await nc.close()


def run_scenario(name: str, config: str, tmp: Path, console: Console) -> dict:
    run_id = f"pools{name.replace('_', '')}{os.getpid()}"
    cfg_path = tmp / f"{name}.toml"
    cfg_path.write_text(config)
    server = EmbeddedNats(tmp / f"nats-{name}").start()
    reg = Registry(run_id)
    procs = []
    try:
        procs += start_roles(cfg_path, server.url, run_id, tmp / "runs", tmp / name)
        subject = reg.rewards("quick")
        deadline = time.monotonic() + 120
        while asyncio.run(stored(server.url, reg, subject)) == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no reward in 120 s; see {tmp}/{name}-*.log")
            time.sleep(0.5)
        time.sleep(WARMUP_S)
        n0, t0 = asyncio.run(stored(server.url, reg, subject)), time.monotonic()
        time.sleep(WINDOW_S)
        n1, t1 = asyncio.run(stored(server.url, reg, subject)), time.monotonic()
        slow = asyncio.run(stored(server.url, reg, reg.rewards("slow")))
        rate = (n1 - n0) / (t1 - t0)
        console.print(
            f"{name:>15}: {rate:7.1f} quick rewards/s ({n1 - n0} in {t1 - t0:.0f} s; slow rewards so far {slow})"
        )
        return {
            "quick_rewards_per_s": round(rate, 2),
            "quick_rewards": n1 - n0,
            "window_s": round(t1 - t0, 1),
            "slow_rewards_total": slow,
        }
    finally:
        stop_procs(procs)
        server.stop()


def main() -> int:
    console = Console()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-pools-") as tmp:
        for name, config in SCENARIOS.items():
            results[name] = run_scenario(name, config, Path(tmp), console)
    ours = results["mixed_pools"]["quick_rewards_per_s"]
    peer = results["short_only"]["quick_rewards_per_s"]
    out = {
        "benchmark": "pools",
        "unit": "0.1 s-task rewards/s",
        "ours": ours,
        "peer": peer,
        "ratio": round(ours / peer, 3) if peer else None,
        "target": ">= 0.8",
        "contrast_one_pool": results["mixed_one_pool"]["quick_rewards_per_s"],
        "scenarios": results,
        "short_task_s": SHORT_S,
        "long_task_s": LONG_S,
        "warmup_s": WARMUP_S,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = ROOT / "bench" / "results" / "pools.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    table = Table("run", "0.1 s-task rewards/s")
    for name, r in results.items():
        table.add_row(name, f"{r['quick_rewards_per_s']:.1f}")
    console.print(table)
    console.print(f"ratio mixed_pools / short_only = {out['ratio']} (target >= 0.8) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
