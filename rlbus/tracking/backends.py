"""The tracker's backends by name, and the check that their packages are installed.

Guarantees:
- A backend's package is imported only when that backend is configured; a missing one is
  a `TrackingUnavailable` whose message names the package and the extra to install
  (`pip install -e '.[tracking]'`), raised before the tracker touches the bus, and by
  `rlbus up` before anything starts.
- Every backend has `write(points, tables)`, `flush()` (on disk / handed to wandb) and
  `close()`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXTRA = "pip install -e '.[tracking]'"
PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",)}
"""Backend -> the packages it imports (both in the `tracking` extra)."""


class TrackingUnavailable(RuntimeError):
    """A tracking backend's package is not installed; the message names the extra."""


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken or blocked package counts as missing
        return False


def check_installed(backends: list[str]) -> None:
    """Raise `TrackingUnavailable` naming the extra if a configured backend's package is missing."""
    missing = sorted({pkg for b in backends for pkg in PACKAGES[b] if not _installed(pkg)})
    if missing:
        raise TrackingUnavailable(
            f"tracking.backends {list(backends)} needs the package(s) {', '.join(missing)}, "
            f"which are not installed: {EXTRA}"
        )


def open_backends(cfg, run_path: Path) -> list:
    """The configured backends of `cfg.tracking`, opened on the run folder `run_path`."""
    check_installed(cfg.tracking.backends)
    out: list = []
    for name in cfg.tracking.backends:
        if name == "tensorboard":
            from rlbus.tracking.tensorboard_backend import TensorBoardBackend

            out.append(TensorBoardBackend(run_path / "tensorboard"))
        elif name == "wandb":
            from rlbus.tracking.wandb_backend import WandbBackend

            out.append(WandbBackend(cfg, run_path))
    return out
