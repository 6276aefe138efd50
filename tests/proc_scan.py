"""Scanning /proc for processes a test may have left behind."""

from __future__ import annotations

import os


def live_pids(match, *, environ: bool = False) -> list[int]:
    """PIDs of live processes (zombies skipped) for which `match(cmdline, environ)` is true.

    `cmdline` and `environ` are the raw bytes of /proc/PID/cmdline and /proc/PID/environ;
    environ is read only when asked (else b""), and a process whose files cannot be read
    (gone, or not ours) is skipped.
    """
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            env = b""
            if environ:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read()
        except (OSError, IndexError):
            continue
        if match(cmdline, env):
            found.append(int(name))
    return found
