"""What the agent may not change before its tests run: the protected paths of a Harbor task's
snapshot, and their restoration from the task image (used by `harbor_verify`, steps 3-4).

Guarantees:
- `protected_changes` splits the engine's diff of a container into (changed, deleted, added)
  paths under the protected roots, topmost entries only.
- `protected_roots` adds, once per task image, every path outside the roots that a symlink
  under them leads to, hop by hop (listed by the image's own `find`, without network), never
  `/` nor a top-level directory.
- `plan_restore` decides, through the engine's archive API (no program of the image runs),
  what is restored from the task image and what the agent added (deleted in step 4); a
  replaced parent of a protected path or of the toolchain mount point, anything at that mount
  point, and an added name the engine cannot report raise `Tamper` (the episode scores 0).
- `restore_paths` copies paths from a created, never started container of the task image
  (`Pristine`), making missing parents.
"""

from __future__ import annotations

import base64
import json
import posixpath
import threading

from sandbox_workers.base import MIB
from sandbox_workers.harbor_box import read_tar_file, tar_of
from sandbox_workers.harbor_images import TOOLCHAIN_MOUNT

MODE_DIR = 1 << 31  # Go's os.ModeDir in the engine's path stat


MODE_SYMLINK = 1 << 27  # Go's os.ModeSymlink


LINKS_OUT = "/.rlbus-links"


FIND_LINKS = (
    f"find / -xdev -type l -printf '%p\\0%l\\0' > {LINKS_OUT} 2>/dev/null"
    f' || find / -xdev -type l -exec sh -c \'for l; do printf "%s\\0%s\\0" "$l" "$(readlink "$l")"; done\''
    f" sh {{}} + > {LINKS_OUT} 2>/dev/null"
)


"""Every symlink of the image as `path NUL target NUL` (GNU find, else POSIX find + readlink)."""


_escapes: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}


_escapes_lock = threading.Lock()


