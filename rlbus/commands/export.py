"""`rlbus export`: one weight version of a run as a self-contained Hugging Face model directory.

Guarantees:
- The output holds `config.json`, `model.safetensors` (via `save_pretrained`), the
  tokenizer files and `generation_config.json` when the start model has one, plus
  `rlbus_export.json` (run, version, step, blob sha256, source): `from_pretrained` and vLLM
  load it as it is, with no rlbus code.
- Architecture and tokenizer come from the run's `<run>/model/start`; the weights are the
  version's blob from the run's store (NATS object store, `file://`, `s3://`), checked
  against the announced sha256. A LoRA adapter blob is merged into the base, so the
  export is always a plain full model.
- `--version`: a number, `latest` (KV `weights.latest`) or `released` (KV
  `release.latest`, else the run store's newest released `gate_checks` row, see
  `scheduler.gates`). A numbered version is looked up in the WEIGHTS stream, else in the
  run store's `weight_versions`. A version deleted by the learner's retention
  (`learner.keep_versions`) fails with an error that says which versions are kept.
- The server URL is `--nats-url`, else `nats_url` in `<run>/run.json`. When no server
  answers, `latest` falls back to the newest learner checkpoint
  (`<run>/checkpoints/learner.pt`) and says so (its step may be past the last published
  version); any other version fails with an error that says what to do. Nothing is
  written to `--out` unless the export succeeds (written beside it, then renamed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rlbus.run.folder import RunFolder
from rlbus.run.server import server_reachable

EPILOG = """examples:
  rlbus export runs/demo-20250101-120000 --out exported/demo            # the newest version
  rlbus export runs/demo-20250101-120000 --version released --out exported/demo-rel
  rlbus export runs/demo-20250101-120000 --version 12 --out exported/v12 --nats-url nats://127.0.0.1:4222

