"""Worker telemetry: heartbeats on core NATS and Prometheus `/metrics`.

## Heartbeats (`metrics.<run>.<role>.<id>`)

Guarantees: publishing telemetry never blocks or fails the work; a failed publish is
logged and skipped. Values are the live `counters` dict of the worker.

## Names, defined here only

Every counter name a reader of heartbeats uses (the launcher's monitor and summary.json,
`rlbus status`, `rlbus top`, the benches, the scheduler's cost table) is a constant of
this module, and every stage (a role's main throughput counter and its unit) a row of
`STAGES`; `tests/test_layers.py` fails on such a name spelled as a literal where
heartbeats are read in `rlbus/` or `bench/`. A renamed counter is one edit here, not
three dashboards reading zeros.

## Reading heartbeats

`Heartbeats` is the one reader: the newest heartbeat of every worker of a run (core NATS
subscription: consumes nothing), with per-role sums, growth since first seen, and rates;
`listen(nc, reg, seconds)` gathers one for a fixed window (see `Heartbeats` for its
guarantees).

## Prometheus

Prometheus `/metrics` of one worker, read live from its `session.counters` dict.

Every worker already keeps its counters in one dict (`Session.counters`, also published
as heartbeats by `bus.telemetry`); this module exposes the same numbers over HTTP:

    rlbus_up{role,worker}                             1 while the process serves
    rlbus_messages_processed_total{role,worker,what}  the role's main throughput counter
    rlbus_outcomes_total{role,worker,outcome}         ack / retry / reject / dead_lettered
    rlbus_errors_total{role,worker,kind}              infra errors, rejected weights, ...
    rlbus_learner_step / rlbus_weight_version         learner step; weights a worker holds
    rlbus_reward_mean{role,worker}                    learner's last step, or verifier's running mean
    rlbus_inflight{role,worker}                       sampler's in-flight tasks, open sandbox sessions
    rlbus_counter{role,worker,name}                   every numeric counter, as a gauge

Rates are Prometheus' job: `rate(rlbus_messages_processed_total[1m])`.

Guarantees:
- Values are read at scrape time from the live dict (no copies drift); a non-numeric
  value is skipped, never an error; scraping never blocks the worker's event loop (the
  server runs in a daemon thread).
- `start_metrics_server(role, counters, port)` returns the bound port, or None when
  metrics are off (port 0 and no `RLBUS_METRICS_PORT`). With several workers on one host
  it takes the first free port from `port` upward (up to `port + PORT_SPAN - 1`) and
  records it in `counters["metrics_port"]`, so heartbeats (`rlbus top`) show where to scrape.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from bus.subjects import Registry
from schemas import DecodeError, Metric, decode, encode

log = structlog.get_logger()


def worker_id(role: str) -> str:
    """A process-unique id: role-host-pid."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:24]
    return f"{role}-{host}-{os.getpid()}"


async def report_forever(nc, reg: Registry, role: str, counters: dict[str, float], every: float = 1.0) -> None:
    """Publish `counters` every `every` seconds until cancelled."""
    wid = worker_id(role)
    subject = reg.metrics(role, wid)
    while True:
        t = os.times()
        counters[CPU_SECONDS] = t.user + t.system  # this process's CPU so far (the run store's cost)
        try:
            await nc.publish(
                subject,
                encode(
                    Metric(
                        run_id=reg.run_id,
                        role=role,
                        worker_id=wid,
                        values=dict(counters),
                        host=socket.gethostname(),
                        pid=os.getpid(),
                    )
                ),
            )
        except Exception as exc:  # noqa: BLE001 - telemetry must never take the worker down
            log.warning("telemetry.publish_failed", error=str(exc))
        await asyncio.sleep(every)


