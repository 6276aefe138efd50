"""`rlbus status`: where a run stands, read from the bus alone.

Guarantees:
- Reads only: KV `learner.progress`, stream and consumer state, and the workers'
  telemetry (each `Metric` is a heartbeat with role, id, host and pid). It consumes
  nothing and changes nothing.
- Rates are measured over the listening window from the workers' own counters (heartbeats
  read by `bus.telemetry.listen`; stages and their counters are `bus.telemetry.STAGE_COUNTER`).
- Finds the run when not told: the single run folder under `--run-dir` whose launcher
  is alive (`RunFolder.find_active`), or the single run whose streams exist on the server
  (`rlbus.run.server.only_run`); otherwise it exits naming what to pass.
- `--json` prints exactly one JSON line (the record `collect` returns); without it, two
  tables.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from bus import telemetry
from bus.conn import connect
from bus.kv import LEARNER_PROGRESS, get_json
from bus.subjects import Registry
from rlbus.run.folder import RunNotFound, find_run
from rlbus.run.server import only_run


async def collect(nats_url: str, run_id: str | None, listen: float = 2.5) -> dict:
    """The status record: run, step, version, per-stage depth and rate, workers."""
    nc = await connect(nats_url, name="rlbus-status")
    try:
        js = nc.jetstream(timeout=10)
        run_id = run_id or await only_run(js)
        reg = Registry(run_id)
        beats, elapsed = await telemetry.listen(nc, reg, listen)
        progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
        stages: dict[str, dict] = {}
        for role, counter in telemetry.STAGE_COUNTER.items():
            stages[role] = {
                "workers": len(beats.metrics(role)),
                "total": beats.role_sum(role, counter),
                "rate_per_s": round(beats.gain(role, counter) / max(elapsed, 1e-6), 2),
            }
        for family, role in (("TASKS", "rollout"), ("TRAJ", "verifier")):
            stages[role]["queue_depth"] = (await js.stream_info(reg.stream(family))).state.messages
        ci = await js.consumer_info(reg.stream("REWARDS"), "learner")
        stages["learner"]["queue_depth"] = ci.num_pending + ci.num_ack_pending
        stages["dlq"] = {"messages": (await js.stream_info(reg.stream("DLQ"))).state.messages}
        workers = [
            {
                "role": m.role,
                "id": m.worker_id,
                "host": m.host,
                "pid": m.pid,
                "last_heartbeat": round(beats.latest[m.worker_id][0], 3),
            }
            for m in beats.metrics()
        ]
        return {
            "run_id": run_id,
            "step": int(progress.get("step", 0)),
            "weight_version": int(progress.get("version", 0)),
            "stages": stages,
            "workers": workers,
        }
    finally:
        await nc.close()


def render(status: dict):
    """A rich table of the status record."""
    from rich.table import Table

    t = Table(
        title=f"run {status['run_id']}: step {status['step']}, weight version {status['weight_version']}",
        title_justify="left",
    )
    for col in ("stage", "workers", "rate/s", "total", "queue depth"):
        t.add_column(col, justify="right" if col != "stage" else "left")
    for role in telemetry.STAGE_COUNTER:
        st = status["stages"][role]
        t.add_row(
            role, str(st["workers"]), f"{st['rate_per_s']:,.1f}", f"{st['total']:,.0f}", str(st.get("queue_depth", "-"))
        )
    t.add_row("dlq", "", "", f"{status['stages']['dlq']['messages']}", "")
    w = Table(title="workers", title_justify="left")
    for col in ("role", "id", "host", "pid", "last heartbeat (s ago)"):
        w.add_column(col)
    now = time.time()
    for wk in status["workers"]:
        w.add_row(wk["role"], wk["id"], wk["host"], str(wk["pid"]), f"{now - wk['last_heartbeat']:.1f}")
    return t, w


def main(args) -> int:
    """Entry point of `rlbus status`."""
    from rich.console import Console

    try:
        run_id, url = find_run(Path(args.run_dir) if args.run_dir else None, args.run_id, args.nats_url)
        if not url:
            raise RunNotFound("pass --nats-url, or --run-dir to read it from the run's run.json")
        status = asyncio.run(collect(url, run_id, args.listen))
    except RunNotFound as exc:
        sys.exit(f"rlbus status: {exc}")
    if args.json:
        print(json.dumps(status))
    else:
        for table in render(status):
            Console().print(table)
    return 0


def register(sub) -> None:
    """Add `rlbus status` to the CLI's subparsers."""
    st = sub.add_parser(
        "status",
        help="where a run stands: step, version, stage rates and depths, workers",
        description="Read a run's state from the bus (consumes nothing). Without --run-id: the single "
        "active run under --run-dir, or the single run on the server.",
    )
    st.add_argument("--run-dir", help="parent folder of runs, as with `up` (finds the server URL in run.json)")
    st.add_argument("--nats-url", help="NATS server URL")
    st.add_argument("--run-id", help="run id")
    st.add_argument("--json", action="store_true", help="print exactly one JSON line")
    st.add_argument("--listen", type=float, default=2.5, help="seconds to listen for heartbeats and rates")
    st.set_defaults(func=main)
