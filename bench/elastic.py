"""Elastic rollout pool without Kubernetes, simulated (issue 34, item 3): KEDA's formula on a real run.

What it does (run with no arguments: `python bench/elastic.py`; about 2.5 minutes):
- One embedded nats-server with its monitoring port, and the REAL worker processes of one run:
  `rlbus worker learner` (policy "null"), `rlbus worker verifier` (the `constant` verifier) and a pool
  of `rlbus worker rollout` processes (engine `sleep`: a batch of `sleep`-domain tasks takes
  `TASK_S` seconds), each started the way `rlbus up` starts a role.
- The tidal load: this bench is the task source (no sampler process). It publishes `sleep` tasks
  exactly as the sampler does (the domain's own `make_task`, the check in KV, the task on TASKS, a
  `published` ledger record so the run's accounting sees every task), at a rate that follows
  `TIDE`: 1x (`LOW_RATE` tasks/s) and 10x (`HIGH_RATE`) phases. The sampler itself has no arrival
  rate (it keeps `max_inflight_tasks` in flight, a gate, not a tide), so the bench stands in for
  the world that sends tasks. Honest and simple: the rate is exact, phases are wall-clock.
- The autoscaler (`Autoscaler`), every `POLL_S`: reads `/jsz?consumers=true`, takes each rollout
  pool consumer's `num_pending + num_ack_pending` (the consumers and names `rlbus k8s render` puts
  in the ScaledObject), and the target is `rlbus.deploy.k8s.expected_replicas` (KEDA/HPA:
  ceil(backlog / lagThreshold) clamped to [min, max]; the largest over the pool's consumers, as HPA
  takes the largest over metrics). Scale-up is immediate; scale-down waits until the target has been
  lower for `STABILIZE_S` (HPA's scale-down stabilization window, 300 s by default, compressed here)
  and then stops the newest worker with SIGTERM, as a kubelet does: the worker finishes its batch,
  acks it and exits; one still running after `GRACE_S` (terminationGracePeriodSeconds) is SIGKILLed,
  and its unacked tasks are redelivered after ack_wait.
- After the tide, the bench waits for the pipeline to drain, stops every worker and reads the run's
  accounting (`rlbus.run.accounting.account`, what `rlbus up` writes into summary.json): lost and
  trained twice must be 0.
Writes bench/results/elastic.json (the timeline and the figures) and bench/results/elastic.png
(replicas and backlog against time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.subjects import Registry
from rlbus.deploy import k8s
from schemas.config.deploy import PoolScaling

TASK_S = 2.0
"""Wall time of one task's episode (the `sleep` domain's `seconds`)."""
BATCH = 2
"""Tasks per rollout batch: one worker does BATCH / TASK_S = 1 task/s."""
LOW_RATE, HIGH_RATE = 0.4, 4.0
"""Task arrival, tasks/s: 1x and 10x (10x needs 4 workers of 1 task/s)."""
TIDE = [("low", 15.0), ("high", 35.0), ("low", 35.0), ("high", 25.0), ("low", 20.0)]
"""(phase, seconds): the tide."""
POLL_S = 2.0
"""Autoscaler period (KEDA's pollingInterval; the render's default is 15 s)."""
STABILIZE_S = 10.0
"""Scale-down stabilization window (HPA's default 300 s, compressed for a short run)."""
GRACE_S = 40.0
"""SIGTERM to SIGKILL (the render's terminationGracePeriodSeconds)."""
SCALING = PoolScaling(min_replicas=1, max_replicas=6, lag_threshold=4)
"""The pool's `deploy.rollout` (min, max, lagThreshold)."""


def config_text(task_s: float = TASK_S, batch: int = BATCH, ack_wait_s: float = 60.0) -> str:
    """The run config: sleep tasks, the sleep engine, constant verifier, null learner."""
    return f"""
[sampler]
group_size = 2
[sampler.domains.tide]
kind = "sleep"
params = {{ seconds = {task_s} }}
[rollout]
engine = "sleep"
batch_tasks = {batch}
ack_wait_s = {ack_wait_s}
[verifier]
concurrency = 0
[learner]
policy = "null"
groups_per_step = 2
step_window_s = 0.5
max_staleness = 100000
checkpoint_every = 1000000
"""


def jsz_consumers(monitor_url: str) -> dict[tuple[str, str], dict]:
    """(stream, consumer) -> the consumer's `/jsz?consumers=true` record."""
    with urllib.request.urlopen(f"{monitor_url}/jsz?consumers=true", timeout=5) as resp:
        data = json.load(resp)
    return {
        (s["name"], c["name"]): c
        for a in data.get("account_details") or []
        for s in a.get("stream_detail") or []
        for c in s.get("consumer_detail") or []
    }


def pool_backlogs(monitor_url: str, reg: Registry, pools) -> dict[str, int]:
    """Consumer -> num_pending + num_ack_pending of every rollout pool consumer (0 before it exists)."""
    consumers = jsz_consumers(monitor_url)
    out = {}
    for pool in pools:
        spec = reg.rollout_consumer(pool=pool)
        c = consumers.get((spec.stream, spec.durable)) or {}
        out[spec.durable] = int(c.get("num_pending", 0)) + int(c.get("num_ack_pending", 0))
    return out


@dataclass
class Workers:
    """`rlbus worker ROLE` processes of one run (each its own session and log file)."""

    tmp: Path
    config: Path
    nats_url: str
    run_id: str
    procs: dict[str, list[subprocess.Popen]] = field(default_factory=dict)
    terminating: list[tuple[subprocess.Popen, float]] = field(default_factory=list)
    exits: list[dict] = field(default_factory=list)
    started: int = 0

    def start(self, role: str) -> subprocess.Popen:
        self.started += 1
        log = open(self.tmp / f"{role}-{self.started}.log", "wb")
        cmd = [sys.executable, "-m", "rlbus.cli", "worker", role, "--config", str(self.config)]
        cmd += ["--run-id", self.run_id, "--run-dir", str(self.tmp / "runs")]
        env = dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_NATS_URL=self.nats_url, OMP_WAIT_POLICY="PASSIVE")
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        log.close()
        self.procs.setdefault(role, []).append(p)
        return p

    def running(self, role: str) -> list[subprocess.Popen]:
        return [p for p in self.procs.get(role, []) if p.poll() is None and p not in self.draining()]

    def draining(self) -> list[subprocess.Popen]:
        return [p for p, _ in self.terminating]

    def stop_one(self, role: str, sig: int = signal.SIGTERM) -> subprocess.Popen | None:
        """Stop the newest running worker of `role` (SIGTERM: it drains; SIGKILL: its tasks are redelivered)."""
        alive = self.running(role)
        if not alive:
            return None
        p = alive[-1]
        os.killpg(p.pid, sig)
        self.terminating.append((p, time.monotonic()))
        return p

    def reap(self, grace_s: float = GRACE_S) -> None:
        """Forget workers that exited; SIGKILL those past their grace period."""
        keep = []
        for p, since in self.terminating:
            rc = p.poll()
            if rc is not None:
                self.exits.append({"pid": p.pid, "rc": rc, "drain_s": round(time.monotonic() - since, 2)})
                continue
            if time.monotonic() - since > grace_s:
                os.killpg(p.pid, signal.SIGKILL)
            keep.append((p, since))
        self.terminating = keep

    def stop_all(self, timeout: float = 30.0) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for procs in self.procs.values():
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