Then: AutoModelForCausalLM.from_pretrained("exported/demo"), or `vllm serve exported/demo`.
The run's NATS server must be up for a numbered or released version (`rlbus up --resume
RUN_PATH` restarts it on the run's store); without it, `latest` exports the newest learner
checkpoint instead.
"""


class ExportError(RuntimeError):
    """An export that cannot be done; the message says why and what to do."""


@dataclass
class Source:
    """Where the exported weights came from."""

    kind: str  # "blob" or "checkpoint"
    version: int | None
    step: int | None
    sha256: str | None = None
    uri: str | None = None
    note: str = ""


async def _find_version(js, reg, version: int, db_url: str | None, run_path: Path) -> tuple[str, str, int]:
    """(uri, sha256, step) of a numbered version: newest announcement in WEIGHTS, else SQL."""
    from bus.streams import iter_stream
    from schemas import DecodeError, WeightVersion, decode

    found = None
    async for _, data in iter_stream(js, reg.stream("WEIGHTS"), reg.weights):
        try:
            wv = decode(data, WeightVersion)
        except DecodeError:
            continue
        if wv.version == version:
            found = (wv.uri, wv.sha256, wv.step)
    if found:
        return found
    from scheduler.store import open_store
    from scheduler.store_rows import WeightVersionRow

    store = open_store(db_url, run_path)
    try:
        rows = [r for r in store.rows(WeightVersionRow, reg.run_id, "created_at") if r.version == version]
    finally:
        store.close()
    if not rows:
        raise ExportError(
            f"version {version} of run {reg.run_id} is neither in its WEIGHTS stream nor in its run store"
        )
    return rows[-1].uri, rows[-1].sha256, rows[-1].step


async def _released_version(js, reg, db_url: str | None, run_path: Path) -> int:
    from bus.kv import RELEASE_LATEST, get_json
    from scheduler.store import open_store

    rel = await get_json(js, reg, RELEASE_LATEST)
    if rel is not None:
        return int(rel["version"])
    store = open_store(db_url, run_path)
    try:
        v = store.latest_released(reg.run_id)
    finally:
        store.close()
    if v is None:
        raise ExportError(
            f"run {reg.run_id} has no released version yet (no version passed the release gate); "
            "export --version latest or a number instead"
        )
    return v


async def fetch_version_blob(
    nats_url: str, run_id: str, version: str, db_url: str | None, run_path: Path
) -> tuple[bytes, Source]:
    """The blob of `version` (a number, `latest` or `released`) and where it came from."""
    from bus.conn import connect
    from bus.kv import WEIGHTS_LATEST, get_json
    from bus.objects import BlobGone
    from bus.subjects import Registry
    from bus.weight_stores import fetch_weights

    reg = Registry(run_id)
    nc = await connect(nats_url, name="rlbus-export")
    try:
        js = nc.jetstream(timeout=30)
        if version == "latest":
            latest = await get_json(js, reg, WEIGHTS_LATEST)
            if latest is None:
                raise ExportError(f"run {run_id} has published no weight version yet (KV {WEIGHTS_LATEST} is empty)")
            number, uri, sha, step = int(latest["version"]), latest["uri"], latest["sha256"], latest.get("step")
        else:
            number = await _released_version(js, reg, db_url, run_path) if version == "released" else int(version)
            uri, sha, step = await _find_version(js, reg, number, db_url, run_path)
        try:
            blob = await fetch_weights(uri, sha, js)
        except BlobGone as exc:
            raise ExportError(
                f"version {number} is no longer in the weight store ({exc}): the learner keeps only "
                "the newest learner.keep_versions versions, version 0 and the released one; export "
                "--version latest or released, or a newer number"
            ) from exc
    finally:
        await nc.close()
    return blob, Source("blob", number, step, sha, uri)


def _load_start(start: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(start, torch_dtype="auto")


def model_from_blob(start: Path, blob: bytes):
    """The start model with the blob's weights (a LoRA adapter blob merged in)."""
    from safetensors.torch import load

    from bus.weight_blobs import apply_adapter_blob, blob_kind, load_state_bytes

    model = _load_start(start)
    if blob_kind(blob) == "lora":
        return apply_adapter_blob(model, blob)
    dtypes = {t.dtype for t in load(blob).values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model = model.to(next(iter(dtypes)))  # keep the version's dtype (e.g. bf16)
    load_state_bytes(model, blob)
    return model


def model_from_checkpoint(start: Path, ckpt: Path):
    """The start model with the learner checkpoint's weights; (model, saved state)."""
    import torch

    payload = torch.load(ckpt, map_location="cpu", weights_only=False)
    state = payload["model"]
    if any(k.startswith("base_model.model.") for k in state):
        raise ExportError(
            f"{ckpt} is a LoRA (peft) checkpoint; start the run's NATS server and export a "
            "published version instead (its adapter blob is merged on export)"
        )
    model = _load_start(start)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ExportError(
            f"{ckpt} does not fit {start}: missing={sorted(set(missing) - tied)[:5]} "
            f"unexpected={sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    return model, payload.get("state") or {}


def write_model_dir(model, start: Path, out: Path, provenance: dict) -> Path:
    """Save model + tokenizer (+ provenance) to `out`, atomically (sibling temp dir, rename)."""
    from transformers import AutoTokenizer

    out = out.resolve()
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(start).save_pretrained(tmp)
    (tmp / "rlbus_export.json").write_text(json.dumps(provenance, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def export(
    run_path: Path,
    out: Path,
    version: str = "latest",
    nats_url: str | None = None,
    db_url: str | None = None,
    say=print,
) -> Source:
    """Export `version` of the run at `run_path` to `out`; returns where the weights came from."""
    run_path = Path(run_path).resolve()
    folder = RunFolder(run_path)
    start = folder.start_model
    if not (start / "config.json").exists():
        raise ExportError(f"{start} has no config.json: is {run_path} a run folder made by `rlbus up`?")
    if version not in ("latest", "released") and not version.isdigit():
        raise ExportError(f"--version {version!r}: expected a number, 'latest' or 'released'")
    run_id = folder.state().get("run_id") or run_path.name
    url = nats_url or folder.server_url()
    if url and asyncio.run(server_reachable(url)):
        blob, source = asyncio.run(fetch_version_blob(url, run_id, version, db_url, run_path))
        model = model_from_blob(start, blob)
    else:
        where = f"at {url}" if url else "(no --nats-url and no nats_url in run.json)"
        ckpt = folder.learner_checkpoint
        if version != "latest":
            raise ExportError(
                f"no NATS server answers {where}, and version {version!r} lives in the run's object "
                f"store: restart it (`rlbus up --resume {run_path}`) or pass --nats-url; "
                "--version latest can fall back to the newest learner checkpoint"
            )
        if not ckpt.exists():
            raise ExportError(f"no NATS server answers {where} and {ckpt} does not exist: nothing to export")
        model, saved = model_from_checkpoint(start, ckpt)
        source = Source(
            "checkpoint",
            saved.get("version"),
            saved.get("step"),
            uri=ckpt.as_uri(),
            note=f"NATS server not reachable {where}: exported the newest learner checkpoint "
            f"(step {saved.get('step')}, last published version {saved.get('version')}) instead",
        )
        say(source.note)
    provenance = {
        "run_id": run_id,
        "requested": version,
        "source": source.kind,
        "version": source.version,
        "step": source.step,
        "sha256": source.sha256,
        "uri": source.uri,
        "note": source.note,
    }
    write_model_dir(model, start, out, provenance)
    return source


def _main(args) -> int:
    try:
        src = export(
            Path(args.run_path),
            Path(args.out),
            args.version,
            args.nats_url,
            args.db_url,
            say=lambda m: print(m, file=sys.stderr),
        )
    except ExportError as exc:
        print(f"rlbus export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {src.kind} version={src.version} step={src.step} -> {Path(args.out).resolve()}")
    return 0


def register(sub) -> None:
    """Add `rlbus export` to the `rlbus` parser."""
    p = sub.add_parser(
        "export",
        help="write one weight version of a run as a Hugging Face model directory",
        description="Write a version's weights as a Hugging Face model directory (safetensors, config, "
        "tokenizer) that from_pretrained and vLLM load as it is.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_path", metavar="RUN_PATH", help="the run folder, <run-dir>/<run_id>")
    p.add_argument(
        "--version",
        default="latest",
        metavar="V|latest|released",
        help="a version number, 'latest' (default) or 'released' (newest version that passed the release gate)",
    )
    p.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    p.add_argument("--nats-url", help="the run's NATS server (default: nats_url in RUN_PATH/run.json)")
    p.add_argument("--db-url", help="run store URL for version look-ups (default: $RLBUS_DB_URL, else RUN_PATH/run.db)")
    p.set_defaults(func=_main)