# -- counter names (keys of `Metric.values`, i.e. of each worker's `Session.counters`) ----------
PUBLISHED = "published"  # sampler: tasks published
TASKS = "tasks"  # rollout: tasks taken
TRAJECTORIES = "trajectories"  # rollout: trajectories published
REWARDS = "rewards"  # verifier: rewards published
REWARD_SUM = "reward_sum"  # verifier: sum of its rewards (with REWARDS: the running mean)
REWARD_MEAN = "reward_mean"  # learner: mean reward of its last step
SAMPLES_TRAINED = "samples_trained"  # learner: samples trained on
TASKS_DONE = "tasks_done"  # learner: task groups whose fate is recorded
EVALS = "evals"  # scheduler: evaluations done
RECORDED_REWARDS = "recorded_rewards"  # scheduler: rewards written to the run store
EXECS = "execs"  # sandbox service: commands executed
SESSIONS_OPENED = "sessions_opened"  # sandbox service: sessions opened
TOKENS = "tokens"  # rollout: tokens generated
TOKENS_TRAINED = "tokens_trained"  # learner: tokens trained on
BUSY_S = "busy_s"  # rollout: seconds spent rolling out
WEIGHTS_LOADED = "weights_loaded"  # rollout: weight versions hot-loaded
CURRICULUM_VERSION = "curriculum_version"  # scheduler's curriculum service: updates written
CPU_SECONDS = "cpu_seconds"  # every worker: its process's user+system CPU so far (set by `report_forever`)
GPU_SECONDS = "gpu_seconds"  # a worker that measures its GPU time
METRICS_PORT = "metrics_port"  # a worker serving /metrics: the port it bound (set by `start_metrics_server`)

PROCESSED = {
    "sampler": (PUBLISHED,),
    "rollout": (TASKS, TRAJECTORIES),
    "verifier": (REWARDS,),
    "learner": (SAMPLES_TRAINED, TASKS_DONE),
    "scheduler": (EVALS, RECORDED_REWARDS),
    "sandbox": (EXECS, SESSIONS_OPENED),
}
OUTCOMES = ("ack", "retry", "reject", "dead_lettered")
ERRORS = (
    "infra_errors",
    "weights_rejected",
    "undecodable",
    "foreign",
    "duplicates",
    "errors",
    "max_deliveries_dead_lettered",
    "gate_waits",
    "check_forged",
)
INFLIGHT = ("inflight", "sessions_open")
TOKEN_COUNTER = {"rollout": TOKENS, "learner": TOKENS_TRAINED}
"""The tokens a role's cost is counted in (the run store's `costs`): rollout generated, learner trained."""
COUNTERS = frozenset(
    {
        PUBLISHED,
        TASKS,
        TRAJECTORIES,
        REWARDS,
        REWARD_SUM,
        REWARD_MEAN,
        SAMPLES_TRAINED,
        TASKS_DONE,
        EVALS,
        RECORDED_REWARDS,
        EXECS,
        SESSIONS_OPENED,
        TOKENS,
        TOKENS_TRAINED,
        BUSY_S,
        WEIGHTS_LOADED,
        CURRICULUM_VERSION,
        CPU_SECONDS,
        GPU_SECONDS,
        METRICS_PORT,
        *ERRORS,
        *INFLIGHT,
    }
)
"""Every counter name defined here (what the literal check of `tests/test_layers.py` looks for)."""


@dataclass(frozen=True)
class Stage:
    """A role's main throughput counter, as the dashboards show it."""

    role: str
    counter: str
    """The heartbeat counter that grows with the role's work."""
    unit: str
    """What one unit of it is, as `rlbus top` labels its rate (`tasks/s`, `traj/s`, ...)."""
    pipeline: bool = True
    """One of the training pipeline's four stages (always shown; summary.json's totals, `rlbus status`, benches)."""


STAGES: tuple[Stage, ...] = (
    Stage("sampler", PUBLISHED, "tasks"),
    Stage("rollout", TRAJECTORIES, "traj"),
    Stage("verifier", REWARDS, "rewards"),
    Stage("learner", SAMPLES_TRAINED, "samples"),
    Stage("sandbox", EXECS, "execs", pipeline=False),
    Stage("scheduler", EVALS, "evals", pipeline=False),
)
STAGE_COUNTER: dict[str, str] = {s.role: s.counter for s in STAGES if s.pipeline}
"""The pipeline's stages in order (sampler, rollout, verifier, learner) -> their main counter."""
_STAGE_OF = {s.role: s.counter for s in STAGES}


