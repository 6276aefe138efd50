"""The two sides of `bench/repo_tasks.py`: ours (verifier worker processes scoring through the
real `repo` verifier, a fresh container per verification) and the peer (plain pytest in one
container of the same image, no isolation).

Guarantees:
- `verify_job` scores a job exactly as a verifier worker does (`verifier_workers.worker.score`,
  the diff as the trajectory's `diff` artifact); a `VerifierInfraError` is retried, up to
  `INFRA_ATTEMPTS` tries in all, and a job that still fails returns an `error` entry
  instead of raising.
- `run_ours` times only the part after every worker process warmed up (one verification
  per thread) and reported ready; it joins (or terminates) every process it started.
- `peer_jobs` gives the driver the same tree the verifier builds (`verifier_workers.verifiers.repo.prepare`);
  `run_peer` runs them all through `PEER_DRIVER` in ONE container, times the driver's loop
  only (the container's start is excluded), and always removes the container.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import threading
import time

INFRA_ATTEMPTS = 3
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


# ---------------------------------------------------------------- ours: verifier worker processes
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