class Autoscaler:
    """KEDA's formula on `/jsz`, applied by starting and stopping `rlbus worker rollout` processes."""

    def __init__(
        self,
        workers: Workers,
        monitor_url: str,
        reg: Registry,
        pools,
        scaling: PoolScaling = SCALING,
        stabilize_s: float = STABILIZE_S,
        stop_signal: int = signal.SIGTERM,
    ):
        self.workers, self.monitor_url, self.reg, self.pools, self.scaling = workers, monitor_url, reg, pools, scaling
        self.stabilize_s, self.stop_signal = stabilize_s, stop_signal
        self.lower_since: float | None = None

    def target(self) -> tuple[int, int]:
        """(backlog of the pool's consumers summed, KEDA's target: the largest over its consumers)."""
        backlogs = pool_backlogs(self.monitor_url, self.reg, self.pools)
        want = max(k8s.expected_replicas(b, self.scaling) for b in backlogs.values())
        return sum(backlogs.values()), want

    def step(self) -> dict:
        """One poll: read the backlog, scale toward the target; what was seen and done."""
        self.workers.reap()
        backlog, want = self.target()
        have = len(self.workers.running("rollout"))
        action = ""
        if want > have:
            for _ in range(want - have):
                self.workers.start("rollout")
            self.lower_since, action = None, f"+{want - have}"
        elif want < have:
            now = time.monotonic()
            self.lower_since = self.lower_since or now
            if now - self.lower_since >= self.stabilize_s:
                for _ in range(have - want):
                    self.workers.stop_one("rollout", self.stop_signal)
                self.lower_since, action = None, f"-{have - want}"
        else:
            self.lower_since = None
        return {
            "backlog": backlog,
            "target": want,
            "replicas": len(self.workers.running("rollout")),
            "draining": len(self.workers.terminating),
            "action": action,
        }


