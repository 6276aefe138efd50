"""Per-episode harness containers (`agent.sandbox = "docker"`): `DockerHarnessSandbox`.

Guarantees (on top of `DockerSandbox`'s, in `sandbox_workers.docker_backend`):
- One container per sandbox, created for it and removed on `close` (never pooled, never
  reused by another episode): the isolation of every sandbox container
  (`docker_pool.container_kwargs`: `network_mode=none`, read-only root, tmpfs `/work` and
  `/tmp`, `mem_limit == memswap_limit`, `pids_limit`, CPU quota, ulimits, every capability
  dropped, `no-new-privileges`, commands as uid 65534), plus the `ro_binds` given at
  construction bind-mounted read-only (host path -> container path), fixed for the
  container's life, and the label `rlbus.sandbox.harness=1`.
- `execute(cmd, timeout, env=...)`: `DockerSandbox.execute` with `env` added to the exec's
  environment (over the container's PATH/HOME/TMPDIR/LANG/PYTHONDONTWRITEBYTECODE); every
  process the command started is killed when it ends or times out.
- The container is tracked by a pool of its own, registered under a key unique to the
  sandbox (so the reaper spares it while it lives) and unregistered on `close`.
- An engine that does not answer, or a missing image (`SandboxImageMissing`, naming the
  build command), raises from `start`: the caller's infrastructure error; nothing runs on
  the host.

Blocking API: call it from a thread in async code.
"""

from __future__ import annotations

from sandbox_workers.base import Limits
from sandbox_workers.docker_backend import DockerSandbox
from sandbox_workers.docker_engine import get_client, register_pool, start_reaper, unregister_pool
from sandbox_workers.docker_pool import DEFAULT_IMAGE, RUN_USER, Exec, WarmPool, container_kwargs, missing_image_message

HARNESS_LABEL = "rlbus.sandbox.harness"
PY_VERSION_ARGV = ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]
"""Prints the python3's major.minor (a harness's bound site-packages need the worker's)."""


def image_python(image: str) -> str:
    """The major.minor of `image`'s python3 (a throwaway container: no network, uid 65534,
    removed; the image is never pulled); RuntimeError naming the image when it cannot tell."""
    client = get_client(None)
    try:
        client.images.get(image)  # never pulled: `containers.run` would pull a missing image
    except Exception as exc:
        raise RuntimeError(f"{missing_image_message(image)} ({type(exc).__name__})") from exc
    try:
        out = client.containers.run(
            image, PY_VERSION_ARGV, network_mode="none", user=RUN_USER, remove=True, stdout=True, stderr=True
        )
    except Exception as exc:
        raise RuntimeError(f"cannot run python3 in image {image!r}: {exc}") from exc
    return out.decode(errors="replace").strip()


class HarnessPool(WarmPool):
    """The one container of one harness sandbox (size 0: created on demand, removed on release)."""

    def __init__(self, client, image: str, limits: Limits, cpus: float, ro_binds: tuple[tuple[str, str], ...]):
        super().__init__(client, image, limits, cpus, 0)
        self.ro_binds = ro_binds

    def _container_kwargs(self) -> dict:
        kw = container_kwargs(self.image, self.limits, self.cpus)
        kw["host_config"]["binds"] = {host: {"bind": inside, "mode": "ro"} for host, inside in self.ro_binds}
        kw["labels"] = {**kw["labels"], HARNESS_LABEL: "1"}
        return kw


class DockerHarnessSandbox(DockerSandbox):
    """A sandbox on a container of its own with read-only binds (one harness episode)."""

    def __init__(self, ro_binds: list[tuple[str, str]] | tuple = (), cpus: float = 1.0) -> None:
        """ro_binds: (host path, container path) pairs, mounted read-only; cpus: CPU quota."""
        super().__init__(warm_pool=0, cpus=cpus)
        self.ro_binds = tuple((str(h), str(i)) for h, i in ro_binds)
        self._key = ("harness", self.id)
        self._env: dict[str, str] | None = None

    def start(self, image: str | None = None, limits: Limits | None = None, timeout: float = 30.0) -> None:
        """Create and start this sandbox's container (image default `rlbus-sandbox:latest`)."""
        self.image = image or DEFAULT_IMAGE
        self.limits = limits or Limits()
        self.default_timeout = timeout
        client = get_client(None)
        args = (client, self.image, self.limits, self.cpus, self.ro_binds)
        with self._lock:
            self._pool = register_pool(self._key, lambda: HarnessPool(*args), 0)
            start_reaper(client)
            try:
                self._box = self._pool.acquire()
            except BaseException:
                self._drop_pool()
                raise

    def execute(self, cmd, timeout: float | None = None, env: dict[str, str] | None = None):
        """`DockerSandbox.execute` with `env` in the command's environment."""
        with self._lock:
            self._env = dict(env) if env else None
            try:
                return super().execute(cmd, timeout)
            finally:
                self._env = None

    def _start_exec(self, argv: list[str]) -> Exec:
        """The wrapper exec with this command's environment (no retry: the container is the episode's)."""
        return Exec(self._pool.api, self._require().id, argv, user=RUN_USER, environment=self._env)

    def reset(self) -> None:
        raise NotImplementedError("a harness container is the episode's: close it and start a new sandbox")

    def close(self) -> None:
        """Remove the container and unregister its pool; idempotent."""
        with self._lock:
            try:
                super().close()
            finally:
                self._drop_pool()

    def _drop_pool(self) -> None:
        pool = unregister_pool(self._key)
        if pool is not None:
            pool.shutdown()
