"""Long-tail benchmark (issue 31 item 4): three sides in one run on a heavy-tailed workload.

Run: `python bench/long_tail.py [--seconds 60]` (about 3 x (seconds + 25 s)).

Workload: the `sleep` domain (`producers.domains.sleep`) on the REAL worker processes (`rlbus
worker sampler|rollout|verifier|learner`, one embedded nats-server per side; rollout engine
`sleep`, verifier `constant`, learner `policy="null"`): 90 % of episodes take `SHORT_S`, 10 % take
10x that, and 5 % of episodes are multi-turn tool episodes (3 turns with a 1 s slow tool each,
modelled as episode time: the sleep engine has no tools). The sides:

- `defaults`: today's defaults (`rollout.inflight.enabled = false`, `rollout.priority` as default);
- `inflight_priority`: `rollout.inflight.enabled = true` + `rollout.priority.enabled = true`;
- `sync`: the synchronous baseline (what TRL does): `learner.max_staleness = 0`, so the sampler
  holds one step's tasks in flight (`groups_per_step x publish_every x 1`) and the learner drops
  any sample older than its current version: one version per batch, wait for all of it.

`defaults` and `inflight_priority` run at the same `max_staleness` (`STALENESS`).

Per side, over the `seconds` after the learner's first step (derivation in the functions below;
inputs: the learner's `learner.step` log events and the REWARDS stream, read back at the end):
- trained samples/s: `learner.progress` `samples_trained` delta / window;
- learner idle fraction (`learner_idle`): the time between consecutive steps beyond
  `step_window_s`, over the window (the null learner's step costs ~0 s, so this is the time it
  waited for data);
- rollout idle around version boundaries (`rollout_idle_near_versions`): the share of the time
  within +-`BOUNDARY_S` of each version's step during which the rollout worker ran no engine
  batch (batches rebuilt from the trajectories: `batch_intervals`);
- staleness p50/p99: the learner's version at a reward's arrival (its newest `learner.step`
  event by then) minus its trajectory's oldest version (`Trajectory.oldest_version`, what the
  learner's gate counts), clamped at 0 (a version's first rewards can beat its log line);
- group completion latency p50/p99: a group's last reward time minus the start of the engine
  batch that generated it (so: the batch's wait on its slowest episode plus verification; the
  time a task queued in TASKS before a worker took it is not included).

Writes bench/results/long_tail.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import start_roles, stop_procs

RESULT = ROOT / "bench" / "results" / "long_tail.json"
SHORT_S, STALENESS, STEP_WINDOW_S, BOUNDARY_S = 0.2, 4, 0.5, 1.0
WORKLOAD = {
    "seconds": SHORT_S,
    "long_fraction": 0.1,
    "long_factor": 10,
    "tool_fraction": 0.05,
    "tool_turns": 3,
    "tool_seconds": 1.0,
}
SIDES = {
    "defaults": {"inflight": False, "priority": True, "max_staleness": STALENESS},
    "inflight_priority": {"inflight": True, "priority": True, "max_staleness": STALENESS},
    "sync": {"inflight": False, "priority": True, "max_staleness": 0},
}
CONFIG = """
[sampler]
group_size = 4
max_inflight_tasks = 64
publish_batch = 16
[sampler.domains.tail]
kind = "sleep"
params = {params}
[rollout]
engine = "sleep"
batch_tasks = 4
[rollout.inflight]
enabled = {inflight}
chunk_tokens = 1
[rollout.priority]
enabled = {priority}
[verifier]
concurrency = 0
[learner]
policy = "null"
groups_per_step = 4
step_window_s = {window}
max_staleness = {staleness}
checkpoint_every = 1000000
"""


def config_text(side: dict) -> str:
    """The run config of one side."""
    params = "{ " + ", ".join(f"{k} = {v}" for k, v in WORKLOAD.items()) + " }"
    return CONFIG.format(
        params=params,
        inflight=str(side["inflight"]).lower(),
        priority=str(side["priority"]).lower(),
        window=STEP_WINDOW_S,
        staleness=side["max_staleness"],
    )


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s) - 1e-9) - 1))
    return s[k]


def learner_idle(step_times: list[float], t0: float, t1: float, window_s: float) -> float:
    """Share of [t0, t1] the learner waited beyond its step window: sum over the gaps between
    consecutive steps (t0 and t1 bound the first and last gap) of max(0, gap - window_s)."""
    if t1 <= t0:
        raise ValueError("empty window")
    points = [t0, *sorted(t for t in step_times if t0 < t < t1), t1]
    waited = sum(max(0.0, b - a - window_s) for a, b in zip(points, points[1:], strict=False))
    return waited / (t1 - t0)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def rollout_idle_near(busy: list[tuple[float, float]], boundaries: list[float], half: float) -> float | None:
    """Share of the time within +-half of each boundary (windows merged) when no busy interval ran."""
    windows = [(t - half, t + half) for t in boundaries]
    if not windows:
        return None
    merged: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    covered = sum(b - a for a, b in merged)
    clipped = [(max(a, wa), min(b, wb)) for a, b in busy for wa, wb in merged if min(b, wb) > max(a, wa)]
    return 1.0 - union_length(clipped) / covered


def batch_intervals(rewards: list[dict], gap_s: float = 0.05) -> list[tuple[float, float]]:
    """The rollout worker's engine batches as [(start, end)]: the trajectories of one batch are
    built together (their `traj_at` within `gap_s` of the previous one), and each carries its
    share of the batch's time (`gen_s` = batch seconds / episodes), so a batch ran for the sum of
    its members' `gen_s` up to its last `traj_at`."""
    out: list[tuple[float, float]] = []
    members: list[dict] = []
    for r in sorted(rewards, key=lambda r: r["traj_at"]):
        if members and r["traj_at"] - members[-1]["traj_at"] > gap_s:
            out.append((members[-1]["traj_at"] - sum(m["gen_s"] for m in members), members[-1]["traj_at"]))
            members = []
        members.append(r)
    if members:
        out.append((members[-1]["traj_at"] - sum(m["gen_s"] for m in members), members[-1]["traj_at"]))
    return out


