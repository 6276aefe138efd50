"""The bubblewrap command line of the `process` backend (`sandbox_workers.process`).

Guarantees of `bwrap_argv`: every namespace unshared (`--unshare-all` + user; no
network), nested user namespaces disabled, every capability dropped, a new session,
`--die-with-parent`, the given uid/gid inside; a root holding only read-only system
dirs (/usr, /bin, /lib*, the few /etc files the system `python3` needs), then
remounted read-only; fresh /proc and /dev, a /tmp tmpfs of `limits.tmp_mb`, the work
dir bound read-write at /work (the cwd); a cleared environment (PATH
`SANDBOX_PATH`, HOME /work, TMPDIR /tmp, LANG, no bytecode, `MARKER_ENV`). The
command runs as the child of `INIT_SHIM`, the namespace's pid 1, so it keeps normal
signal semantics and every process it starts dies with the namespace.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil

from sandbox_workers.base import MIB, WORK_DIR, Limits

MARKER_ENV = "RLBUS_SANDBOX_ID"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
ETC_FILES = ("ld.so.cache", "alternatives", "localtime", "passwd", "group")

# pid 1 of the sandbox: the command runs as its child, so it keeps normal signal
# semantics (a pid-1 process ignores SIGTERM, SIGXCPU and its own SIGKILL), and
# `--as-pid-1` makes the host-side bwrap wait on (reap) pid 1 itself.
INIT_SHIM = ("/bin/sh", "-c", '"$@" & wait $! 2>/dev/null', "rlbus-init")


def bwrap_path() -> str | None:
    """Where bwrap is, or None."""
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=1)
def system_binds() -> tuple[str, ...]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    etc = [f"/etc/{n}" for n in ETC_FILES] + sorted(glob.glob("/etc/python3*"))
    for path in etc:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


def bwrap_argv(
    bwrap: str,
    workdir: str,
    limits: Limits,
    marker: str,
    argv: list[str],
    inner_uid: int,
    ro_binds: tuple[tuple[str, str], ...] = (),
    env: dict[str, str] | None = None,
) -> list[str]:
    """The command line (see the module guarantees); `ro_binds`: extra (host path, inside path)
    pairs bound read-only (an agent harness's libraries, its task file, the endpoint's socket);
    `env`: extra variables set after the cleared environment (they may override HOME)."""
    extra = [a for host, inside in ro_binds for a in ("--ro-bind", host, inside)]
    extra_env = [a for k, v in (env or {}).items() for a in ("--setenv", k, v)]
    return [
        bwrap,
        "--as-pid-1",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(inner_uid),
        "--gid",
        str(inner_uid),
        *system_binds(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.tmp_mb * MIB),
        "--tmpfs",
        "/tmp",
        "--bind",
        workdir,
        WORK_DIR,
        *extra,
        "--remount-ro",
        "/",
        "--chdir",
        WORK_DIR,
        "--clearenv",
        "--setenv",
        "PATH",
        SANDBOX_PATH,
        "--setenv",
        "HOME",
        WORK_DIR,
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--setenv",
        MARKER_ENV,
        marker,
        *extra_env,
        "--",
        *INIT_SHIM,
        *argv,
    ]


_degraded_warned: set[str] = set()


def warn_degraded(source: str, why: str) -> None:
    """Print the red DEGRADED warning on stderr (rich console), once per process and `source`,
    whichever way degraded mode was granted: `sandbox.allow_degraded` / `--allow-degraded-sandbox`,
    or a (perhaps leftover) `RLBUS_SANDBOX_ALLOW_DEGRADED` in the environment (issue 27)."""
    if source in _degraded_warned:
        return
    _degraded_warned.add(source)
    from rich.console import Console

    Console(stderr=True).print(
        f"[bold red]sandbox isolation: DEGRADED (allowed by {source}; {why}): commands the policy emits run WITHOUT "
        "network or filesystem isolation (rlimits only): they reach this host's network, including a local "
        "unauthenticated NATS bus they can publish on, and its files. Install bubblewrap (apt-get install -y "
        "bubblewrap), or unset RLBUS_SANDBOX_ALLOW_DEGRADED / sandbox.allow_degraded to refuse instead.[/]",
        highlight=False,
        markup=True,
        soft_wrap=True,
    )
