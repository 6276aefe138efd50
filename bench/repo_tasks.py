"""Repo-task benchmark: verified repository tasks/s through the real `repo` verifier vs plain pytest.

Run: `python bench/repo_tasks.py [--workers 2] [--concurrency 1] [--runs 2] [--limit N] [--quick]`.

What it measures:

- TASKS: the committed task cache (`producers.repo_cache.list_tasks`, 24 AST mutants of
  inflection 0.5.1 / toolz 1.0.0) plus the hand-written fixtures (`producers.repo_fixtures`,
  4). Every task gives two jobs: its gold patch (must score `resolved` = 1) and an empty
  patch (the mutant left in place: must score `resolved` = 0). `--quick`: 2 tasks, 1 run.
- OURS: `--workers` (default 2) worker processes, each running the verifier worker's own
  scoring call (`verifier_workers.worker.score(traj, {"task": asdict(task)})`, i.e. the
  registered `repo` verifier exactly as `rlbus verify --domain repo` and a verifier worker
  call it; the diff travels as the trajectory's `diff` artifact) with `--concurrency`
  threads (default 1: 2 verifications at once in all), pulling jobs from one shared queue
  (as a shared durable consumer would hand them out). Every verification runs in a FRESH
  container (`sandbox_workers.docker_fresh`: never used before, removed after, one kept
  started ahead per process). Warm-up (not timed): worker start-up and one verification
  per worker thread. Rate = jobs / (time from releasing the workers to the last result).
  An infrastructure failure (`VerifierInfraError`) is retried twice, as the worker's nak
  would, and counted in `infra_retries`.
- PEER: the same jobs through PLAIN pytest in the same image, sequentially, with no
  isolation: ONE container of the image (no limits), one driver in it that writes each
  job's tree (the same tree the verifier builds: `verifier_workers.verifiers.repo.prepare`, i.e. the patch
  applied and the hidden tests copied in) under /tmp and runs
  `python -m pytest -q -p no:cacheprovider <the test files>` in it, in a loop; a job is
  resolved iff pytest exits 0. Rate = jobs / the driver's loop time (the one container's
  start is excluded: the favourable reading for the peer). Run right before and right
  after each of our rounds; the faster of the two is the round's baseline.
- SANDBOX: `start_s` = create + start of a fresh verifier container (p50/p90 over
  `--sandbox-samples`), `remove_s` its removal, `fresh_cost_s` = start + remove (what a
  fresh container costs per verification, paid by the pool's background threads);
  `reset_s` = `docker_pool.clean_container` (wipe + proof) of a used episode container of
  the same image (what a warm-pool reset costs instead); `overhead_s` = per verification,
  our wall time minus the harness's own setup + run time (host-side tree build, container
  hand-out, exec, read-back).

The headline (`ours`, `peer`, `ratio`) is the round with the LOWER ratio. Writes
bench/results/repo_tasks.json: ours, peer, unit "verified tasks/s", ratio (target >= 0.5),
resolved_gold and unresolved_mutants ("k/n"), n_tasks, sandbox times, load averages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import skip_unless

RESULT = ROOT / "bench" / "results" / "repo_tasks.json"
QUICK_TASKS = ("fixture-clamp", "inflection-0.5.1-m088dc866")
TARGET_RATIO = 0.5
INFRA_ATTEMPTS = 3
ROUND_RETRIES = 2  # rounds repeated after the engine went away mid-round (something else restarted it)
PEER_DRIVER = r"""
import json, os, subprocess, sys, time
jobs = json.loads(sys.stdin.buffer.read())
results = []
t_all = time.perf_counter()
for n, job in enumerate(jobs):
    t0 = time.perf_counter()
    root = "/tmp/peer/%d" % n
    for path, text in job["files"].items():
        p = os.path.join(root, path)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.join(root, x) for x in job["pythonpath"]))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *job["paths"]], cwd=root,
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results.append({"id": job["id"], "rc": r.returncode, "s": time.perf_counter() - t0,
                    "tail": r.stdout[-300:].decode("utf-8", "replace")})