def batch_starts(rewards: list[dict]) -> dict[str, float]:
    """{group_id: start of the engine batch that generated it} (see `batch_intervals`)."""
    starts: dict[str, float] = {}
    for a, b in batch_intervals(rewards):
        for r in rewards:
            if a < r["traj_at"] <= b + 1e-9:
                starts[r["group_id"]] = min(starts.get(r["group_id"], a), a)
    return starts


def version_at(steps: list[tuple[float, int]], t: float) -> int:
    """The learner's newest version stepped by time t (0 before any)."""
    v = 0
    for ts, ver in steps:
        if ts <= t:
            v = max(v, ver)
    return v


def derive(steps: list[tuple[float, int]], rewards: list[dict], t0: float, t1: float, samples: int) -> dict:
    """The side's figures over [t0, t1] from its step events [(time, version)] and rewards
    (dicts: created_at (the reward's), traj_at and gen_s (its trajectory's created_at and
    generate_seconds), oldest_version, group_id), `samples` trained in the window."""
    inside = [r for r in rewards if t0 <= r["created_at"] <= t1]
    # a version's first rewards can arrive before its `learner.step` line is logged: clamped at 0
    stale = [max(0, version_at(steps, r["created_at"]) - r["oldest_version"]) for r in inside]
    groups: dict[str, list[dict]] = {}
    for r in rewards:
        groups.setdefault(r["group_id"], []).append(r)
    start = batch_starts(rewards)
    latency = [
        max(r["created_at"] for r in g) - start[gid]
        for gid, g in groups.items()
        if t0 <= max(r["created_at"] for r in g) <= t1
    ]
    boundaries = [ts for ts, _ in steps if t0 <= ts <= t1]
    busy = batch_intervals(rewards)
    rnd = lambda x, n=3: None if x is None else round(x, n)
    return {
        "trained_samples_per_s": round(samples / (t1 - t0), 2),
        "learner_idle": rnd(learner_idle([ts for ts, _ in steps], t0, t1, STEP_WINDOW_S)),
        "rollout_idle_near_versions": rnd(rollout_idle_near(busy, boundaries, BOUNDARY_S)),
        "staleness_p50": percentile(stale, 50),
        "staleness_p99": percentile(stale, 99),
        "group_latency_p50_s": rnd(percentile(latency, 50), 2),
        "group_latency_p99_s": rnd(percentile(latency, 99), 2),
        "steps": len(boundaries),
        "rewards": len(inside),
        "groups": len(latency),
    }


def step_times(learner_log: Path) -> list[tuple[float, int]]:
    """[(time, version)] of the run's `learner.step` events."""
    from bench.e2e_runs import step_events

    return [(datetime.fromisoformat(e["timestamp"]).timestamp(), int(e["version"])) for e in step_events(learner_log)]


async def progress(js, reg) -> int:
    from bus.kv import LEARNER_PROGRESS, get_json

    return int(((await get_json(js, reg, LEARNER_PROGRESS)) or {}).get("samples_trained", 0))


