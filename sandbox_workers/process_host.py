"""What the `process` backend (`sandbox_workers.process`) reads from the host: processes and cgroups.

Guarantees: read-only scans of /proc and the cgroup tree; a process that exits
mid-scan is skipped, never an error. `count_uid_procs` counts every /proc entry the uid
owns (zombies too); `uid_pids` only live ones (a zombie cannot be killed again).
`find_cgroup_parent` returns `RLBUS_SANDBOX_CGROUP`, else this process's own cgroup v2,
only when this process can write it and its children get both the pids and memory
controllers; otherwise None.
"""

from __future__ import annotations

import os
from pathlib import Path


def count_uid_procs(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:
                pass
    return n


def uid_pids(uid: int) -> list[int]:
    """Live (non-zombie) pids whose /proc entry the uid owns."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            pids.append(int(entry.name))
    return pids


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def find_cgroup_parent() -> Path | None:
    """A writable cgroup v2 dir whose children get pids+memory controllers, or None."""
    root = Path("/sys/fs/cgroup")
    explicit = os.environ.get("RLBUS_SANDBOX_CGROUP")
    try:
        if explicit:
            parent = Path(explicit)
        elif (root / "cgroup.controllers").exists():
            rel = next(
                line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
            )
            parent = root / rel.strip().lstrip("/")
        else:
            return None
        ctl = (parent / "cgroup.subtree_control").read_text().split()
        if {"pids", "memory"} <= set(ctl) and os.access(parent, os.W_OK):
            return parent
    except (OSError, StopIteration):
        pass
    return None