print(json.dumps({"loop_s": time.perf_counter() - t_all, "results": results}))
"""


# ---------------------------------------------------------------- tasks and jobs
def select_tasks(quick: bool, limit: int) -> list:
    """The cached tasks + the fixtures (sorted by id); `quick`: QUICK_TASKS; `limit`: the first N."""
    from producers.repo_cache import list_tasks
    from producers.repo_fixtures import fixture_tasks

    tasks = {t.task_id: t for t in list_tasks()}
    tasks.update(fixture_tasks())
    if quick:
        return [tasks[tid] for tid in QUICK_TASKS]
    chosen = [tasks[k] for k in sorted(tasks)]
    return chosen[:limit] if limit else chosen


def make_jobs(tasks: list) -> list[dict]:
    """Two jobs per task, gold and empty, interleaved: {"id", "task", "kind", "diff"}."""
    jobs = []
    for i, task in enumerate(tasks):
        for kind, diff in (("gold", task.gold_patch), ("empty", "")):
            jobs.append({"id": f"{task.task_id}:{kind}", "task": i, "kind": kind, "diff": diff})
    return jobs


def _trajectory(task, diff: str):
    """The trajectory `rlbus verify --domain repo` builds: the diff as its `diff` artifact."""
    from schemas import Trajectory

    return Trajectory(
        run_id="bench",
        task_id=task.task_id,
        task_msg_id="bench",
        domain="repo",
        group_id="bench",
        group_size=1,
        sample_index=0,
        turns=[],
        verifier="repo",
        verifier_params={"problem_id": task.task_id},
        hidden_ref="bench",
        policy_version=0,
        final_text="",
        artifacts={"diff": diff.encode()},
    )


def _details_times(details: str) -> tuple[float | None, float | None]:
    """(setup_s, run_s) from the verdict's `(setup X s, run Y s)` line."""
    import re

    m = re.search(r"\(setup ([0-9.]+) s, run ([0-9.]+) s\)", details)
    return (float(m.group(1)), float(m.group(2))) if m else (None, None)


# ---------------------------------------------------------------- ours: verifier worker processes
def verify_job(task, job: dict) -> dict:
    """One job through `verifier_workers.worker.score`; infra failures retried (INFRA_ATTEMPTS)."""
    from verifier_workers.errors import VerifierInfraError
    from verifier_workers.worker import score

    payload = {"task": dataclasses.asdict(task)}
    t0 = time.perf_counter()
    for attempt in range(INFRA_ATTEMPTS):
        try:
            reward = score(_trajectory(task, job["diff"]), payload)
            break
        except VerifierInfraError as exc:
            if attempt == INFRA_ATTEMPTS - 1:
                return {
                    "id": job["id"],
                    "kind": job["kind"],
                    "error": str(exc)[:300],
                    "retries": attempt,
                    "s": time.perf_counter() - t0,
                }
    setup_s, run_s = _details_times(reward.details)
    return {
        "id": job["id"],
        "kind": job["kind"],
        "resolved": reward.components.get("resolved"),
        "status": reward.status,
        "s": time.perf_counter() - t0,
        "setup_s": setup_s,
        "run_s": run_s,
        "retries": attempt,
    }


