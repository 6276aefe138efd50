"""Images of Harbor tasks, built offline and cached by content, and the verifier's trusted toolchain.

Guarantees:
- `task_image(task, image_map)` is the tag a task runs in: its `docker_image` through the map,
  or `rlbus-harbor/<name>:<env_hash[:16]>` for an `environment/Dockerfile` (the cache key is
  the content hash of `environment/` and of the image map it was built under).
- `ensure_task_image` builds only when that tag is missing: the context is `environment/`,
  its `FROM` lines are rewritten through `image_map`, the base is never pulled, RUN steps have
  no network, and the build stops at `build_timeout_s` (the connection is closed, which the
  engine takes as a cancel). A failure raises `TaskBuildFailed` carrying the build log's tail;
  a `docker_image` missing from the engine raises it too, naming `harbor.image_map`.
- `ensure_toolchain(image)` fills a docker volume, once per toolchain image id, with that
  image's Python packages (pytest and its dependencies) and `bin/python3` / `bin/pytest`
  wrappers that run the task image's own (restored) interpreter with them: the volume is
  mounted read-only, first on PATH, for `test.sh` (`harbor_verify`); its `.complete` marker is
  written last, and the verifier refuses a volume without it (a fill that died half way). A missing toolchain image
  raises `TaskBuildFailed` naming `rlbus sandbox build-image --repo`.
"""

from __future__ import annotations

import io
import re
import tarfile
import threading
import time

from sandbox_workers.harbor_box import HarborEngineError, client
from schemas.harbor_task import HarborTask, tree_hash

