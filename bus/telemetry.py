"""Worker telemetry: heartbeats on core NATS and Prometheus `/metrics`.

## Heartbeats (`metrics.<run>.<role>.<id>`)

Guarantees: publishing telemetry never blocks or fails the work; a failed publish is
logged and skipped. Values are the live `counters` dict of the worker.

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

import structlog

from bus.subjects import Registry
from schemas import Metric, encode

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
        counters["cpu_seconds"] = t.user + t.system  # this process's CPU so far (the run store's cost)
        try:
            await nc.publish(subject, encode(Metric(run_id=reg.run_id, role=role, worker_id=wid, values=dict(counters),
                                                    host=socket.gethostname(), pid=os.getpid())))
        except Exception as exc:  # noqa: BLE001 - telemetry must never take the worker down
            log.warning("telemetry.publish_failed", error=str(exc))
        await asyncio.sleep(every)

ENV_PORT, ENV_ADDR = "RLBUS_METRICS_PORT", "RLBUS_METRICS_ADDR"
PORT_SPAN = 64

PROCESSED = {"sampler": ("published",), "rollout": ("tasks", "trajectories"), "verifier": ("rewards",),
             "learner": ("samples_trained", "tasks_done"), "scheduler": ("evals", "recorded_rewards"),
             "sandbox": ("execs", "sessions_opened")}
OUTCOMES = ("ack", "retry", "reject", "dead_lettered")
ERRORS = ("infra_errors", "weights_rejected", "undecodable", "foreign", "duplicates", "errors",
          "max_deliveries_dead_lettered", "gate_waits", "check_forged")
INFLIGHT = ("inflight", "sessions_open")
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
        groups = (("rlbus_messages_processed", "Messages/items a role has processed", "what",
                   PROCESSED.get(self.role, ())),
                  ("rlbus_outcomes", "Handler outcomes of pulled messages", "outcome", OUTCOMES),
                  ("rlbus_errors", "Errors and rejections by kind", "kind", ERRORS))
        for name, doc, label, keys in groups:
            fam = CounterMetricFamily(name, doc, labels=base + [label])
            for key in keys:
                if key in c:
                    fam.add_metric(ids + [key], c[key])
            yield fam
        gauges = (("rlbus_learner_step", "Learner step", ("step",)),
                  ("rlbus_weight_version", "Weight version this worker produced or holds", ("version", "weight_version")),
                  ("rlbus_inflight", "In-flight work (sampler tasks, open sandbox sessions)", INFLIGHT))
        for name, doc, keys in gauges:
            fam = GaugeMetricFamily(name, doc, labels=base)
            for key in keys:
                if key in c:
                    fam.add_metric(ids, c[key])
                    break
            yield fam
        reward = GaugeMetricFamily("rlbus_reward_mean", "Mean reward (learner: last step; verifier: running)", labels=base)
        if "reward_mean" in c:
            reward.add_metric(ids, c["reward_mean"])
        elif c.get("rewards"):
            reward.add_metric(ids, c.get("reward_sum", 0.0) / c["rewards"])
        yield reward
        every = GaugeMetricFamily("rlbus_counter", "Every numeric counter of the worker, as a gauge",
                                  labels=base + ["name"])
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
        counters["metrics_port"] = candidate
        log.info("metrics.serving", role=role, port=candidate, thread=threading.current_thread().name)
        return candidate
    raise OSError(f"no free metrics port in {base}..{base + (0 if fixed else PORT_SPAN - 1)} on {addr}: {last}")