class Heartbeats:
    """The newest heartbeat of every worker of one run: the one heartbeat reader.

    Guarantees:
    - `add` and `on_msg` never raise: an undecodable message is skipped, and so is one of
      another run when `run_id` is given. Subscribing (`subscribe`, `listen`) is a core
      subscription to `metrics.<run>.>`: it consumes nothing.
    - `latest[worker_id]` = (wall time it arrived, Metric) of the worker's newest heartbeat.
      A restarted worker is a new id, so a role's sums include its predecessors' last
      counters (what the run did and spent, restarts included).
    - `first[worker_id]` = the worker's counters in the first heartbeat this reader saw
      (`gain`: the growth over the listening window).
    - `last_seen[pid]` = monotonic time of that process's last heartbeat (the launcher's hang watch).
    - `rate(worker)` = growth per second of the worker's stage counter (`STAGES`) over the
      last `window` seconds; 0.0 with fewer than two points or no stage.
    - An absent counter reads as 0.0.
    """

    def __init__(self, run_id: str | None = None, window: float = 10.0):
        self.run_id, self.window = run_id, window
        self.latest: dict[str, tuple[float, Metric]] = {}
        self.first: dict[str, dict[str, float]] = {}
        self.last_seen: dict[int, float] = {}
        self._history: dict[str, deque[tuple[float, float]]] = defaultdict(lambda: deque(maxlen=256))

    def add(self, m: Metric, now: float | None = None) -> None:
        """Take one heartbeat (`now`: its arrival wall time, default the clock)."""
        if self.run_id is not None and m.run_id != self.run_id:
            return
        now = time.time() if now is None else now
        self.latest[m.worker_id] = (now, m)
        self.first.setdefault(m.worker_id, dict(m.values))
        if m.pid:
            self.last_seen[m.pid] = time.monotonic()
        counter = _STAGE_OF.get(m.role)
        if counter:
            self._history[m.worker_id].append((now, float(m.values.get(counter, 0.0))))

    async def on_msg(self, raw) -> None:
        """A core-NATS callback: decode and `add` (undecodable messages skipped)."""
        try:
            m = decode(raw.data, Metric)
        except DecodeError:
            return
        if isinstance(m, Metric):
            self.add(m)

    async def subscribe(self, nc, reg: Registry):
        """Subscribe to every heartbeat of `reg`'s run; returns the subscription."""
        return await nc.subscribe(reg.metrics(), cb=self.on_msg)

    def metrics(self, role: str | None = None) -> list[Metric]:
        """Newest heartbeat per worker (of `role`, or all), sorted by (role, worker id)."""
        out = [m for _, m in self.latest.values() if role is None or m.role == role]
        return sorted(out, key=lambda m: (m.role, m.worker_id))

    def role_sum(self, role: str, counter: str) -> float:
        """`counter` summed over the role's workers (their newest heartbeats)."""
        return float(sum(m.values.get(counter, 0.0) for m in self.metrics(role)))

    def role_sums(self, counter: str) -> dict[str, float]:
        """role -> `counter` summed over those of its workers that report it."""
        out: dict[str, float] = {}
        for m in self.metrics():
            if counter in m.values:
                out[m.role] = out.get(m.role, 0.0) + float(m.values[counter])
        return out

    def per_role(self) -> dict[str, dict[str, float]]:
        """role -> every counter summed over the role's workers."""
        out: dict[str, dict[str, float]] = {}
        for m in self.metrics():
            agg = out.setdefault(m.role, {})
            for k, v in m.values.items():
                agg[k] = agg.get(k, 0.0) + float(v)
        return out

    def stage_totals(self) -> dict[str, float]:
        """Pipeline stage (role) -> its main counter summed over its workers, for stages with a worker seen."""
        return {role: self.role_sum(role, counter) for role, counter in STAGE_COUNTER.items() if self.metrics(role)}

    def gain(self, role: str, counter: str) -> float:
        """How much `counter` grew over the role's workers since this reader first saw each."""
        return float(
            sum(
                m.values.get(counter, 0.0) - self.first.get(m.worker_id, {}).get(counter, 0.0)
                for m in self.metrics(role)
            )
        )

    def rate(self, worker: str) -> float:
        """The worker's stage counter per second over the last `window` seconds."""
        points = [p for p in self._history.get(worker, ()) if p[0] >= time.time() - self.window]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return 0.0
        return max(0.0, (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0]))

    def role_rate(self, role: str) -> float:
        """`rate` summed over the role's workers."""
        return sum(self.rate(m.worker_id) for m in self.metrics(role))

    async def wait_for(self, predicate: Callable[[Metric], bool], timeout: float, poll: float = 0.05) -> bool:
        """True as soon as a newest heartbeat satisfies `predicate`, False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if any(predicate(m) for m in self.metrics()):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll)


async def listen(nc, reg: Registry, seconds: float, window: float = 10.0) -> tuple[Heartbeats, float]:
    """The run's heartbeats gathered for `seconds`, and the seconds actually listened."""
    beats = Heartbeats(reg.run_id, window)
    sub = await beats.subscribe(nc, reg)
    t0 = time.monotonic()
    try:
        await asyncio.sleep(seconds)
    finally:
        await sub.unsubscribe()
    return beats, time.monotonic() - t0