class TaskSource:
    """Publishes `sleep` tasks as the sampler does (task, check, `published` ledger record)."""

    def __init__(self, js, reg: Registry, cfg):
        from producers.domains import make_sources

        self.js, self.reg, self.cfg = js, reg, cfg
        sources, _ = make_sources(reg.run_id, cfg)
        self.domain, self.source = next(iter(sources.items()))
        self.rng = random.Random(0)
        self.published = 0
        self.checks: dict[str, bytes] = {}

    async def publish(self, n: int) -> None:
        from bus.checks import put_checks
        from bus.publish import publish, publish_many
        from schemas import TaskFate, TaskFates

        if n <= 0:
            return
        tasks = [self.source.make_task(self.rng, 1, self.published + i).task for i in range(n)]
        await put_checks(self.js, self.reg, tasks, self.checks)
        await publish_many(self.js, [(self.reg.tasks(t.domain, t.pool), t) for t in tasks])
        fates = [TaskFate(task_msg_id=t.msg_id, fate="published") for t in tasks]
        await publish(
            self.js, self.reg.ledger("sampler"), TaskFates(run_id=self.reg.run_id, stage="sampler", fates=fates)
        )
        self.published += n


async def learner_done(js, reg: Registry) -> int:
    """Tasks the learner consumed so far (KV learner progress)."""
    from bus.kv import LEARNER_PROGRESS, get_json

    progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
    return int(progress.get("tasks_done", 0))


async def settle(js, reg: Registry, monitor_url: str, published: int, timeout: float) -> bool:
    """Until the learner consumed every published task and no consumer holds work (True), or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        consumers = jsz_consumers(monitor_url)
        held = sum(int(c.get("num_pending", 0)) + int(c.get("num_ack_pending", 0)) for c in consumers.values())
        if held == 0 and await learner_done(js, reg) >= published:
            return True
        await asyncio.sleep(0.5)
    return False


async def accounting(url: str, reg: Registry) -> dict:
    """The run's accounting (`rlbus.run.accounting.account`): fates, lost, trained twice."""
    from bus.conn import connect
    from rlbus.run.accounting import account

    nc = await connect(url, name="bench-elastic-accounting")
    try:
        acc = await account(nc.jetstream(timeout=30), reg)
    finally:
        await nc.close()
    return {**acc.counts(), "published": len(acc.published), "trained_twice": acc.trained_twice}


def phase_at(tide, elapsed: float) -> tuple[str | None, float]:
    """(phase name, arrival rate in tasks/s) of the tide `elapsed` seconds in; (None, 0) after it."""
    start = 0.0
    for name, seconds in tide:
        if elapsed < start + seconds:
            return name, HIGH_RATE if name == "high" else LOW_RATE
        start += seconds
    return None, 0.0


async def ride(source: TaskSource, scaler: Autoscaler, tide, timeline: list[dict]) -> None:
    """Publish tasks at the tide's rate (exact on average: fractions carry over), poll the autoscaler
    every POLL_S, until the tide ends."""
    t0 = last = next_poll = time.monotonic()
    owed = 0.0
    while True:
        now = time.monotonic()
        phase, rate = phase_at(tide, now - t0)
        owed += rate * (now - last)
        last = now
        if int(owed) > 0:
            await source.publish(int(owed))
            owed -= int(owed)
        if now >= next_poll:
            row = scaler.step()
            row.update(t=round(now - t0, 1), phase=phase or "drain", rate=rate, published=source.published)
            timeline.append(row)
            print(json.dumps(row), flush=True)
            next_poll += POLL_S
        if phase is None:
            return
        await asyncio.sleep(0.1)


