"""Learner checkpoints: model, optimizer, RNG, counters and the REWARDS log position.

Guarantees: a checkpoint is written to a temp file and renamed, so a crash mid-write
leaves the previous one intact; `load` returns None when there is none.
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