ENV_PORT, ENV_ADDR = "RLBUS_METRICS_PORT", "RLBUS_METRICS_ADDR"
PORT_SPAN = 64
_NAME = re.compile(r"[^a-zA-Z0-9_:]")


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class CountersCollector:
    """A prometheus_client collector over a live counters dict."""

    def __init__(self, role: str, worker: str, counters: dict):
        self.role, self.worker, self.counters = role, worker, counters

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = {k: v for k, v in dict(self.counters).items() if _num(v) is not None}
        base = ["role", "worker"]
        ids = [self.role, self.worker]
        up = GaugeMetricFamily("rlbus_up", "1 while the worker serves metrics", labels=base)
        up.add_metric(ids, 1.0)
        yield up
        groups = (
            ("rlbus_messages_processed", "Messages/items a role has processed", "what", PROCESSED.get(self.role, ())),
            ("rlbus_outcomes", "Handler outcomes of pulled messages", "outcome", OUTCOMES),
            ("rlbus_errors", "Errors and rejections by kind", "kind", ERRORS),
        )
        for name, doc, label, keys in groups:
            fam = CounterMetricFamily(name, doc, labels=base + [label])
            for key in keys:
                if key in c:
                    fam.add_metric(ids + [key], c[key])
            yield fam
        gauges = (
            ("rlbus_learner_step", "Learner step", ("step",)),
            ("rlbus_weight_version", "Weight version this worker produced or holds", ("version", "weight_version")),
            ("rlbus_inflight", "In-flight work (sampler tasks, open sandbox sessions)", INFLIGHT),
        )
        for name, doc, keys in gauges:
            fam = GaugeMetricFamily(name, doc, labels=base)
            for key in keys:
                if key in c:
                    fam.add_metric(ids, c[key])
                    break
            yield fam
        reward = GaugeMetricFamily(
            "rlbus_reward_mean", "Mean reward (learner: last step; verifier: running)", labels=base
        )
        if REWARD_MEAN in c:
            reward.add_metric(ids, c[REWARD_MEAN])
        elif c.get(REWARDS):
            reward.add_metric(ids, c.get(REWARD_SUM, 0.0) / c[REWARDS])
        yield reward
        every = GaugeMetricFamily(
            "rlbus_counter", "Every numeric counter of the worker, as a gauge", labels=base + ["name"]
        )
        for key, value in sorted(c.items()):
            every.add_metric(ids + [_NAME.sub("_", key)], value)
        yield every


def resolve_port(port: int | None) -> int:
    """The port to serve on: `RLBUS_METRICS_PORT` if set, else `port` (0 = off)."""
    env = os.environ.get(ENV_PORT, "").strip()
    return int(env) if env else int(port or 0)


def start_metrics_server(role: str, counters: dict, port: int | None, worker: str | None = None) -> int | None:
    """Serve the worker's counters on `/metrics`; return the bound port (None when off).

    A fixed port from `RLBUS_METRICS_PORT` must be free (OSError otherwise); a configured
    base port is searched upward for a free one.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    from bus.telemetry import worker_id

    fixed = bool(os.environ.get(ENV_PORT, "").strip())
    base = resolve_port(port)
    if base <= 0:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CountersCollector(role, worker or worker_id(role), counters))
    addr = os.environ.get(ENV_ADDR, "0.0.0.0")
    last: OSError | None = None
    for candidate in [base] if fixed else range(base, min(base + PORT_SPAN, 65536)):
        try:
            start_http_server(candidate, addr=addr, registry=registry)
        except OSError as exc:
            last = exc
            continue
        counters[METRICS_PORT] = candidate
        log.info("metrics.serving", role=role, port=candidate, thread=threading.current_thread().name)
        return candidate
    raise OSError(f"no free metrics port in {base}..{base + (0 if fixed else PORT_SPAN - 1)} on {addr}: {last}")
