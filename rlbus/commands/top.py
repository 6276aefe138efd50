"""`rlbus top`: a live terminal dashboard of one run, read from the bus alone.

Panels: per-stage throughput (the workers' heartbeat counters of `bus.telemetry.STAGES`, read
by `bus.telemetry.Heartbeats`), stream depths and
every consumer's lag (pending, ack-pending, redelivered, waiting pulls), dead letters,
recent reward and latest eval per domain, learner step and weight version, a staleness
histogram (current version minus each recent reward's oldest token version, `Trajectory.oldest_version`), and the
workers' heartbeats (age, host, pid, metrics port).

Guarantees:
- Reads only, with what the read-only `monitor` NATS user may do: core subscription to
  `metrics.<run>.>`, JetStream info/list requests, direct gets of stored REWARDS/EVAL
  messages and of KV `run-<run>`. It creates no consumer and acknowledges nothing.
- `--once` prints exactly one frame as plain text (no escape codes) and exits 0;
  without it, the frame refreshes in place (rich Live) until Ctrl-C.
- A missing stream, consumer or key shows as `-`, never as an error.
- However many domains, the domain panel has at most `--top` rows (default 10; 0 = all):
  the domains with the largest curriculum weight (KV `curriculum`; else the most recent
  rewards), then one row counting the rest with their summed weight and recent rewards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict
from pathlib import Path

from bus.kv import CURRICULUM, LEARNER_PROGRESS, get_json
from bus.subjects import Registry
from bus.telemetry import METRICS_PORT, STAGE_COUNTER, STAGES, Heartbeats
from schemas import DecodeError, EvalResult, Reward, decode

FAMILIES = ("TASKS", "TRAJ", "REWARDS", "WEIGHTS", "EVAL", "DLQ", "LEDGER")
STALENESS_BUCKETS = ("0", "1", "2", "3", "4+", "unknown")

EPILOG = """examples:
  rlbus top --run-dir runs                          # the single active run under runs/
  rlbus top --nats-url nats://host:4222 --run-id R  # any server; as the read-only monitor user:
  RLBUS_NATS_USER=monitor RLBUS_NATS_PASSWORD=... rlbus top --nats-url tls://host:4222 --run-id R
  rlbus top --once --run-dir runs > frame.txt       # one frame as text (for scripts, CI logs)
