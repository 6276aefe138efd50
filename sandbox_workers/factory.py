"""Open a sandbox by backend name: the one place rollout workers and verifiers get one.

Guarantees:
- `open_sandbox(backend, image=..., limits=..., timeout=...)` returns a started
  `Sandbox` (see `sandbox_workers.base`) that is fresh: an empty work dir and no
  process left from any earlier user.
- `backend="auto"` picks `docker` when an engine answers, else `process`.
- Fails closed: a `process` sandbox that cannot isolate (no usable bubblewrap) raises
  `SandboxRefused` unless `allow_degraded` (see `sandbox_workers.process`).
  `probe_isolation` tells, before a run starts, which isolation its sandboxes get.
- Heavy imports (the docker SDK) happen only when that backend is asked for.
"""

from __future__ import annotations

from sandbox_workers.base import Isolation, Limits, Sandbox

BACKENDS = ("process", "docker", "auto")


def docker_available() -> bool:
    """True when a Docker engine answers a ping (from DOCKER_HOST or the default socket)."""
    try:
        import docker

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no engine here"
        return False


def resolve_backend(backend: str) -> str:
    """The concrete backend name for `backend` (resolves `auto`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "docker" if docker_available() else "process"
    return backend


def open_sandbox(
    backend: str = "process",
    *,
    image: str | None = None,
    limits: Limits | None = None,
    timeout: float = 30.0,
    warm_pool: int | None = None,
    concurrency: int | None = None,
    allow_degraded: bool = False,
) -> Sandbox:
    """A started, fresh sandbox of the given backend (close it, or use it as a context manager).

    `warm_pool`/`concurrency` size the docker backend's pool of ready containers and its
    HTTP connections (None: its env/defaults); the process backend ignores them.
    `allow_degraded`: the process backend may run without bubblewrap (else `SandboxRefused`)."""
    name = resolve_backend(backend)
    if name == "docker":
        from sandbox_workers.docker_backend import DockerSandbox

        sb: Sandbox = DockerSandbox(warm_pool=warm_pool, concurrency=concurrency)
    else:
        from sandbox_workers.process import ProcessSandbox

        sb = ProcessSandbox(allow_degraded=allow_degraded)
    sb.start(image=image, limits=limits, timeout=timeout)
    return sb


def probe_isolation(backend: str, allow_degraded: bool = False, image: str | None = None) -> Isolation:
    """The isolation sandboxes of `backend` get on this machine: "docker", "bwrap", or
    "degraded" (only when allowed; else `SandboxRefused` with the fix). The process
    backend is probed with one real sandbox (started and closed); docker is not started,
    but with `image` the engine must hold it (else `SandboxRefused` naming the build command)."""
    if resolve_backend(backend) == "docker":
        if image:
            _require_image(image)
        return "docker"
    from sandbox_workers.process import ProcessSandbox

    with ProcessSandbox(allow_degraded=allow_degraded) as sb:
        sb.start()
        return sb.isolation


def _require_image(image: str) -> None:
    """`SandboxRefused` with the build command when the engine lacks `image`."""
    import docker

    from sandbox_workers.base import SandboxRefused
    from sandbox_workers.docker_pool import missing_image_message

    try:
        client = docker.from_env()
    except docker.errors.DockerException as exc:
        raise SandboxRefused(
            f"sandbox.backend is docker but no Docker engine answers ({exc}); start one "
            '(`docker info` must work) or use backend = "process"'
        ) from None
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise SandboxRefused(missing_image_message(image)) from None
    finally:
        client.close()
