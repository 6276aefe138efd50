"""Sandbox benchmark: latency of running `python3 -c pass` in a fresh sandbox, one run.

What it measures (run with no arguments: `.venv/bin/python bench/sandbox.py`):

- OURS (docker, warm): one sample = `DockerSandbox().start()` (hand-out from the warm
  pool) + `execute(["python3", "-c", "pass"])`. Every sample gets a fresh container
  in the backend's sense: never used, or returned by `close()` and then wiped and
  proven clean by the pool before it is handed out again (the pool size is 2, the
  `SandboxSection.warm_pool` default). `close()` (which only queues the clean-up) is
  outside the timed part; between samples the script waits, untimed, until the pool
  has settled (a container ready, no clean-up still running), as a worker that does
  not saturate its pool sees it. That wait is recorded as `warm_ready_gap_p50_ms`
  (about the time one clean-up takes).
- FLOOR (docker): a bare API exec of the same command in one held container (no
  wrapper, no freshness): `docker_exec_floor_*`, the least any exec-based backend pays.
- PEER (docker, cold): `docker run --rm --network none <image> python3 -c pass` with
  the docker CLI, the usual way to run one command in a fresh container.
- PROCESS: the process backend with full bubblewrap isolation (`isolation="bwrap"` is
  required, so a degraded sandbox fails the run): `execute(["python3", "-c", "pass"])`
  in one started sandbox (the figure the 30 ms target is about), plus
  `start + execute + close` of a new sandbox per sample (`process_fresh_*`). For
  context, `host_python_p50_ms` is plain `python3 -c pass` on the host (no sandbox)
  and `process_true_p50_ms` the process backend running `/usr/bin/true` (its own overhead).

Sampling is interleaved: each of the n rounds takes one sample of every series, in a
rotating order, so load changes on a shared machine hit every series alike. Writes bench/results/sandbox.json with ours (warm docker p50 ms), peer (cold docker
run p50 ms), ratio = peer / ours, the p99s, the process figures, n and a machine note,
and prints a table. The machine may be shared: compare figures of one run only.
About two minutes with the default n=50.
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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sandbox_workers import images
from sandbox_workers.docker_backend import DockerSandbox
from sandbox_workers.docker_engine import get_client
from sandbox_workers.docker_pool import DEFAULT_IMAGE, RUN_USER, Exec, shutdown_pools
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
    """Wait until the pool is settled: a container idle and no clean-up or creation still
    running (they would compete with the timed exec). Returns ms waited (untimed)."""
    t0 = time.perf_counter()
    with pool.cond:
        pool.cond.wait_for(lambda: pool.idle and not pool.pending, timeout=timeout)
    return ms_since(t0)


class Series:
    """One thing to time: `setup()` once, then `sample()` returns ms (untimed waits inside)."""

    name = ""

    def setup(self) -> None:
        pass

    def sample(self) -> float:
        raise NotImplementedError

    def teardown(self) -> None:
        pass


class DockerWarm(Series):
    name = "docker warm pool (ours)"

    def __init__(self, image: str) -> None:
        self.image = image
        self.gaps: list[float] = []

    def _one(self) -> float:
        t0 = time.perf_counter()
        sbx = DockerSandbox(warm_pool=2)
        sbx.start(image=self.image)
        r = sbx.execute(CMD)
        ms = ms_since(t0)
        check(r, "docker")
        sbx.close()  # queues the clean-up: not timed
        return ms

    def setup(self) -> None:
        probe = DockerSandbox(warm_pool=2)
        probe.start(image=self.image)
        self.pool = probe._pool
        probe.close()
        for _ in range(3):  # the pool fills and recycles once
            wait_ready(self.pool)
            self._one()

    def sample(self) -> float:
        self.gaps.append(wait_ready(self.pool))
        return self._one()


class DockerFloor(Series):
    """A bare API exec of the command in one held container (no wrapper, no
    freshness, no status line): the least any exec-based backend pays."""

    name = "docker bare exec (floor)"

    def __init__(self, image: str) -> None:
        self.image = image

    def setup(self) -> None:
        self.sbx = DockerSandbox(warm_pool=0)
        self.sbx.start(image=self.image)

    def sample(self) -> float:
        t0 = time.perf_counter()
        ex = Exec(get_client().api, self.sbx.container_id, CMD, user=RUN_USER)
        ex.pump({}, time.monotonic() + 30)
        rc = ex.exit_code()
        ex.close()
        if rc != 0:
            raise SystemExit(f"bench: bare exec failed with {rc}")
        return ms_since(t0)

    def teardown(self) -> None:
        self.sbx.close()


class DockerCold(Series):
    name = "docker run --rm (peer)"

    def __init__(self, image: str) -> None:
        self.argv = ["docker", "run", "--rm", "--network", "none", image, *CMD]

    def setup(self) -> None:
        subprocess.run(self.argv, check=True, capture_output=True)

    def sample(self) -> float:
        t0 = time.perf_counter()
        subprocess.run(self.argv, check=True, capture_output=True)
        return ms_since(t0)


class ProcessExec(Series):
    """`execute` in one started bwrap sandbox (bwrap required: never degraded)."""

    name = "process bwrap: exec"

    def __init__(self, cmd: list[str] = CMD, name: str | None = None) -> None:
        self.cmd = cmd
        self.name = name or self.name

    def setup(self) -> None:
        self.sbx = ProcessSandbox(isolation="bwrap")  # raises if bwrap is unusable
        self.sbx.start(timeout=10)
        check(self.sbx.execute(self.cmd), "bwrap")

    def sample(self) -> float:
        t0 = time.perf_counter()
        r = self.sbx.execute(self.cmd)
        ms = ms_since(t0)
        check(r, "bwrap")
        return ms

    def teardown(self) -> None:
        self.sbx.close()


class ProcessFresh(Series):
    name = "process bwrap: start+exec+close"

    def sample(self) -> float:
        t0 = time.perf_counter()
        with ProcessSandbox(isolation="bwrap") as box:
            box.start(timeout=10)
            r = box.execute(CMD)
        ms = ms_since(t0)
        check(r, "bwrap")
        return ms


class HostPython(Series):
    name = "host python3 -c pass (no sandbox)"

    def sample(self) -> float:
        t0 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "pass"], check=True)
        return ms_since(t0)


def run_rounds(series: list[Series], n: int, progress) -> dict[str, list[float]]:
    """n rounds; each takes one sample of every series, in a rotating order, so load
    changes on a shared machine hit every series alike."""
    for s in series:
        s.setup()
    times: dict[str, list[float]] = {s.name: [] for s in series}
    task = progress.add_task(f"{len(series)} series, interleaved", total=n * len(series))
    try:
        for i in range(n):
            k = i % len(series)
            for s in series[k:] + series[:k]:
                times[s.name].append(s.sample())
                progress.advance(task)
    finally:
        for s in series:
            s.teardown()
        shutdown_pools()
    return times


def machine_note() -> str:
    load = os.getloadavg()
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}, "
        f"load avg {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start (shared machine)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50, help="samples per series (default 50)")
    ap.add_argument("--image", default=DEFAULT_IMAGE)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from bench import skip_unless

    skip_unless(__file__, docker=True)
    console = Console(stderr=True)
    note = machine_note()
    if images.ensure_image(args.image, on_line=lambda line: None):
        console.print(f"built {args.image}")
    cols = (TextColumn("{task.description:<32}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    warm = DockerWarm(args.image)
    series = [
        warm,
        DockerFloor(args.image),
        DockerCold(args.image),
        ProcessExec(),
        ProcessFresh(),
        ProcessExec(["/usr/bin/true"], "process bwrap: exec of true"),
        HostPython(),
    ]
    with Progress(*cols, console=console) as progress:
        times = run_rounds(series, args.n, progress)
    stats = {name: summary(values) for name, values in times.items()}
    w, c = stats[DockerWarm.name], stats[DockerCold.name]
    p, pf = stats[ProcessExec.name], stats[ProcessFresh.name]
    floor = stats[DockerFloor.name]
    result = {
        "metric": "p50 ms to run `python3 -c pass` in a fresh sandbox (lower is better)",
        "ours": w["p50"],
        "peer": c["p50"],
        "ratio": round(c["p50"] / w["p50"], 2),
        "ours_p99": w["p99"],
        "peer_p99": c["p99"],
        "ours_desc": "docker backend: warm-pool hand-out (fresh: new or proven clean) + execute",
        "peer_desc": "docker run --rm --network none <image> python3 -c pass (CLI, cold container)",
        "warm_ready_gap_p50_ms": pct(warm.gaps, 0.5),
        "docker_exec_floor_p50_ms": floor["p50"],
        "docker_exec_floor_p99_ms": floor["p99"],
        "process_p50": p["p50"],
        "process_p99": p["p99"],
        "process_fresh_p50": pf["p50"],
        "process_fresh_p99": pf["p99"],
        "process_isolation": "bwrap",
        "process_true_p50_ms": stats["process bwrap: exec of true"]["p50"],
        "host_python_p50_ms": stats[HostPython.name]["p50"],
        "targets": {"ours_p50_ms": 100, "process_p50_ms": 30},
        "n": args.n,
        "image": args.image,
        "machine": note,
        "load_avg_end": [round(x, 1) for x in os.getloadavg()],
        "sampling": "interleaved rounds: one sample of every series per round, rotating order",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = Table(title=f"python3 -c pass in a fresh sandbox (n={args.n}, ms)")
    for col in ("series", "p50", "p99", "mean"):
        table.add_column(col, justify="right" if col != "series" else "left")
    for name, st in stats.items():
        table.add_row(name, str(st["p50"]), str(st["p99"]), str(st["mean"]))
    Console().print(table)
    print(f"ratio peer/ours = {result['ratio']}; wrote {args.out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
