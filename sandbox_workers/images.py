"""Build the sandbox image the `docker` backend runs (`rlbus sandbox build-image`).

Guarantees:

- `build_image()` builds `compose/sandbox.Dockerfile` as `rlbus-sandbox:latest` (or the
  given tag) offline: the build context is the Dockerfile alone, the base image is
  never pulled (`pull=False`; it must already be on the engine) and RUN steps have no
  network (`network_mode=none`).
- The image carries the label `rlbus.sandbox.dockerfile=<sha256 of the Dockerfile>`;
  `ensure_image()` builds only when the tag is missing or was built from another
  Dockerfile, so tests and the bench can call it cheaply.
- Failures raise `ImageBuildError` with the build's last log lines and what to do.
- The docker SDK is imported only when a function here is called.
- The image holds no project code: the resident agent of one-shot runs
  (`sandbox_workers.docker_agent`) is passed in each container's command, so changing
  it never needs a rebuild; the image must only have `python3` (3.9+, stdlib) and the
  tools the Dockerfile checks.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "compose" / "sandbox.Dockerfile"
DEFAULT_TAG = "rlbus-sandbox:latest"
BASE_IMAGE = "python:3.11-slim"
SHA_LABEL = "rlbus.sandbox.dockerfile"


class ImageBuildError(RuntimeError):
    """The sandbox image could not be built; the message says why and what to try."""


def dockerfile_sha(dockerfile: Path = DOCKERFILE) -> str:
    """sha256 of the Dockerfile's bytes (the label that marks an up-to-date image)."""
    return hashlib.sha256(dockerfile.read_bytes()).hexdigest()


def _context(dockerfile: Path) -> io.BytesIO:
    """A tar build context holding only the Dockerfile."""
    data = dockerfile.read_bytes()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def client_or_default(client=None):
    """`client`, or (None) the process's shared DockerClient (`docker_engine.get_client`)."""
    if client is not None:
        return client
    from sandbox_workers.docker_engine import get_client

    return get_client()


def image_labels(tag: str = DEFAULT_TAG, client=None) -> dict[str, str] | None:
    """The labels of image `tag`, or None when the engine does not have it."""
    import docker

    try:
        attrs = client_or_default(client).api.inspect_image(tag)
    except docker.errors.ImageNotFound:
        return None
    return (attrs.get("Config") or {}).get("Labels") or {}


def build_image(
    tag: str = DEFAULT_TAG, *, dockerfile: Path = DOCKERFILE, client=None, on_line: Callable[[str], None] | None = None
) -> str:
    """Build the sandbox image offline; returns its id. `on_line` gets each log line."""
    client = client_or_default(client)
    if not dockerfile.is_file():
        raise ImageBuildError(f"no Dockerfile at {dockerfile} (run from a checkout of the project)")
    return run_build(client, _context(dockerfile), tag, {SHA_LABEL: dockerfile_sha(dockerfile)}, on_line)


def run_build(client, context, tag: str, labels: dict[str, str], on_line: Callable[[str], None] | None = None) -> str:
    """Build the tar `context` as `tag` offline (never pulls, RUN steps without network);
    the image id, or ImageBuildError with the build's last lines."""
    import docker

    lines: list[str] = []
    image_id = None
    try:
        for chunk in client.api.build(
            fileobj=context,
            custom_context=True,
            tag=tag,
            pull=False,
            rm=True,
            forcerm=True,
            network_mode="none",
            labels=labels,
            decode=True,
        ):
            if "error" in chunk:
                raise ImageBuildError(_failure(tag, chunk["error"], lines))
            text = (chunk.get("stream") or chunk.get("status") or "").rstrip()
            if text:
                lines.append(text)
                if on_line:
                    on_line(text)
            image_id = (chunk.get("aux") or {}).get("ID", image_id)
    except docker.errors.APIError as exc:
        raise ImageBuildError(_failure(tag, str(exc), lines)) from exc
    return image_id or client.api.inspect_image(tag)["Id"]


def _failure(tag: str, error: str, lines: list[str]) -> str:
    hint = ""
    if BASE_IMAGE in error or "pull access denied" in error or "not found" in error.lower():
        hint = (
            f"\nthe base image {BASE_IMAGE} must already be on this engine (builds never pull); "
            f"load it with `docker load` or build on a machine that has it"
        )
    tail = "\n".join(lines[-10:])
    return f"building {tag} failed: {error.strip()}{hint}" + (f"\nlast build output:\n{tail}" if tail else "")


def ensure_image(tag: str = DEFAULT_TAG, *, client=None, on_line: Callable[[str], None] | None = None) -> bool:
    """Build `tag` unless it exists and was built from this Dockerfile; True if it built."""
    labels = image_labels(tag, client)
    if labels is not None and labels.get(SHA_LABEL) == dockerfile_sha():
        return False
    build_image(tag, client=client, on_line=on_line)
    return True