class Tamper(Exception):
    """The agent left the container so that the protected paths cannot be restored (scores 0)."""


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _parents(path: str) -> list[str]:
    """The directories above `path`, `/` excluded (`/usr/local/bin` -> `/usr`, `/usr/local`)."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


def protected_changes(changes: list[dict], roots: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
    """(changed, deleted, added) paths under `roots` from the engine's diff of a container;
    a path under an added or deleted directory already listed is covered by it and left out."""
    changed: list[str] = []
    deleted: list[str] = []
    added: list[str] = []
    for row in sorted(changes or [], key=lambda r: r["Path"]):
        path, kind = row["Path"], int(row["Kind"])
        if not _under(path, roots) or any(path.startswith(p.rstrip("/") + "/") for p in deleted + added):
            continue
        (changed, added, deleted)[kind if kind in (0, 1, 2) else 0].append(path)
    return changed, deleted, added


def link_escapes(links: dict[str, str], roots: tuple[str, ...]) -> tuple[str, ...]:
    """The paths outside `roots` that the symlinks under them lead to, every hop of every chain
    (`links`: an image's symlinks, path -> target). `/` and top-level directories are not kept
    (that would protect the agent's workspace wholesale); chains are followed through them."""
    out: set[str] = set()

    def resolve(path: str, inside: tuple[str, ...]) -> str:
        """`path` with every symlink on it followed; the hops outside `inside` go to `out`."""
        pending, cur, hops = [p for p in path.split("/") if p], "/", 0
        while pending:
            name = pending.pop(0)
            if name == ".":
                continue
            if name == "..":
                cur = posixpath.dirname(cur)
                continue
            nxt = posixpath.join(cur, name)
            if nxt in links and hops < 40:
                hops += 1
                if not _under(nxt, inside):
                    out.add(nxt)
                target = links[nxt]
                pending = [p for p in target.split("/") if p] + pending
                cur = "/" if target.startswith("/") else cur
                continue
            cur = nxt
        return cur

    inside = roots + tuple(resolve(r, roots) for r in roots)  # `/bin` -> `/usr/bin` too
    out.clear()
    for link in sorted(links):
        if _under(link, inside):
            final = resolve(link, inside)
            if not _under(final, inside):
                out.add(final)
    return tuple(sorted(p for p in out if p.count("/") > 1))


def protected_roots(api, image: str, roots: tuple[str, ...]) -> tuple[str, ...]:
    """`roots` plus `link_escapes` of the image's symlinks (listed once per image id and roots)."""
    image_id = api.inspect_image(image)["Id"]
    with _escapes_lock:
        key = (image_id, roots)
        if key not in _escapes:
            _escapes[key] = link_escapes(_image_links(api, image), roots)
        return roots + _escapes[key]


def _image_links(api, image: str) -> dict[str, str]:
    made = api.create_container(
        image, command=["sh", "-c", FIND_LINKS], entrypoint=[], user="0:0", network_disabled=True
    )["Id"]
    try:
        api.start(made)
        api.wait(made, timeout=120)
        try:
            stream, _ = api.get_archive(made, LINKS_OUT)
            raw = read_tar_file(stream, 256 * MIB) or b""
        except Exception:  # noqa: BLE001 - no find in the image: no symlink is followed
            raw = b""
    finally:
        api.remove_container(made, force=True)
    parts = raw.decode("utf-8", "replace").split("\0")
    return {parts[i]: parts[i + 1] for i in range(0, len(parts) - 1, 2) if parts[i].startswith("/")}


def stat_path(api, cid: str, path: str) -> dict | None:
    """The engine's stat of `path` in container `cid` (a last-component symlink not followed);
    None when it does not exist."""
    resp = api.head(api._url("/containers/{0}/archive", cid), params={"path": path}, timeout=api.timeout)
    if resp.status_code == 404:
        return None
    api._raise_for_status(resp)
    return json.loads(base64.b64decode(resp.headers.get("X-Docker-Container-Path-Stat") or "e30="))


def _kind(stat: dict | None) -> str:
    if stat is None:
        return "none"
    mode = int(stat.get("mode", 0))
    if mode & MODE_DIR:
        return "dir"
    if mode & MODE_SYMLINK:
        return f"link:{stat.get('linkTarget', '')}"
    return "file"


class Pristine:
    """A created, never started container of the task image (made on first use)."""

    def __init__(self, api, image: str) -> None:
        self.api, self.image, self.id = api, image, None

    def cid(self) -> str:
        if self.id is None:
            self.id = self.api.create_container(self.image, command=["true"], entrypoint=[], network_disabled=True)[
                "Id"
            ]
        return self.id

    def close(self) -> None:
        if self.id is not None:
            self.api.remove_container(self.id, force=True)


def plan_restore(api, test_cid: str, pristine: Pristine, rows: list[dict], roots: tuple[str, ...]):
    """(restore, added) for the protected `roots` from the episode's diff `rows`, or Tamper:
    `restore` are the paths to copy from the image (each whole), `added` those to delete."""
    kinds = {r["Path"]: int(r["Kind"]) for r in rows or []}
    guarded = roots + (TOOLCHAIN_MOUNT,)
    for path in kinds:
        if "\ufffd" in path and _under(path, roots):
            raise Tamper(f"{path!r} under a protected path has a name that is not UTF-8")
        if _under(path, (TOOLCHAIN_MOUNT,)):
            raise Tamper(f"the agent made {path}, at the verifier's toolchain mount point")
    gone: list[str] = []
    for parent in sorted({p for r in guarded for p in _parents(r)}):
        kind = kinds.get(parent)
        if kind == 2:
            gone.append(parent)
        elif kind is not None:
            now = _kind(stat_path(api, test_cid, parent))
            if now != "dir" and now != _kind(stat_path(api, pristine.cid(), parent)):
                raise Tamper(f"{parent}, above protected paths, was replaced ({now})")
    changed, deleted, added = protected_changes(rows, roots)
    restore = list(deleted)
    restore += [r for r in roots if _under(r, tuple(gone)) and r not in restore]
    for path in changed:
        if _kind(stat_path(api, test_cid, path)) == "dir" and _kind(stat_path(api, pristine.cid(), path)) == "dir":
            continue  # a directory still: its changed entries are listed themselves
        restore.append(path)
    return restore, added


def restore_paths(api, test_cid: str, pristine: Pristine, paths: list[str]) -> None:
    """Copy each of `paths` (whole) from the image into the created test container, its missing
    parents made first; a path the image lacks is skipped."""
    import docker

    for path in paths:
        try:
            stream, _ = api.get_archive(pristine.cid(), path)
        except docker.errors.NotFound:
            continue  # not in the image: nothing to restore
        parent = posixpath.dirname(path) or "/"
        _make_dirs(api, test_cid, parent)
        api.put_archive(test_cid, parent, b"".join(stream))


def _make_dirs(api, cid: str, path: str) -> None:
    """Make the missing directories of `path` in `cid` (existing ones, symlinks included, kept)."""
    missing = []
    while path != "/" and stat_path(api, cid, path) is None:
        path, name = posixpath.split(path)
        missing.insert(0, name)
    if missing:
        api.put_archive(cid, path, tar_of({}, dirs=["/".join(missing)]))


def image_has_user(api, pristine: Pristine, user: str) -> bool:
    """Whether the task image's /etc/passwd names `user` (read through the engine)."""
    try:
        stream, _ = api.get_archive(pristine.cid(), "/etc/passwd")
        data = read_tar_file(stream, 16 * MIB) or b""
    except Exception:  # noqa: BLE001 - no passwd file in the image
        return False
    return any(line.split(b":", 1)[0] == user.encode() for line in data.splitlines())
