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

This script picks the tasks, times the sandbox, runs the rounds and writes the result; the two
sides (ours, the peer) are in `bench/repo_tasks_sides.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import skip_unless
from bench.repo_tasks_sides import peer_jobs, run_ours, run_peer

RESULT = ROOT / "bench" / "results" / "repo_tasks.json"
QUICK_TASKS = ("fixture-clamp", "inflection-0.5.1-m088dc866")
TARGET_RATIO = 0.5
ROUND_RETRIES = 2  # rounds repeated after the engine went away mid-round (something else restarted it)


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