TAG_REPO = "rlbus-harbor"
ENV_LABEL = "rlbus.harbor.env"
TOOLCHAIN_MOUNT = "/opt/rlbus-toolchain"
TOOLCHAIN_VOLUME = "rlbus-harbor-toolchain"
_FROM = re.compile(r"^(\s*FROM\s+(?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_lock = threading.Lock()


class TaskBuildFailed(RuntimeError):
    """A task's image could not be built or found; `tail` is the end of the build log."""

    def __init__(self, message: str, tail: str = "") -> None:
        super().__init__(f"{message}\n{tail}".strip())
        self.tail = tail


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-.") or "task"


def map_dockerfile(text: str, image_map: dict[str, str]) -> str:
    """`text` with every `FROM <image>` rewritten through `image_map` (other lines unchanged)."""
    lines = []
    for line in text.splitlines():
        m = _FROM.match(line)
        lines.append(f"{m.group(1)}{image_map.get(m.group(2), m.group(2))}{m.group(3)}" if m else line)
    return "\n".join(lines) + "\n"


def task_image(task: HarborTask, image_map: dict[str, str]) -> str:
    """The image tag `task` runs in (see the module guarantees)."""
    if task.docker_image:
        return image_map.get(task.docker_image, task.docker_image)
    mapped = tree_hash({"env": task.env_hash.encode(), "map": repr(sorted(image_map.items())).encode()})
    return f"{TAG_REPO}/{_slug(task.name)}:{mapped[:16]}"


def _has_image(api, tag: str) -> bool:
    import docker

    try:
        api.inspect_image(tag)
        return True
    except docker.errors.ImageNotFound:
        return False
    except Exception as exc:
        raise HarborEngineError(f"inspecting {tag}: {exc}") from exc


def _context(task: HarborTask, image_map: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel, data in sorted(task.environment.items()):
            if rel == "Dockerfile":
                data = map_dockerfile(data.decode("utf-8", "replace"), image_map).encode()
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ensure_task_image(task: HarborTask, image_map: dict[str, str]) -> str:
    """The task's image tag, built when missing (TaskBuildFailed with the log's tail)."""
    api = client().api
    tag = task_image(task, image_map)
    if _has_image(api, tag):
        return tag
    if task.docker_image:
        raise TaskBuildFailed(
            f"image {tag} is not on the docker engine and no registry is pulled from: build it locally, "
            f'or map it to a local image with harbor.image_map = {{ "{task.docker_image}" = "<local image>" }}'
        )
    return _build(api, task, image_map, tag)


def _build(api, task: HarborTask, image_map: dict[str, str], tag: str) -> str:
    lines: list[str] = []
    t0 = time.monotonic()
    try:
        stream = api.build(
            fileobj=io.BytesIO(_context(task, image_map)),
            custom_context=True,
            tag=tag,
            pull=False,
            network_mode="none",
            rm=True,
            forcerm=True,
            decode=True,
            timeout=task.build_timeout_s,
            labels={ENV_LABEL: task.env_hash},
        )
        for chunk in stream:
            if "stream" in chunk:
                lines.extend(chunk["stream"].rstrip("\n").splitlines())
            if "error" in chunk:
                raise TaskBuildFailed(f"building {task.name} failed: {chunk['error'].strip()}", "\n".join(lines[-30:]))
            if time.monotonic() - t0 > task.build_timeout_s:
                stream.close()
                raise TaskBuildFailed(
                    f"building {task.name} passed build_timeout_sec = {task.build_timeout_s:g}", "\n".join(lines[-30:])
                )
    except TaskBuildFailed:
        raise
    except Exception as exc:
        late = time.monotonic() - t0 >= task.build_timeout_s - 1
        why = f"passed build_timeout_sec = {task.build_timeout_s:g}" if late else f"{type(exc).__name__}: {exc}"
        raise TaskBuildFailed(f"building {task.name} failed: {why}", "\n".join(lines[-30:])) from exc
    if not _has_image(api, tag):
        raise TaskBuildFailed(f"building {task.name} left no image {tag}", "\n".join(lines[-30:]))
    return tag


_WRAPPERS = {
    "python3": '#!/bin/sh\nfor p in /usr/local/bin/python3 /usr/bin/python3; do [ -x "$p" ] && exec "$p" "$@"; done\n'
    'echo "rlbus toolchain: the task image has no python3" >&2; exit 127\n',
    "pytest": '#!/bin/sh\nexec "$(dirname "$0")/python3" -m pytest "$@"\n',
}


def ensure_toolchain(image: str) -> str:
    """The name of the read-only toolchain volume of `image` (see the module guarantees)."""
    import docker

    api = client().api
    try:
        image_id = api.inspect_image(image)["Id"].split(":")[-1][:12]
    except docker.errors.ImageNotFound:
        raise TaskBuildFailed(
            f"the verifier's toolchain image {image} is missing: build it with `rlbus sandbox build-image --repo` "
            "(or set harbor.toolchain_image)"
        ) from None
    name = f"{TOOLCHAIN_VOLUME}-{image_id}"
    with _lock:
        if any(v["Name"] == name for v in (api.volumes(filters={"name": name}).get("Volumes") or [])):
            return name
        script = (
            "set -eu; d=$(python3 -c 'import os,pytest;print(os.path.dirname(os.path.dirname(pytest.__file__)))');"
            f' mkdir -p /t/site /t/bin; cp -a "$d"/. /t/site/; rm -rf /t/site/__pycache__;'
            f" printf '%s' '{_WRAPPERS['python3']}' > /t/bin/python3; printf '%s' '{_WRAPPERS['pytest']}' > /t/bin/pytest;"
            " ln -s python3 /t/bin/python; chmod -R a+rX /t; chmod 755 /t/bin/*; touch /t/.complete"
        )
        api.create_volume(name)
        made = api.create_container(
            image,
            command=["sh", "-c", script],
            entrypoint=[],
            user="0:0",
            host_config=api.create_host_config(binds={name: {"bind": "/t", "mode": "rw"}}, network_mode="none"),
        )
        try:
            api.start(made["Id"])
            code = api.wait(made["Id"], timeout=120)["StatusCode"]
            logs = api.logs(made["Id"]).decode("utf-8", "replace")
        finally:
            api.remove_container(made["Id"], force=True)
        if code != 0:
            api.remove_volume(name, force=True)
            raise TaskBuildFailed(f"filling the toolchain volume from {image} failed (exit {code})", logs[-2000:])
    return name