def worker_main(tasks_json: list[str], concurrency: int, jobs_q, results_q, ready_q, go) -> None:
    """A verifier worker process: warm up, report ready, then verify jobs until a None per thread."""
    from sandbox_workers.docker_pool import shutdown_pools
    from schemas.repo_task import RepoTask

    tasks = [RepoTask.from_json(t) for t in tasks_json]
    warm = [
        threading.Thread(
            target=verify_job, args=(tasks[0], {"id": "warm", "kind": "gold", "diff": tasks[0].gold_patch})
        )
        for _ in range(concurrency)
    ]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    ready_q.put(os.getpid())
    go.wait()
    cpu0 = time.process_time()

    def loop() -> None:
        while (job := jobs_q.get()) is not None:
            results_q.put(verify_job(tasks[job["task"]], job))

    threads = [threading.Thread(target=loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results_q.put({"cpu_s": time.process_time() - cpu0})
    shutdown_pools()


def run_ours(tasks: list, jobs: list[dict], workers: int, concurrency: int, timeout: float = 1800.0) -> dict:
    """Jobs through `workers` processes x `concurrency` threads; rate over the timed part."""
    ctx = mp.get_context("spawn")
    jobs_q, results_q, ready_q, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    tasks_json = [t.to_json() for t in tasks]
    procs = [
        ctx.Process(target=worker_main, args=(tasks_json, concurrency, jobs_q, results_q, ready_q, go), daemon=True)
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready_q.get(timeout=600)
        for job in jobs:
            jobs_q.put(job)
        for _ in range(workers * concurrency):
            jobs_q.put(None)
        t0 = time.perf_counter()
        go.set()
        results, cpu, seconds = [], [], 0.0
        while len(results) < len(jobs) or len(cpu) < len(procs):
            msg = results_q.get(timeout=timeout)
            (cpu.append(msg["cpu_s"]) if "cpu_s" in msg else results.append(msg))
            if len(results) == len(jobs) and not seconds:
                seconds = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return {
        "seconds": round(seconds, 3),
        "rate": round(len(jobs) / seconds, 3),
        "results": results,
        "worker_cpu_s_per_job": round(sum(cpu) / len(jobs), 4),
    }


# ---------------------------------------------------------------- peer: plain pytest, one container
def peer_jobs(tasks: list, jobs: list[dict]) -> list[dict]:
    """The driver's input: each job's tree as the verifier builds it before its test files are rewritten
    for the harness's guard (plain pytest has no `_rlbus_guard`), and its test files."""
    from verifier_workers.verifiers.repo import prepare

    out = []
    for job in jobs:
        task = tasks[job["task"]]
        prep = prepare(task, job["diff"])
        files = {**(prep.patch.files if prep.patch.applied else task.files), **task.hidden_files}
        out.append({"id": job["id"], "files": files, "paths": prep.paths, "pythonpath": prep.pythonpath})
    return out


def run_peer(driver_jobs: list[dict], image: str, timeout: float = 1800.0) -> dict:
    """The driver in ONE started container of `image` (no limits, no isolation beyond docker's own)."""
    from sandbox_workers.base import HeadTailBuffer
    from sandbox_workers.docker_engine import get_client, remove_container
    from sandbox_workers.docker_pool import Exec

    client = get_client()
    t0 = time.perf_counter()
    cid = client.api.create_container(
        image=image,
        command=["sleep", "infinity"],
        user="65534:65534",
        working_dir="/tmp",
        network_disabled=True,
        host_config=client.api.create_host_config(network_mode="none"),
    )["Id"]
    try:
        client.api.start(cid)
        started = time.perf_counter() - t0
        ex = Exec(client.api, cid, ["python3", "-c", PEER_DRIVER], user="65534:65534", stdin=True)
        out, err = HeadTailBuffer(64 << 20), HeadTailBuffer(1 << 16)
        try:
            ex.send_stdin(json.dumps(driver_jobs).encode())
            if not ex.pump({1: out, 2: err}, time.monotonic() + timeout):
                raise RuntimeError(f"the peer driver ran past {timeout:.0f} s")
        finally:
            ex.close()
        report = json.loads(out.getvalue())
    finally:
        remove_container(client, cid)
    loop = report["loop_s"]
    return {
        "seconds": round(loop, 3),
        "rate": round(len(driver_jobs) / loop, 3),
        "container_start_s": round(started, 3),
        "wall_s": round(time.perf_counter() - t0, 3),
        "results": report["results"],
    }


# ---------------------------------------------------------------- sandbox start / reset times
def _pcts(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {
        "p50": round(statistics.median(xs), 4),
        "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 4),
        "n": len(xs),
    }


def measure_sandbox(image: str, samples: int) -> dict:
    """Fresh verifier containers: create+start and remove; episode containers: clean_container (reset)."""
    from sandbox_workers.base import Limits
    from sandbox_workers.docker_engine import get_client
    from sandbox_workers.docker_fresh import FreshPool
    from sandbox_workers.docker_pool import Exec, WarmPool, clean_container

    client, limits = get_client(), Limits(memory_mb=1024, pids=128, tmp_mb=256)
    fresh, plain = FreshPool(client, image, limits, 1.0, 0), WarmPool(client, image, limits, 1.0, 0)
    start, remove, reset = [], [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        box = fresh.create()
        start.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh.remove(box)
        remove.append(time.perf_counter() - t0)
    box = plain.create()
    try:
        for _ in range(samples):
            ex = Exec(client.api, box.id, ["python3", "-c", "open('/work/x', 'w').write('x')"], user="65534:65534")
            ex.pump({}, time.monotonic() + 30)
            ex.close()
            t0 = time.perf_counter()
            clean_container(client.api, box.id)
            reset.append(time.perf_counter() - t0)
    finally:
        plain.remove(box)
    fresh_cost = [a + b for a, b in zip(start, remove)]
    return {
        "start_s": _pcts(start),
        "remove_s": _pcts(remove),
        "fresh_cost_s": _pcts(fresh_cost),
        "reset_s": _pcts(reset),
    }


# ---------------------------------------------------------------- rounds and the summary
def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def judge(results: list[dict], ok_key: str) -> dict:
    """{gold: resolved k, empty: unresolved k, n per kind} from one side's results."""
    gold = [r for r in results if r["id"].endswith(":gold")]
    empty = [r for r in results if r["id"].endswith(":empty")]
    if ok_key == "rc":
        return {
            "resolved_gold": sum(r["rc"] == 0 for r in gold),
            "unresolved_mutants": sum(r["rc"] != 0 for r in empty),
            "n": len(gold),
        }
    return {
        "resolved_gold": sum(r.get("resolved") == 1.0 for r in gold),
        "unresolved_mutants": sum(r.get("resolved") == 0.0 for r in empty),
        "n": len(gold),
        "infra_errors": sum("error" in r for r in results),
        "infra_retries": sum(r["retries"] for r in results),
        "statuses": sorted({r.get("status", "infra_error") for r in results}),
    }


def one_round(tasks: list, jobs: list[dict], driver_jobs: list[dict], args) -> dict:
    """peer, ours, peer; the faster peer is the baseline."""
    load_before = _load()
    peer_a = run_peer(driver_jobs, args.image)
    ours = run_ours(tasks, jobs, args.workers, args.concurrency)
    peer_b = run_peer(driver_jobs, args.image)
    peer = max(peer_a, peer_b, key=lambda p: p["rate"])
    overhead = [r["s"] - r["setup_s"] - r["run_s"] for r in ours["results"] if r.get("run_s") is not None]
    return {
        "ours": ours["rate"],
        "peer": peer["rate"],
        "ratio": round(ours["rate"] / peer["rate"], 3),
        "ours_s": ours["seconds"],
        "peer_s": [peer_a["seconds"], peer_b["seconds"]],
        "peer_container_start_s": peer["container_start_s"],
        "ours_judged": judge(ours["results"], "resolved"),
        "peer_judged": judge(peer["results"], "rc"),
        "worker_cpu_s_per_job": ours["worker_cpu_s_per_job"],
        "verify_s": _pcts([r["s"] for r in ours["results"]]),
        "harness_run_s": _pcts([r["run_s"] for r in ours["results"] if r.get("run_s") is not None]),
        "harness_setup_s": _pcts([r["setup_s"] for r in ours["results"] if r.get("setup_s") is not None]),
        "overhead_s": _pcts(overhead),
        "peer_job_s": _pcts([r["s"] for r in peer["results"]]),
        "failures": [r for r in ours["results"] if "error" in r or (r["kind"] == "gold") != (r.get("resolved") == 1.0)][
            :5
        ],
        "load_avg": [load_before, _load()],
    }


def summarize(tasks: list, rounds: list[dict], sandbox: dict, args) -> dict:
    head = min(rounds, key=lambda r: r["ratio"])
    judged = head["ours_judged"]
    n = len(tasks)
    return {
        "ours": head["ours"],
        "peer": head["peer"],
        "unit": "verified tasks/s",
        "ratio": head["ratio"],
        "resolved_gold": f"{min(r['ours_judged']['resolved_gold'] for r in rounds)}/{n}",
        "unresolved_mutants": f"{min(r['ours_judged']['unresolved_mutants'] for r in rounds)}/{n}",
        "peer_resolved_gold": f"{head['peer_judged']['resolved_gold']}/{n}",
        "peer_unresolved_mutants": f"{head['peer_judged']['unresolved_mutants']}/{n}",
        "infra_errors": judged["infra_errors"],
        "n_tasks": n,
        "n_jobs": 2 * n,
        "tasks": [t.task_id for t in tasks],
        "workers": args.workers,
        "concurrency": args.concurrency,
        "target": {"ratio": TARGET_RATIO, "resolved_gold": f"{n}/{n}", "unresolved_mutants": f"{n}/{n}"},
        "met": head["ratio"] >= TARGET_RATIO and judged["resolved_gold"] == n and judged["unresolved_mutants"] == n,
        "headline": "the round with the lower ratio",
        "ratios": [r["ratio"] for r in rounds],
        "sandbox": sandbox,
        "load_avg": _load(),
        "rounds": rounds,
        "image": args.image,
        "quick": args.quick,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def wait_for_engine(timeout_s: float = 120.0) -> bool:
    """Whether the Docker engine answers again within `timeout_s` (then 5 s more to settle)."""
    from sandbox_workers.factory import docker_available

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if docker_available():
            time.sleep(5.0)
            return True
        time.sleep(2.0)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="verifier worker processes")
    ap.add_argument("--concurrency", type=int, default=1, help="verification threads per worker")
    ap.add_argument("--runs", type=int, default=2, help="timed rounds (peer, ours, peer each)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N tasks (sorted by id)")
    ap.add_argument("--quick", action="store_true", help=f"2 tasks ({', '.join(QUICK_TASKS)}), 1 round")
    ap.add_argument("--sandbox-samples", type=int, default=10, help="container starts/resets timed")
    ap.add_argument("--image", default="", help="sandbox image (default: the repo verifier's)")
    ap.add_argument("--out", default=str(RESULT), help="result JSON path")
    args = ap.parse_args()
    skip_unless(__file__, docker=True, hint="the repo verifier runs every check in a fresh docker container")
    from sandbox_workers.repo_image import REPO_TAG, ensure_repo_image

    args.image = args.image or os.environ.get("RLBUS_REPO_SANDBOX_IMAGE") or REPO_TAG
    if args.image == REPO_TAG:
        ensure_repo_image()
    runs = 1 if args.quick else args.runs
    tasks = select_tasks(args.quick, args.limit)
    jobs = make_jobs(tasks)
    driver_jobs = peer_jobs(tasks, jobs)
    sandbox = measure_sandbox(args.image, 3 if args.quick else args.sandbox_samples)
    rounds: list[dict] = []
    retried: list[str] = []
    while len(rounds) < runs:
        try:
            rounds.append(one_round(tasks, jobs, driver_jobs, args))
        except Exception as exc:  # the engine went away mid-round (restarted by something else): repeat it
            if len(retried) >= ROUND_RETRIES or not wait_for_engine():
                raise
            retried.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            print(f"round {len(rounds) + 1} lost ({retried[-1]}); the engine answers again: repeating it", flush=True)
            continue
        r = rounds[-1]
        print(
            f"round {len(rounds)}: ours {r['ours']} /s, peer {r['peer']} /s, ratio {r['ratio']}, "
            f"gold {r['ours_judged']['resolved_gold']}/{len(tasks)}, "
            f"mutants {r['ours_judged']['unresolved_mutants']}/{len(tasks)}, load {r['load_avg']}",
            flush=True,
        )
        result = summarize(tasks, rounds, sandbox, args) | {"rounds_lost": retried}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # after every round: a lost one keeps these
    print(
        json.dumps(
            {k: result[k] for k in ("ours", "peer", "ratio", "resolved_gold", "unresolved_mutants", "n_tasks", "met")}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