async def run_tide(tmp: Path, tide=TIDE) -> dict:
    from bus.conn import connect, ensure_topology
    from bus.server import EmbeddedNats, free_port
    from schemas.config import load_config

    run_id = f"elastic{os.getpid()}"
    cfg_path = tmp / "elastic.toml"
    cfg_path.write_text(config_text())
    cfg = load_config(cfg_path)
    reg = Registry(run_id)
    server = EmbeddedNats(tmp / "nats", monitor_port=free_port()).start()
    workers = Workers(tmp, cfg_path, server.url, run_id)
    nc = await connect(server.url, name="bench-elastic")
    js = nc.jetstream(timeout=30)
    timeline: list[dict] = []
    try:
        await ensure_topology(js, reg)
        for role in ("learner", "verifier", "rollout"):
            workers.start(role)
        scaler = Autoscaler(workers, server.monitor_url, reg, list(cfg.rollout.pools))
        source = TaskSource(js, reg, cfg)
        # the first trajectory needs a loaded weight version: wait until the pool consumer exists
        deadline = time.monotonic() + 120
        spec = reg.rollout_consumer()
        while (spec.stream, spec.durable) not in jsz_consumers(server.monitor_url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rollout consumer in 120 s; see {tmp}/*.log")
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await ride(source, scaler, tide, timeline)
        tide_s = time.monotonic() - t0
        # drain: keep polling the scaler (it scales down as the backlog empties) until all is trained
        settled = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            row = scaler.step()
            row.update(t=round(time.monotonic() - t0, 1), phase="drain", rate=0.0, published=source.published)
            timeline.append(row)
            if await settle(js, reg, server.monitor_url, source.published, POLL_S):
                settled = True
                break
        workers.stop_all()
        acc = await accounting(server.url, reg)
        return {
            "timeline": timeline,
            "tide_s": round(tide_s, 1),
            "settled": settled,
            "accounting": acc,
            "rollout_started": sum(1 for _ in workers.procs.get("rollout", [])),
            "scale_down_exits": workers.exits,
            "published": source.published,
        }
    finally:
        workers.stop_all()
        await nc.close()
        server.stop()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    t = [r["t"] for r in tl]
    fig, ax1 = plt.subplots(figsize=(9, 4.5))
    ax1.step(t, [r["replicas"] for r in tl], where="post", color="tab:blue", label="rollout replicas (running)")
    ax1.step(t, [r["target"] for r in tl], where="post", color="tab:blue", ls=":", label="KEDA target")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("replicas", color="tab:blue")
    ax1.set_ylim(0, SCALING.max_replicas + 1)
    ax2 = ax1.twinx()
    ax2.plot(t, [r["backlog"] for r in tl], color="tab:red", label="backlog (num_pending + num_ack_pending)")
    ax2.set_ylabel("backlog (tasks)", color="tab:red")
    x = 0.0
    for name, seconds in TIDE:
        if name == "high":
            ax1.axvspan(x, x + seconds, color="0.9", zorder=0)
        x += seconds
    acc = result["accounting"]
    ax1.set_title(
        f"elastic rollout pool: tide {LOW_RATE}/{HIGH_RATE} tasks/s (grey = 10x), lagThreshold "
        f"{SCALING.lag_threshold}; lost {acc['lost']}, trained twice {acc['trained_twice']}",
        fontsize=9,
    )
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(result: dict) -> dict:
    """Figures per tide phase: replicas (mean, max) and backlog (mean, max)."""
    phases = []
    x = 0.0
    for name, seconds in TIDE:
        rows = [r for r in result["timeline"] if x <= r["t"] < x + seconds and r["phase"] != "drain"]
        if rows:
            phases.append(
                {
                    "phase": name,
                    "from_s": x,
                    "to_s": x + seconds,
                    "rate_tasks_per_s": HIGH_RATE if name == "high" else LOW_RATE,
                    "replicas_mean": round(sum(r["replicas"] for r in rows) / len(rows), 2),
                    "replicas_max": max(r["replicas"] for r in rows),
                    "replicas_end": rows[-1]["replicas"],
                    "backlog_mean": round(sum(r["backlog"] for r in rows) / len(rows), 1),
                    "backlog_max": max(r["backlog"] for r in rows),
                }
            )
        x += seconds
    return {"phases": phases}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's command line: it has no knobs but where the results go."""
    ap = argparse.ArgumentParser(
        description=(
            "A rollout pool scaled by KEDA's nats-jetstream formula (pending + ack pending of the "
            "TASKS consumer over lagThreshold, clamped to min/max) under a 1x/10x tidal task load; "
            "scale-down stops a worker by SIGTERM (it drains). Reports replicas and backlog per phase, "
            "lost and trained twice (both must be 0); about 2.5 minutes."
        )
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for elastic.json/.png")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-elastic-") as tmp:
        result = asyncio.run(run_tide(Path(tmp)))
    acc = result["accounting"]
    out = {
        "benchmark": "elastic",
        "command": "python bench/elastic.py",
        "task_s": TASK_S,
        "batch_tasks": BATCH,
        "rates_tasks_per_s": {"low": LOW_RATE, "high": HIGH_RATE},
        "tide": TIDE,
        "poll_s": POLL_S,
        "stabilize_s": STABILIZE_S,
        "scaling": SCALING.model_dump(),
        "lost": acc["lost"],
        "trained_twice": acc["trained_twice"],
        **summarize(result),
        **result,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    results = args.out
    results.mkdir(parents=True, exist_ok=True)
    (results / "elastic.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(result, results / "elastic.png")
    for p in out["phases"]:
        print(
            f"{p['phase']:>4} {p['from_s']:5.0f}-{p['to_s']:5.0f} s @ {p['rate_tasks_per_s']} tasks/s: replicas mean "
            f"{p['replicas_mean']} max {p['replicas_max']} end {p['replicas_end']}, backlog mean {p['backlog_mean']} "
            f"max {p['backlog_max']}"
        )
    print(f"accounting: {acc}; settled {result['settled']}; scale-down exits {result['scale_down_exits']}")
    print(f"-> {results / 'elastic.json'}, {results / 'elastic.png'}")
    return 0 if acc["lost"] == 0 and acc["trained_twice"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
