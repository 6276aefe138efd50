"""Harbor-task benchmark: rlbus's protected verification vs Harbor's own, on the same attempts.

Run: `python bench/harbor.py [--n N] [--tasks a,b,...] [--warmup 1] [--out PATH]`.

What it measures:

- ATTEMPTS: every fixture under examples/harbor/ except `multi-step` (refused: `[[steps]]`)
  and `broken-no-reward` (no reward file at all), each attempted twice: once with its oracle
  (`solution/` under /solution, `solve.sh` run with bash as the agent user) and once empty
  (the agent does nothing). `--tasks` picks fixtures by name; `--n` takes the first N attempts
  of that list (cycling through it again when N is larger).
- OURS: `verify_episode(job, box.id)` on the HarborBox the agent acted in, with
  examples/harbor.toml's `[harbor]` (verify_in = "same"), then the box's removal.
- PEER: what Harbor does, with the tests in the agent's own container: `docker run -d` of the
  task image (network none, the task's cpus and memory, the toolchain volume rlbus uses at
  /opt/rlbus-toolchain read-only), the agent's script, then `docker cp tests/ /tests`,
  `mkdir -p /logs/verifier`, `docker exec bash /tests/test.sh` (toolchain first on PATH, its
  site on PYTHONPATH, plus `[verifier].env`), `docker exec cat` of the reward file, `docker rm
  -f`. Both sides go through the same docker SDK client (`sandbox_workers.docker_engine`).
- TIMES: verification only, from the agent done to the reward known and every container of
  the attempt removed; the sides alternate per attempt (ours, peer, ours, peer...) so they
  share the machine's noise. Rate = attempts / the sum of a side's verification seconds.
  Start: ours `timings["start_s"]` (test container created from the snapshot, restored,
  started), the peer's `docker run -d` until it returns (started). Reset: ours
  `timings["reset_s"]` (the test container's removal), the peer's `docker rm -f`.
  Warm-up (not timed): `--warmup` attempts of each side first.

Both sides must agree on every reward (disagreements printed, exit 1 after the JSON is
written). Writes bench/results/harbor.json: ours, peer (attempts/s), ratio (goal >= 0.5),
ratio_p50 (the peer's p50 verification seconds / ours: the typical attempt, which one slow
test.sh does not move), p50/p90 verification seconds, p50 start and reset (and ours' removals
of both containers), ours' phases (`timings`), per-attempt rows, machine facts.
The sides themselves are in `bench/harbor_sides.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from itertools import cycle, islice
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import skip_unless

RESULT = ROOT / "bench" / "results" / "harbor.json"
CONFIG = ROOT / "examples" / "harbor.toml"
EXCLUDED = ("multi-step", "broken-no-reward")
TARGET_RATIO = 0.5


def _pcts(xs: list[float]) -> dict:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return {}
    return {
        "p50": round(statistics.median(xs), 4),
        "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 4),
        "mean": round(statistics.fmean(xs), 4),
        "n": len(xs),
    }


def select_tasks(names: str) -> list:
    """The runnable fixtures (sorted by name), or those `names` (comma-separated) lists."""
    from schemas.harbor_task import find_tasks, read_task

    tasks = [read_task(p) for p in find_tasks("examples/harbor/*", ROOT)]
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        by_name = {t.name: t for t in tasks}
        missing = [n for n in wanted if n not in by_name]
        if missing:
            raise SystemExit(f"no such fixture: {', '.join(missing)} (have: {', '.join(sorted(by_name))})")
        tasks = [by_name[n] for n in wanted]
    else:
        tasks = [t for t in tasks if t.name not in EXCLUDED]
    refused = [f"{t.name}: {t.refusal}" for t in tasks if t.refusal]
    if refused:
        raise SystemExit("cannot run: " + "; ".join(refused))
    return tasks


def attempts(tasks: list, n: int) -> list[tuple[int, str]]:
    """(task index, "oracle" | "empty") pairs: each task twice; the first `n` (cycling) when n > 0."""
    base = [(i, kind) for i in range(len(tasks)) for kind in ("oracle", "empty")]
    return list(islice(cycle(base), n)) if n else base


def machine() -> dict:
    from sandbox_workers.docker_engine import get_client

    info = get_client().info()
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "docker": info.get("ServerVersion"),
        "storage_driver": info.get("Driver"),
        "cgroup": info.get("CgroupVersion"),
    }


def summarize(rows: list[dict], tasks: list, args, wall_s: float, load0: list[float]) -> dict:
    side = {}
    for name in ("ours", "peer"):
        secs = [r[name]["s"] for r in rows]
        side[name] = {
            "rate": round(len(rows) / sum(secs), 3),
            "verify_s": _pcts(secs),
            "start_s": _pcts([r[name]["start_s"] for r in rows]),
            "reset_s": _pcts([r[name]["reset_s"] for r in rows]),
        }
    side["ours"]["episode_remove_s"] = _pcts([r["ours"]["episode_remove_s"] for r in rows])
    side["ours"]["removals_s"] = _pcts([r["ours"]["reset_s"] + r["ours"]["episode_remove_s"] for r in rows])
    for k in ("snapshot_s", "test_s", "total_s"):
        side["ours"][k] = _pcts([r["ours"]["timings"].get(k) for r in rows])
    disagree = [r for r in rows if r["ours"]["reward"] != r["peer"]["reward"]]
    oracle = [r for r in rows if r["kind"] == "oracle"]
    empty = [r for r in rows if r["kind"] == "empty"]
    ratio = round(side["ours"]["rate"] / side["peer"]["rate"], 3)
    return {
        "ours": side["ours"]["rate"],
        "peer": side["peer"]["rate"],
        "unit": "verified attempts/s (one at a time)",
        "ratio": ratio,
        "ratio_p50": round(side["peer"]["verify_s"]["p50"] / side["ours"]["verify_s"]["p50"], 3),
        "target": {"ratio": TARGET_RATIO, "agree": f"{len(rows)}/{len(rows)}"},
        "met": ratio >= TARGET_RATIO and not disagree,
        "agree": f"{len(rows) - len(disagree)}/{len(rows)}",
        "disagreements": [
            {k: r[k] for k in ("task", "kind")} | {s: r[s]["reward"] for s in ("ours", "peer")} for r in disagree
        ],
        "oracle_scored_1": f"{sum(r['ours']['reward'] == 1.0 for r in oracle)}/{len(oracle)}",
        "empty_scored_0": f"{sum(r['ours']['reward'] == 0.0 for r in empty)}/{len(empty)}",
        "n_attempts": len(rows),
        "tasks": [t.name for t in tasks],
        "sides": side,
        "warmup": args.warmup,
        "wall_s": round(wall_s, 2),
        "config": str(CONFIG.relative_to(ROOT)),
        "rows": rows,
        "load_avg": [load0, [round(x, 2) for x in os.getloadavg()]],
        "machine": machine(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    o, p = res["sides"]["ours"], res["sides"]["peer"]
    t = Table(title=f"Harbor task verification, {res['n_attempts']} attempts ({res['agree']} rewards agree)")
    for col in ("", "ours (rlbus)", "peer (Harbor's way)", "ours / peer"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("attempts/s", f"{o['rate']:.3f}", f"{p['rate']:.3f}", f"[bold]{res['ratio']:.3f}[/]")
    t.add_row(
        "attempts/s at the p50 attempt",
        f"{1 / o['verify_s']['p50']:.3f}",
        f"{1 / p['verify_s']['p50']:.3f}",
        f"{res['ratio_p50']:.3f}",
    )
    for label, key in (("verify s p50", "p50"), ("verify s p90", "p90")):
        a, b = o["verify_s"][key], p["verify_s"][key]
        t.add_row(label, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    for label, key in (("container start s p50", "start_s"), ("reset s p50", "reset_s")):
        a, b = o[key]["p50"], p[key]["p50"]
        t.add_row(label, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    a, b = o["removals_s"]["p50"], p["reset_s"]["p50"]
    t.add_row("all removals s p50 (ours: test + episode)", f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    t.add_row("oracle = 1 / empty = 0", f"{res['oracle_scored_1']} / {res['empty_scored_0']}", "", "")
    Console(width=110).print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=0, help="attempts (default: every chosen task, oracle + empty)")
    ap.add_argument("--tasks", default="", help="comma-separated fixture names (default: all runnable)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed attempts of each side first")
    ap.add_argument("--out", default=str(RESULT), help="result JSON path")
    args = ap.parse_args()
    skip_unless(__file__, docker=True, hint="both sides run the task's tests in docker containers")
    from bench.harbor_sides import ours, peer, peer_env
    from sandbox_workers.docker_engine import get_client
    from sandbox_workers.harbor_check import box_spec, verify_job
    from sandbox_workers.harbor_images import ensure_task_image, ensure_toolchain
    from schemas.config import load_config

    h = load_config(str(CONFIG)).harbor
    tasks = select_tasks(args.tasks)
    client = get_client()
    toolchain = ensure_toolchain(h.toolchain_image)
    images = [ensure_task_image(t, dict(h.image_map)) for t in tasks]  # built before any clock
    jobs = [verify_job(t, h, box_spec(t, h, img)) for t, img in zip(tasks, images)]
    envs = [peer_env(client, t, img) for t, img in zip(tasks, images)]
    plan = attempts(tasks, args.n)
    for i, kind in plan[: args.warmup]:
        ours(tasks[i], jobs[i], kind == "oracle")
        peer(client, tasks[i], images[i], toolchain, envs[i], kind == "oracle")
    load0 = [round(x, 2) for x in os.getloadavg()]
    rows, t0 = [], time.perf_counter()
    for n, (i, kind) in enumerate(plan, 1):
        a = ours(tasks[i], jobs[i], kind == "oracle")
        b = peer(client, tasks[i], images[i], toolchain, envs[i], kind == "oracle")
        rows.append({"task": tasks[i].name, "kind": kind, "ours": a, "peer": b})
        flag = "" if a["reward"] == b["reward"] else "  DISAGREE"
        print(
            f"{n:3d}/{len(plan)} {tasks[i].name:<16} {kind:<6} ours {a['reward']:g} ({a['status']}) {a['s']:.3f} s"
            f" | peer {b['reward']:g} ({b['status']}) {b['s']:.3f} s{flag}",
            flush=True,
        )
    for r in rows:
        for s in ("ours", "peer"):
            r[s] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r[s].items()}
    res = summarize(rows, tasks, args, time.perf_counter() - t0, load0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print_table(res)
    for d in res["disagreements"]:
        print(f"DISAGREE {d['task']} {d['kind']}: ours {d['ours']:g}, peer {d['peer']:g}")
    print(json.dumps({k: res[k] for k in ("ours", "peer", "ratio", "ratio_p50", "agree", "n_attempts", "met")}))
    return 1 if res["disagreements"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