async def read_rewards(js, reg) -> list[dict]:
    """Every reward in the run's REWARDS stream, reduced to what `derive` needs."""
    from schemas.episode import Reward
    from schemas.messages import decode

    out = []
    sub = await js.pull_subscribe(reg.all("rewards"), None, stream=reg.stream("REWARDS"))
    while True:
        try:
            msgs = await sub.fetch(512, timeout=1.0)
        except Exception:  # noqa: BLE001 - a fetch timeout ends the read
            break
        for m in msgs:
            r = decode(m.data, Reward)
            t = r.trajectory
            out.append(
                {
                    "created_at": r.created_at,
                    "traj_at": t.created_at,
                    "gen_s": t.generate_seconds,
                    "oldest_version": t.oldest_version,
                    "group_id": t.group_id,
                }
            )
    await sub.unsubscribe()
    return out


async def measure(url: str, run_id: str, seconds: float, procs: list) -> dict:
    """Wait for the first step, then `seconds` of training; samples trained and the rewards.
    A worker process that exits before the end fails the side (its log says why)."""
    from bus.conn import connect, ensure_topology
    from bus.subjects import Registry

    reg = Registry(run_id)
    nc = await connect(url, name="bench-long-tail")
    js = nc.jetstream(timeout=10)
    try:
        await ensure_topology(js, reg)
        deadline = time.monotonic() + 120

        def check() -> None:
            dead = [" ".join(p.args[3:5]) for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"worker process exited early: {dead} (see its log)")

        while await progress(js, reg) == 0:
            check()
            if time.monotonic() > deadline:
                raise RuntimeError("the learner did not step within 120 s")
            await asyncio.sleep(0.2)
        n0, t0 = await progress(js, reg), time.time()
        await asyncio.sleep(seconds)
        n1, t1 = await progress(js, reg), time.time()
        check()
        return {"t0": t0, "t1": t1, "samples": n1 - n0, "rewards": await read_rewards(js, reg)}
    finally:
        await nc.close()


def run_side(name: str, side: dict, tmp: Path, seconds: float) -> dict:
    """One side: its own server and worker processes; the derived figures."""
    from bus.server import EmbeddedNats
    from schemas.config import load_config

    run_id = f"lt{name.replace('_', '')}{os.getpid()}"
    cfg_path = tmp / f"{name}.toml"
    cfg_path.write_text(config_text(side))
    load_config(cfg_path)  # a config error stops here, before any process starts
    server = EmbeddedNats(tmp / f"nats-{name}").start()
    procs = []
    try:
        procs += start_roles(cfg_path, server.url, run_id, tmp / "runs", tmp / name)
        m = asyncio.run(measure(server.url, run_id, seconds, procs))
    finally:
        stop_procs(procs)
        server.stop()
    steps = step_times(tmp / f"{name}-learner.log")
    out = derive(steps, m["rewards"], m["t0"], m["t1"], m["samples"])
    out["inflight_reloads"] = (tmp / f"{name}-rollout.log").read_text(errors="replace").count("rollout.inflight_reload")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per side, after its first step")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of " + ",".join(SIDES))
    ap.add_argument("--out", default=str(RESULT))
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-longtail-") as d:
        for name in a.sides.split(","):
            results[name] = run_side(name, SIDES[name], Path(d), a.seconds)
            print(name, json.dumps(results[name]), flush=True)
    rate = {k: v["trained_samples_per_s"] for k, v in results.items()}
    ratio = lambda x, y: round(rate[x] / rate[y], 3) if x in rate and rate.get(y) else None
    out = {
        "benchmark": "long_tail",
        "command": f"python bench/long_tail.py --seconds {a.seconds:g}",
        "unit": "trained samples/s over the window after each side's first learner step",
        "sides": results,
        "side_configs": SIDES,
        "ratio_inflight_priority_vs_defaults": ratio("inflight_priority", "defaults"),
        "ratio_inflight_priority_vs_sync": ratio("inflight_priority", "sync"),
        "goal": "inflight_priority >= 1.3x defaults, learner_idle <= 0.10, >= 2x sync",
        "workload": WORKLOAD,
        "max_staleness": STALENESS,
        "seconds_per_side": a.seconds,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {load0[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(
        json.dumps(
            {k: out[k] for k in ("ratio_inflight_priority_vs_defaults", "ratio_inflight_priority_vs_sync", "machine")}
        )
    )
    return out


if __name__ == "__main__":
    main()
