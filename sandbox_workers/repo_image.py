"""Build the repository-task sandbox image (`rlbus sandbox build-image --repo`).

Guarantees:
- `build_repo_image()` builds `compose/repo-sandbox.Dockerfile` as
  `rlbus-repo-sandbox:latest` (or the given tag) with the same offline rules as
  `sandbox_workers.images.build_image`: the base image is never pulled and RUN steps
  have no network. The build context is the Dockerfile plus `wheelhouse/`, the wheels of
  `REQUIREMENTS` (pytest) and of any `extra` requirements (task deps), fetched on the host
  by `fetch_wheels` with `pip download --only-binary :all: --python-version 3.11`: the
  package registry is the only network ever used, and only at build time.
- The wheelhouse lives in `wheelhouse_dir()` (env `RLBUS_REPO_WHEELHOUSE`, else
  `~/.cache/rlbus/repo-wheelhouse`); it is downloaded again only when the requirements
  changed (`requirements.txt` in it records them).
- The image is labelled `rlbus.sandbox.dockerfile=<sha256 of the Dockerfile and every
  wheel's name and bytes>`; `ensure_repo_image()` builds only when that label differs.
- Failures raise `images.ImageBuildError` with what to do.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from sandbox_workers.images import ROOT, SHA_LABEL, ImageBuildError, client_or_default, image_labels, run_build

DOCKERFILE = ROOT / "compose" / "repo-sandbox.Dockerfile"
REPO_TAG = "rlbus-repo-sandbox:latest"
REQUIREMENTS = ("pytest==9.0.2",)
PYTHON_VERSION = "3.11"


def wheelhouse_dir() -> Path:
    """Where the host keeps the wheels baked into the image."""
    env = os.environ.get("RLBUS_REPO_WHEELHOUSE")
    return Path(env) if env else Path.home() / ".cache" / "rlbus" / "repo-wheelhouse"


def fetch_wheels(dest: Path, requirements: list[str]) -> list[Path]:
    """The wheels of `requirements` (and their dependencies) in `dest`, downloaded if needed."""
    dest.mkdir(parents=True, exist_ok=True)
    stamp = dest / "requirements.txt"
    want = "\n".join(sorted(set(requirements))) + "\n"
    wheels = sorted(dest.glob("*.whl"))
    if wheels and stamp.is_file() and stamp.read_text() == want:
        return wheels
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        "--only-binary",
        ":all:",
        "--python-version",
        PYTHON_VERSION,
        *sorted(set(requirements)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageBuildError(
            f"pip download {' '.join(requirements)} failed (the registry must be reachable "
            f"at build time, or fill {dest} with the wheels):\n{proc.stderr[-1500:]}"
        )
    stamp.write_text(want)
    return sorted(dest.glob("*.whl"))


def image_sha(wheels: list[Path], dockerfile: Path = DOCKERFILE) -> str:
    """sha256 of the Dockerfile and every wheel (name and bytes)."""
    h = hashlib.sha256(dockerfile.read_bytes())
    for w in sorted(wheels):
        h.update(w.name.encode() + b"\0" + hashlib.sha256(w.read_bytes()).digest())
    return h.hexdigest()


def _context(dockerfile: Path, wheels: list[Path]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("Dockerfile", dockerfile.read_bytes())] + [
            (f"wheelhouse/{w.name}", w.read_bytes()) for w in wheels
        ]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def build_repo_image(
    tag: str = REPO_TAG, *, extra: list[str] | None = None, client=None, on_line: Callable[[str], None] | None = None
) -> str:
    """Fetch the wheels, then build the image offline; returns its id."""

    wheels = fetch_wheels(wheelhouse_dir(), [*REQUIREMENTS, *(extra or [])])
    return run_build(
        client_or_default(client), _context(DOCKERFILE, wheels), tag, {SHA_LABEL: image_sha(wheels)}, on_line
    )


def ensure_repo_image(
    tag: str = REPO_TAG, *, extra: list[str] | None = None, client=None, on_line: Callable[[str], None] | None = None
) -> bool:
    """Build `tag` unless it exists with the current Dockerfile and wheels; True if it built."""
    labels = image_labels(tag, client)
    if labels is not None:
        wheels = fetch_wheels(wheelhouse_dir(), [*REQUIREMENTS, *(extra or [])])
        if labels.get(SHA_LABEL) == image_sha(wheels):
            return False
    build_repo_image(tag, extra=extra, client=client, on_line=on_line)
    return True
