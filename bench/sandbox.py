"""Sandbox benchmark: latency of running `python3 -c pass` in a fresh sandbox, one run.

What it measures (run with no arguments: `.venv/bin/python bench/sandbox.py`):

- OURS (docker, warm): one sample = `DockerSandbox().start()` (hand-out from the warm
  pool) + `execute(["python3", "-c", "pass"])`. Every sample gets a fresh container
  in the backend's sense: never used, or returned by `close()` and then wiped and
  proven clean by the pool before it is handed out again (the pool size is 2, the
  `SandboxSection.warm_pool` default). `close()` (which only queues the clean-up) is
  outside the timed part; between samples the script waits, untimed, until the pool
  has a container ready again, as a worker that is not saturating its pool would see.
  The time to the next ready container is recorded as `warm_ready_gap_ms`.
- PEER (docker, cold): `docker run --rm --network none <image> python3 -c pass` with
  the docker CLI, the usual way to run one command in a fresh container.
- PROCESS: the process backend with full bubblewrap isolation (`isolation="bwrap"` is
  required, so a degraded sandbox fails the run): `execute(["python3", "-c", "pass"])`
  in one started sandbox (the figure the 30 ms target is about), plus
  `start + execute + close` of a new sandbox per sample (`process_fresh_*`). For
  context, `host_python_p50_ms` is plain `python3 -c pass` on the host (no sandbox)
  and `process_true_p50_ms` the process backend running `/usr/bin/true` (its own overhead).

All series interleave nothing: they run one after the other in the same invocation.
Writes bench/results/sandbox.json with ours (warm docker p50 ms), peer (cold docker
run p50 ms), ratio = peer / ours, the p99s, the process figures, n and a machine note,
and prints a table. The machine may be shared: compare figures of one run only.
About a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from sandbox_workers import docker_backend, images
from sandbox_workers.process import ProcessSandbox

CMD = ["python3", "-c", "pass"]
OUT = ROOT / "bench" / "results" / "sandbox.json"


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank, in ms rounded to 0.1."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 1)


def summary(values: list[float]) -> dict:
    return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "mean": round(statistics.fmean(values), 1)}


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def check(result, isolation: str) -> None:
    if result.exit_code != 0 or result.isolation != isolation:
        raise SystemExit(f"bench: a sample failed: {result}")


def wait_ready(pool, timeout: float = 10.0) -> float:
    """Wait (untimed sample-wise) until the pool has an idle container; returns ms waited."""
    t0 = time.perf_counter()
    with pool.cond:
        pool.cond.wait_for(lambda: pool.idle, timeout=timeout)
    return ms_since(t0)


def docker_warm(n: int, progress, image: str) -> tuple[list[float], list[float]]:
    probe = docker_backend.DockerSandbox(warm_pool=2)
    probe.start(image=image)
    pool = probe._pool
    probe.close()
    for _ in range(3):  # warm-up: the pool fills and recycles once
        wait_ready(pool)
        sbx = docker_backend.DockerSandbox(warm_pool=2)
        sbx.start(image=image)
        sbx.execute(CMD)
        sbx.close()
    times, gaps = [], []
    task = progress.add_task("docker warm: acquire + exec", total=n)
    for _ in range(n):
        gaps.append(wait_ready(pool))
        t0 = time.perf_counter()
        sbx = docker_backend.DockerSandbox(warm_pool=2)
        sbx.start(image=image)
        r = sbx.execute(CMD)
        times.append(ms_since(t0))
        check(r, "docker")
        sbx.close()
        progress.advance(task)
    docker_backend.shutdown_pools()
    return times, gaps


def docker_cold(n: int, progress, image: str) -> list[float]:
    argv = ["docker", "run", "--rm", "--network", "none", image, *CMD]
    subprocess.run(argv, check=True, capture_output=True)
    times = []
    task = progress.add_task("docker cold: docker run --rm", total=n)
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(ms_since(t0))
        progress.advance(task)
    return times


def process_backend(n: int, progress) -> tuple[list[float], list[float]]:
    sbx = ProcessSandbox(isolation="bwrap")  # raises if bwrap is unusable: never degraded
    sbx.start(timeout=10)
    try:
        check(sbx.execute(CMD), "bwrap")
        times = []
        task = progress.add_task("process (bwrap): exec", total=n)
        for _ in range(n):
            t0 = time.perf_counter()
            r = sbx.execute(CMD)
            times.append(ms_since(t0))
            check(r, "bwrap")
            progress.advance(task)
    finally:
        sbx.close()
    fresh = []
    task = progress.add_task("process (bwrap): start + exec + close", total=n)
    for _ in range(n):
        t0 = time.perf_counter()
        with ProcessSandbox(isolation="bwrap") as box:
            box.start(timeout=10)
            r = box.execute(CMD)
        fresh.append(ms_since(t0))
        check(r, "bwrap")
        progress.advance(task)
    return times, fresh


def context_series(n: int, progress) -> dict:
    """Host python, and the process backend running `true`: splits the backend's time."""
    out = {}
    task = progress.add_task("context: host python3, process true", total=2 * n)
    host = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "pass"], check=True)
        host.append(ms_since(t0))
        progress.advance(task)
    out["host_python_p50_ms"] = pct(host, 0.5)
    sbx = ProcessSandbox(isolation="bwrap")
    sbx.start(timeout=10)
    try:
        bw = []
        for _ in range(n):
            t0 = time.perf_counter()
            check(sbx.execute(["/usr/bin/true"]), "bwrap")
            bw.append(ms_since(t0))
            progress.advance(task)
        out["process_true_p50_ms"] = pct(bw, 0.5)
    finally:
        sbx.close()
    return out