"""


async def _recent(js, stream: str, limit: int, kind):
    """Up to `limit` most recent decodable messages of `stream` (newest last), by direct get."""
    try:
        info = await js.stream_info(stream)
    except Exception:  # noqa: BLE001 - a dashboard shows what it can read
        return []
    out, seq = [], info.state.last_seq
    while seq >= max(info.state.first_seq, 1) and len(out) < limit:
        try:
            raw = await js.get_msg(stream, seq)
            out.append(decode(raw.data, kind))
        except DecodeError:
            pass
        except Exception:  # noqa: BLE001 - gap (deleted message) or permission: skip it
            pass
        seq -= 1
    return out[::-1]


async def collect_frame(js, reg: Registry, beats: Heartbeats, recent: int = 256) -> dict:
    """One dashboard frame as plain data (what `render` draws and tests assert on)."""
    progress = await get_json(js, reg, LEARNER_PROGRESS) or {}
    version = int(progress.get("version", 0))
    streams, consumers = {}, []
    for family in FAMILIES:
        name = reg.stream(family)
        try:
            info = await js.stream_info(name)
        except Exception:  # noqa: BLE001 - a dashboard shows what it can read
            streams[family] = None
            continue
        streams[family] = info.state.messages
        try:
            for ci in await js.consumers_info(name):
                consumers.append(
                    {
                        "stream": family,
                        "name": ci.name,
                        "pending": ci.num_pending,
                        "ack_pending": ci.num_ack_pending,
                        "redelivered": ci.num_redelivered,
                        "waiting": ci.num_waiting,
                    }
                )
        except Exception:  # noqa: BLE001 - a dashboard shows what it can read
            pass
    rewards = await _recent(js, reg.stream("REWARDS"), recent, Reward)
    by_domain: dict[str, list[float]] = defaultdict(list)
    staleness = dict.fromkeys(STALENESS_BUCKETS, 0)
    for r in rewards:
        by_domain[r.trajectory.domain].append(r.reward)
        if r.trajectory.policy_version < 0:
            staleness["unknown"] += 1  # an episode without a model turn records no version
            continue
        lag = max(0, version - r.trajectory.oldest_version)  # from its oldest token, as the learner counts
        staleness[str(lag) if lag < 4 else "4+"] += 1
    evals: dict[str, EvalResult] = {}
    for e in await _recent(js, reg.stream("EVAL"), max(128, 2 * len(by_domain)), EvalResult):
        if e.domain not in evals or e.version >= evals[e.domain].version:
            evals[e.domain] = e
    cur = await get_json(js, reg, CURRICULUM) or {}
    now = time.time()
    stages = {
        st.role: {
            "workers": len(beats.metrics(st.role)),
            "unit": st.unit,
            "total": beats.role_sum(st.role, st.counter),
            "rate_per_s": round(beats.role_rate(st.role), 2),
        }
        for st in STAGES
    }
    workers = [
        {
            "role": m.role,
            "id": m.worker_id,
            "host": m.host,
            "pid": m.pid,
            "age_s": round(now - beats.latest[m.worker_id][0], 1),
            "metrics_port": int(m.values[METRICS_PORT]) if METRICS_PORT in m.values else None,
        }
        for m in beats.metrics()
    ]
    return {
        "run_id": reg.run_id,
        "time": now,
        "step": int(progress.get("step", 0)),
        "version": version,
        "stages": stages,
        "streams": streams,
        "consumers": consumers,
        "dead_letters": streams.get("DLQ"),
        "rewards": {d: {"n": len(v), "mean": sum(v) / len(v)} for d, v in sorted(by_domain.items())},
        "evals": {
            d: {"version": e.version, "score": e.score, "n": e.n, "purpose": e.purpose}
            for d, e in sorted(evals.items())
        },
        "curriculum": {
            "version": cur.get("version"),
            "weights": cur.get("weights") or {},
            "levels": cur.get("levels") or {},
        },
        "staleness": staleness,
        "workers": workers,
    }


def _dash(x, fmt="{}"):
    return "-" if x is None else fmt.format(x)


def domain_rows(frame: dict, top: int = 10) -> tuple[list[str], dict | None]:
    """The domains the panel shows (at most `top`; 0 = all), ordered by curriculum weight,
    then recent rewards, then name; and what the rest sum to (None when nothing is left out):
    {"domains", "rewards", "weight"}."""
    cur = frame.get("curriculum") or {}
    weights = cur.get("weights") or {}
    names = set(frame["rewards"]) | set(frame["evals"]) | set(weights)
    ranked = sorted(names, key=lambda d: (-float(weights.get(d, 0.0)), -frame["rewards"].get(d, {}).get("n", 0), d))
    shown, rest = (ranked, []) if top <= 0 else (ranked[:top], ranked[top:])
    if not rest:
        return shown, None
    return shown, {
        "domains": len(rest),
        "rewards": sum(frame["rewards"].get(d, {}).get("n", 0) for d in rest),
        "weight": sum(float(weights.get(d, 0.0)) for d in rest),
    }


def domain_table(frame: dict, top: int = 10):
    """The domain panel: recent reward, latest eval (and its purpose), curriculum weight and
    level of the top domains, then one row for the rest."""
    from rich.table import Table

    levels = (frame.get("curriculum") or {}).get("levels") or {}
    weights = (frame.get("curriculum") or {}).get("weights") or {}
    shown, rest = domain_rows(frame, top)
    title = "reward and eval by domain" + (
        f" (top {len(shown)} of {len(shown) + rest['domains']} by weight)" if rest else ""
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "domain",
        "recent rewards",
        "reward mean",
        "eval score",
        "eval version",
        "eval purpose",
        "weight",
        "level",
    ):
        table.add_column(col, justify="left" if col in ("domain", "eval purpose") else "right")
    for d in shown:
        r, e = frame["rewards"].get(d, {}), frame["evals"].get(d, {})
        table.add_row(
            d,
            _dash(r.get("n")),
            _dash(r.get("mean"), "{:.3f}"),
            _dash(e.get("score"), "{:.3f}"),
            _dash(e.get("version")),
            _dash(e.get("purpose")),
            _dash(weights.get(d), "{:.3f}"),
            _dash(levels.get(d)),
        )
    if rest:
        table.add_row(f"(+{rest['domains']} more)", str(rest["rewards"]), "", "", "", "", f"{rest['weight']:.3f}", "")
    return table


def render(frame: dict, top: int = 10):
    """A rich renderable (tables in a grid) of one frame; the domain panel shows `top` domains."""
    from rich.console import Group
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[b]rlbus top[/b]  run {frame['run_id']}",
        f"step {frame['step']}",
        f"weight version {frame['version']}",
        f"dead letters {_dash(frame['dead_letters'])}",
        time.strftime("%H:%M:%S", time.localtime(frame["time"])),
    )

    stages = Table(title="stages", title_justify="left")
    for col in ("stage", "workers", "rate/s", "total"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for role, st in frame["stages"].items():
        if st["workers"] or role in STAGE_COUNTER:  # the pipeline's stages always show
            stages.add_row(role, str(st["workers"]), f"{st['rate_per_s']:,.1f} {st['unit']}/s", f"{st['total']:,.0f}")

    lag = Table(title="consumer lag", title_justify="left")
    for col in ("stream", "stored", "consumer", "pending", "ack pending", "redelivered", "waiting"):
        lag.add_column(col, justify="left" if col in ("stream", "consumer") else "right")
    seen = set()
    for c in frame["consumers"]:
        stored = "" if c["stream"] in seen else _dash(frame["streams"].get(c["stream"]))
        seen.add(c["stream"])
        lag.add_row(
            c["stream"],
            stored,
            c["name"],
            str(c["pending"]),
            str(c["ack_pending"]),
            str(c["redelivered"]),
            str(c["waiting"]),
        )
    for family, n in frame["streams"].items():
        if family not in seen:
            lag.add_row(family, _dash(n), "-", "", "", "", "")

    quality = domain_table(frame, top)

    stale = Table(title="staleness (versions behind, recent rewards)", title_justify="left")
    stale.add_column("behind")
    stale.add_column("rewards", justify="right")
    stale.add_column("", justify="left")
    total = max(1, sum(frame["staleness"].values()))
    for bucket, n in frame["staleness"].items():
        stale.add_row(bucket, str(n), "#" * round(30 * n / total))

    workers = Table(title="workers (heartbeats)", title_justify="left")
    for col in ("role", "id", "host", "pid", "last beat", "metrics port"):
        workers.add_column(col)
    for w in frame["workers"]:
        workers.add_row(
            w["role"], w["id"], w["host"], str(w["pid"]), f"{w['age_s']:.1f}s ago", _dash(w["metrics_port"])
        )
    return Group(head, stages, lag, quality, stale, workers)


async def _run(
    url: str, run_id: str | None, once: bool, interval: float, listen: float, recent: int, top: int = 10
) -> int:
    from rich.console import Console
    from rich.live import Live

    from bus.conn import connect
    from rlbus.run.server import only_run

    nc = await connect(url, name="rlbus-top")
    try:
        js = nc.jetstream(timeout=10)
        reg = Registry(run_id or await only_run(js))
        beats = Heartbeats(reg.run_id, window=max(3 * interval, listen, 5.0))
        await beats.subscribe(nc, reg)
        await asyncio.sleep(listen)
        if once:
            Console(width=120, no_color=True, force_terminal=False).print(
                render(await collect_frame(js, reg, beats, recent), top)
            )
            return 0
        with Live(render(await collect_frame(js, reg, beats, recent), top), auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(interval)
                live.update(render(await collect_frame(js, reg, beats, recent), top), refresh=True)
    finally:
        await nc.close()


def main(args) -> int:
    """Entry point of `rlbus top`."""
    from rlbus.run.folder import RunNotFound, find_run

    try:
        run_id, url = find_run(Path(args.run_dir) if args.run_dir else None, args.run_id, args.nats_url)
        if not url:
            raise RunNotFound("pass --nats-url, or --run-dir to read it from the run's run.json")
        return asyncio.run(_run(url, run_id, args.once, args.interval, args.listen, args.recent, args.top))
    except RunNotFound as exc:
        sys.exit(f"rlbus top: {exc}")
    except KeyboardInterrupt:
        return 0


def register(sub) -> None:
    """Add `rlbus top` to the CLI's subparsers."""
    p = sub.add_parser(
        "top",
        help="live dashboard: stage rates, consumer lag, DLQ, rewards/evals, staleness, workers",
        description="A live terminal dashboard of one run, read from the bus (consumes nothing; works "
        "with the read-only `monitor` NATS user). Without --run-id: the single active run "
        "under --run-dir, or the single run on the server.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--run-dir", help="parent folder of runs, as with `up` (finds the server URL in run.json)")
    p.add_argument(
        "--nats-url",
        help="NATS server URL (credentials/TLS: RLBUS_NATS_USER, RLBUS_NATS_PASSWORD, RLBUS_NATS_TLS_CA ...)",
    )
    p.add_argument("--run-id", help="run id")
    p.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--listen", type=float, default=2.5, help="seconds of heartbeats to gather before the first frame")
    p.add_argument("--recent", type=int, default=256, help="recent rewards read for the domain/staleness panels")
    p.add_argument(
        "--top",
        type=int,
        default=10,
        help="domains shown in the domain panel, by curriculum weight "
        "(default 10; 0 = all); the rest are counted in one row",
    )
    p.set_defaults(func=main)
