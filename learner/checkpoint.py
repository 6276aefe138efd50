"""Learner checkpoints: model, optimizer, RNG, counters and the REWARDS log position.

Guarantees:
- One rank (`save`/`load`, `checkpoints/learner.pt`): a checkpoint is written to a temp
  file and renamed, so a crash mid-write leaves the previous one intact; `load` returns
  None when there is none.
- N ranks (`save_dcp`/`load_dcp`, `checkpoints/learner.dcp/`): every rank writes its
  shards with torch.distributed.checkpoint into a new directory (plus its RNG state, and
  rank 0 the `state` as state.json); only after every rank finished does rank 0 point
  `LATEST` at it (temp file + rename) and delete older directories. A crash at any point
  leaves `LATEST` naming a complete checkpoint (or no `LATEST`: no checkpoint). Loading
  reshards to the current world size.
"""

from __future__ import annotations

import os
import random
from pathlib import Path


def save(path: Path, *, model, optimizer, state: dict) -> None:
    """Atomically write a checkpoint."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "state": state,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load(path: Path, *, model, optimizer) -> dict | None:
    """Restore model/optimizer/RNG in place; return the saved state dict, or None."""
    import torch

    if not path.exists():
        return None
    payload = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    random.setstate(payload["py_rng"])
    return payload["state"]


LATEST = "LATEST"


def latest_dcp(root: Path) -> Path | None:
    """The complete DCP checkpoint directory `LATEST` names under `root`, or None."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    return Path(root) / pointer.read_text().strip()


def save_dcp(root: Path, name: str, *, model, optimizer, state: dict, rank: int) -> None:
    """Every rank (a collective): write checkpoint `name` under `root`, then (rank 0) make it LATEST.
    `name` must be new (rank 0 chooses it and sends it to every rank)."""
    import shutil

    import torch
    import torch.distributed as dist

    from learner.distributed import save_sharded

    target = Path(root) / name
    target.mkdir(parents=True, exist_ok=True)
    torch.save({"torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}, target / f"rng-{rank}.pt")
    save_sharded(target, model, optimizer, state)  # ends with a barrier: every rank's shards are written
    if rank == 0:
        tmp = Path(root) / f"{LATEST}.tmp"
        tmp.write_text(name)
        os.replace(tmp, Path(root) / LATEST)
        for old in Path(root).iterdir():
            if old.is_dir() and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_dcp(path: Path, *, model, optimizer, rank: int) -> dict:
    """Every rank (a collective): restore model/optimizer (resharded) and this rank's RNG
    from the DCP checkpoint directory `path`; returns the saved state."""
    import torch

    from learner.distributed import load_sharded

    state = load_sharded(path, model, optimizer)
    rng = Path(path) / f"rng-{rank}.pt"
    if rng.exists():
        saved = torch.load(rng, weights_only=False)
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["py_rng"])
    return state