def machine_note() -> str:
    load = os.getloadavg()
    return (f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, "
            f"load avg {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start (shared machine)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50, help="samples per series (default 50)")
    ap.add_argument("--image", default=docker_backend.DEFAULT_IMAGE)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    console = Console(stderr=True)
    note = machine_note()
    if images.ensure_image(args.image, on_line=lambda line: None):
        console.print(f"built {args.image}")
    cols = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console) as progress:
        warm, gaps = docker_warm(args.n, progress, args.image)
        cold = docker_cold(args.n, progress, args.image)
        proc, proc_fresh = process_backend(args.n, progress)
        context = context_series(max(10, args.n // 2), progress)
    w, c, p, pf = summary(warm), summary(cold), summary(proc), summary(proc_fresh)
    result = {
        "metric": "p50 ms to run `python3 -c pass` in a fresh sandbox (lower is better)",
        "ours": w["p50"], "peer": c["p50"], "ratio": round(c["p50"] / w["p50"], 2),
        "ours_p99": w["p99"], "peer_p99": c["p99"],
        "ours_desc": "docker backend: warm-pool hand-out (fresh: new or proven clean) + execute",
        "peer_desc": "docker run --rm --network none <image> python3 -c pass (CLI, cold container)",
        "warm_ready_gap_p50_ms": pct(gaps, 0.5),
        "process_p50": p["p50"], "process_p99": p["p99"],
        "process_fresh_p50": pf["p50"], "process_fresh_p99": pf["p99"],
        "process_isolation": "bwrap",
        **context,
        "targets": {"ours_p50_ms": 100, "process_p50_ms": 30},
        "n": args.n, "image": args.image, "machine": note,
        "load_avg_end": [round(x, 1) for x in os.getloadavg()],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"python3 -c pass in a fresh sandbox (n={args.n}, ms)")
    for col in ("series", "p50", "p99", "mean"):
        table.add_column(col, justify="right" if col != "series" else "left")
    for name, s in (("docker warm pool (ours)", w), ("docker run --rm (peer)", c),
                    ("process bwrap: exec", p), ("process bwrap: start+exec+close", pf)):
        table.add_row(name, str(s["p50"]), str(s["p99"]), str(s["mean"]))
    Console().print(table)
    print(f"ratio peer/ours = {result['ratio']}; host python3 -c pass p50 = {context['host_python_p50_ms']} ms; "
          f"process backend `true` p50 = {context['process_true_p50_ms']} ms; wrote {args.out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
