"""`process` backend: bubblewrap namespaces + rlimits (+ a cgroup v2 where delegated).

Guarantees (on top of those in `sandbox_workers.base`):

- With bwrap (`isolation="bwrap"`): every namespace unshared (no network: the host's
  loopback is unreachable), no capabilities, a new session (no TTY injection), nested
  user namespaces disabled, a read-only root holding only read-only system dirs
  (/usr, /bin, /lib*, and the few /etc files the system `python3` needs), a sized tmpfs
  `/tmp` (fresh per `execute`), and the per-sandbox host work dir bound read-write at
  `/work`, the cwd. The command runs in its own pid namespace whose init is bwrap's, so
  when the command ends or is killed, every process it started (double-forked daemons
  included) dies with it; `--die-with-parent` ties that namespace to the host side.
- When the host side runs as root, the command runs as a dedicated unprivileged host
  uid/gid (one per sandbox, from a high range no account uses), dropped in the child
  before bwrap is exec'd, so RLIMIT_NPROC binds and the sandbox owns only its work dir.
- rlimits on every execute: address space (memory_mb), CPU, file size, nofile, nproc
  (pids), no core dumps. A cgroup v2 with pids.max/memory.max is added when a writable,
  delegated one exists (`RLBUS_SANDBOX_CGROUP` or our own cgroup with pids+memory in
  its subtree_control); otherwise it is skipped with a debug log.
- On timeout: SIGKILL to the process group, the cgroup (cgroup.kill) and every process
  owned by the sandbox uid; `execute` returns only after they are gone.
- Commands find the system interpreter: PATH is /usr/local/bin:/usr/bin:/bin and the
  environment is cleared, so the project's venv is never used inside.
- Fails closed: where bwrap is missing or cannot create namespaces, `start` raises
  `SandboxRefused` (its message names the fix: `apt-get install bubblewrap`, or the
  docker backend) unless degraded mode was allowed on purpose (`allow_degraded=True`,
  which `sandbox.allow_degraded` / `--allow-degraded-sandbox` give, or env
  `RLBUS_SANDBOX_ALLOW_DEGRADED=1`, how the setting reaches code verifiers). Asking for
  `isolation="degraded"` needs the same permission. Allowed, the sandbox degrades to
  uid drop + rlimits only, reports `isolation="degraded"`, logs `sandbox.degraded` and
  prints a red warning on stderr naming what allowed it (config or env var). Degraded mode has no network or filesystem isolation: the command sees
  the host's network and filesystem; only its cwd, HOME and TMPDIR are private (the
  per-sandbox work dir, mode 0700).

Blocking API: call `execute` from a thread in async code (e.g. `asyncio.to_thread`)
that lives as long as the sandbox (bwrap's --die-with-parent follows the thread).

Module layout: `sandbox_workers.process_bwrap` (the bwrap command line),
`sandbox_workers.process_host` (the /proc and cgroup scans) and this module
(`ProcessSandbox`: lifecycle, execute, kill, files).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import structlog

from sandbox_workers.base import (
    MIB,
    ExecResult,
    HeadTailBuffer,
    Isolation,
    Limits,
    Sandbox,
    SandboxRefused,
    decode_output,
    sandbox_path_parts,
)
from sandbox_workers.process_bwrap import MARKER_ENV, SANDBOX_PATH, bwrap_argv, bwrap_path, warn_degraded
from sandbox_workers.process_host import children, count_uid_procs, find_cgroup_parent, uid_pids

log = structlog.get_logger()

INNER_UID = 65534
UID_RANGE = (2_000_000, 3_000_000)
KILL_GRACE_S = 2.0
EXIT_GRACE_S = 0.2
MAX_READ_FILE = 256 * MIB
OOM_HINTS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
ALLOW_DEGRADED_ENV = "RLBUS_SANDBOX_ALLOW_DEGRADED"
_bwrap_probe: dict[bool, tuple[bool, str]] = {}
_SETPRIV = shutil.which("setpriv")
_PRLIMIT = shutil.which("prlimit")
_LIBC = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS = 38


def degraded_allowed_by_env() -> bool:
    """True when env `RLBUS_SANDBOX_ALLOW_DEGRADED` is 1/true/yes (set by `rlbus worker` from the config)."""
    return os.environ.get(ALLOW_DEGRADED_ENV, "").strip().lower() in ("1", "true", "yes")


def refusal_message(why: str) -> str:
    """Why the process backend refuses to run, and the ways out."""
    return (
        f"the process sandbox cannot isolate here ({why}), so it refuses to run commands: "
        "without bubblewrap it would have no network or filesystem isolation. Fix: "
        "apt-get install -y bubblewrap (and allow unprivileged user namespaces), or use the docker "
        "backend (sandbox.backend=docker). To run unisolated on purpose: --allow-degraded-sandbox, "
        "or --set sandbox.allow_degraded=true"
    )


class ProcessSandbox(Sandbox):
    """A sandbox made of a host work dir, a dedicated uid, bwrap and rlimits."""

    def __init__(self, isolation: str = "auto", base_dir: str | None = None, allow_degraded: bool = False) -> None:
        """isolation: "auto" (bwrap if it works, else degraded when allowed), "bwrap" (required),
        "degraded" (explicit; needs allow_degraded). allow_degraded: run without bwrap on purpose
        (also allowed by env `RLBUS_SANDBOX_ALLOW_DEGRADED=1`); else `start` raises `SandboxRefused`."""
        self.requested = isolation
        self.allow_degraded = allow_degraded or degraded_allowed_by_env()
        self.degraded_source = (
            "sandbox.allow_degraded (or --allow-degraded-sandbox)"
            if allow_degraded
            else f"env {ALLOW_DEGRADED_ENV}={os.environ.get(ALLOW_DEGRADED_ENV, '')}"
        )
        self.base_dir = base_dir
        self.id = uuid.uuid4().hex[:12]
        self.marker = f"rlbus-sbx-{self.id}"
        self.limits = Limits()
        self.default_timeout = 30.0
        self.isolation: Isolation = "degraded"
        self.workdir: str | None = None
        self.cgroup: Path | None = None
        self.is_root = os.geteuid() == 0
        self.uid = os.getuid()
        self.gid = os.getgid()
        self._bwrap: str | None = None

    # -- lifecycle -----------------------------------------------------------------
    def start(self, image: str | None = None, limits: Limits | None = None, timeout: float = 30.0) -> None:
        """Create the work dir and pick the isolation; `image` is ignored (host system)."""
        self.limits = limits or Limits()
        self.default_timeout = timeout
        if self.is_root:
            while True:  # a uid no live process holds (the kill sweep is per uid)
                self.uid = self.gid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
                if not uid_pids(self.uid):
                    break
        self.workdir = tempfile.mkdtemp(prefix=f"{self.marker}-", dir=self.base_dir)
        try:
            self._prepare_workdir()
            self.isolation = self._choose_isolation()
            self._make_cgroup()
        except BaseException:
            self.close()
            raise
        log.debug(
            "sandbox.started",
            sandbox=self.id,
            isolation=self.isolation,
            uid=self.uid,
            cgroup=str(self.cgroup) if self.cgroup else None,
        )

    def _prepare_workdir(self) -> None:
        os.chmod(self.workdir, 0o700)
        if self.is_root:
            os.chown(self.workdir, self.uid, self.gid)

    def _choose_isolation(self) -> Isolation:
        if self.requested == "degraded":
            why = "isolation='degraded' was asked for"
        else:
            self._bwrap = bwrap_path()
            ok, why = self._probe_bwrap()
            if ok:
                return "bwrap"
            if self.requested == "bwrap":
                raise SandboxRefused(f"bwrap required but unusable: {why}")
        if not self.allow_degraded:
            raise SandboxRefused(refusal_message(why))
        log.warning(
            "sandbox.degraded",
            sandbox=self.id,
            reason=why,
            allowed_by=self.degraded_source,
            fix="apt-get install -y bubblewrap (and allow user namespaces)",
        )
        warn_degraded(self.degraded_source, why)  # on the console too, however it was allowed
        return "degraded"

    def _probe_bwrap(self) -> tuple[bool, str]:
        if self._bwrap is None:
            return False, "bwrap not found on PATH"
        if self.is_root not in _bwrap_probe:
            argv = bwrap_argv(self._bwrap, self.workdir, self.limits, self.marker, ["/usr/bin/true"], INNER_UID)
            p = None
            try:
                p = self._spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={})
                _, err = p.communicate(timeout=10)
                ok, why = p.returncode == 0, err.decode(errors="replace").strip()
            except (OSError, subprocess.TimeoutExpired) as exc:
                ok, why = False, repr(exc)
                if p is not None:
                    self._kill_everything(p)
                    p.wait()
            _bwrap_probe[self.is_root] = (ok, why or "bwrap probe failed")
        return _bwrap_probe[self.is_root]

    def _make_cgroup(self) -> None:
        parent = find_cgroup_parent()
        if parent is None:
            log.debug("sandbox.no_cgroup", sandbox=self.id)
            return
        cg = parent / self.marker
        try:
            cg.mkdir()
            (cg / "pids.max").write_text(str(self.limits.pids))
            (cg / "memory.max").write_text(str(self.limits.memory_mb * MIB))
            try:
                (cg / "memory.swap.max").write_text("0")
            except OSError:
                pass
            self.cgroup = cg
        except OSError as exc:
            log.debug("sandbox.no_cgroup", sandbox=self.id, error=repr(exc))

    def close(self) -> None:
        """Kill every sandbox process, remove the work dir and the cgroup (idempotent)."""
        if self.workdir is None:
            return
        self._kill_everything(None)
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError:
                pass
            self.cgroup = None

    def reset(self) -> None:
        """No process left, an empty work dir (same path)."""
        self._require_started()
        self._kill_everything(None)
        shutil.rmtree(self.workdir, ignore_errors=True)
        os.mkdir(self.workdir, 0o700)
        self._prepare_workdir()

    def _require_started(self) -> None:
        if self.workdir is None:
            raise RuntimeError("sandbox not started (or closed)")

    # -- execute -------------------------------------------------------------------
    def _rlimits(self) -> list[tuple[int, int, int, str]]:
        """(resource, soft, hard, prlimit option) for every limit we set."""
        lim = self.limits
        nproc = lim.pids
        if not self.is_root:  # no dedicated uid: our own processes count too
            nproc += count_uid_procs(self.uid)
        return [
            (resource.RLIMIT_AS, lim.memory_mb * MIB, lim.memory_mb * MIB, "--as"),
            (resource.RLIMIT_CPU, lim.cpu_seconds, lim.cpu_seconds + 1, "--cpu"),
            (resource.RLIMIT_FSIZE, lim.file_size_mb * MIB, lim.file_size_mb * MIB, "--fsize"),
            (resource.RLIMIT_NOFILE, lim.nofile, lim.nofile, "--nofile"),
            (resource.RLIMIT_NPROC, nproc, nproc, "--nproc"),
            (resource.RLIMIT_CORE, 0, 0, "--core"),
        ]

    def _spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv in a new session with the rlimits, as the sandbox uid.

        Fast path (no cgroup to join): `setpriv` + `prlimit` exec'd in front, which lets
        Python vfork. Otherwise a preexec_fn does the same work in the child.
        """
        rlimits = self._rlimits()
        if self.cgroup is None and _PRLIMIT and (_SETPRIV or not self.is_root):
            prefix = []
            if self.is_root:
                prefix = [_SETPRIV, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--no-new-privs"]
            prefix += [_PRLIMIT, *(f"{opt}={soft}:{hard}" for _, soft, hard, opt in rlimits), "--"]
            return subprocess.Popen(prefix + argv, start_new_session=True, **kw)

        def preexec() -> None:
            if self.cgroup is not None:
                fd = os.open(str(self.cgroup / "cgroup.procs"), os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
            for res, soft, hard, _ in rlimits:
                resource.setrlimit(res, (soft, hard))
            _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            if self.is_root:
                os.setgroups([])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)

        # only syscalls run in the child; used only when a cgroup must be joined first
        return subprocess.Popen(argv, preexec_fn=preexec, start_new_session=True, **kw)

    def execute(
        self,
        cmd: list[str] | str,
        timeout: float | None = None,
        *,
        ro_binds: tuple[tuple[str, str], ...] = (),
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `cmd` in the sandbox; see the module docstring for the guarantees. `ro_binds`
        (bwrap only; (host, inside) pairs bound read-only) and `env` (added to the cleared
        environment) are for agent harnesses (`rollout_workers.agent_harness`)."""
        self._require_started()
        if self.isolation == "degraded" and not self.allow_degraded:  # start refuses first; never reached
            raise SandboxRefused(refusal_message("degraded without permission"))
        timeout = self.default_timeout if timeout is None else timeout
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        extra = env
        env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", MARKER_ENV: self.marker}
        if self.isolation == "bwrap":
            argv = bwrap_argv(self._bwrap, self.workdir, self.limits, self.marker, argv, INNER_UID, ro_binds, extra)
            cwd = "/"
        else:
            env.update(HOME=self.workdir, TMPDIR=self.workdir, PYTHONDONTWRITEBYTECODE="1", **(extra or {}))
            cwd = self.workdir
        oom_before = self._oom_kills()
        t0 = time.monotonic()
        try:
            proc = self._spawn(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env
            )
        except OSError as exc:  # e.g. command not found in degraded mode
            return ExecResult(127, "", f"{exc}\n", duration_ms=0.0, isolation=self.isolation)
        out, err, timed_out = self._drain(proc, t0 + timeout)
        self._kill_everything(proc)
        rc = proc.wait()
        duration_ms = (time.monotonic() - t0) * 1000
        exit_code = 128 - rc if rc < 0 else rc
        oom = self._oom_kills() > oom_before or any(h in err.head or h in err.tail for h in OOM_HINTS)
        return ExecResult(
            exit_code=exit_code,
            stdout=decode_output(out.getvalue()),
            stderr=decode_output(err.getvalue()),
            timed_out=timed_out,
            oom=oom,
            truncated=out.truncated or err.truncated,
            duration_ms=round(duration_ms, 3),
            isolation=self.isolation,
        )

    def _drain(self, proc: subprocess.Popen, deadline: float) -> tuple[HeadTailBuffer, HeadTailBuffer, bool]:
        """Read both pipes until EOF, the deadline, or a short grace after exit."""
        cap = self.limits.output_cap_bytes
        bufs = {proc.stdout.fileno(): HeadTailBuffer(cap), proc.stderr.fileno(): HeadTailBuffer(cap)}
        sel = selectors.DefaultSelector()
        for fd in bufs:
            try:
                fcntl.fcntl(fd, 1031, MIB)  # F_SETPIPE_SZ: fewer wake-ups on floods
            except OSError:
                pass
            sel.register(fd, selectors.EVENT_READ)
        timed_out, exited_at = False, None
        try:
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    timed_out = proc.poll() is None
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > EXIT_GRACE_S:
                    break  # something outside the namespace holds the pipes (degraded)
                for key, _ in sel.select(min(deadline - now, 0.1)):
                    chunk = os.read(key.fd, MIB)
                    if chunk:
                        bufs[key.fd].feed(chunk)
                    else:
                        sel.unregister(key.fd)
        finally:
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
        if timed_out:
            log.info("sandbox.timeout", sandbox=self.id, pid=proc.pid)
        out, err = bufs.values()
        return out, err, timed_out

    def _kill_everything(self, proc: subprocess.Popen | None) -> None:
        """SIGKILL the group, the cgroup and the sandbox uid's processes; wait till gone.

        bwrap's children (the namespace's pid 1) are killed first so that bwrap itself
        reaps them: an orphan would otherwise wait on the host's init, which in some
        containers never reaps, and its zombie would count against RLIMIT_NPROC.
        """
        if proc is not None and proc.poll() is None and self.isolation == "bwrap":
            for pid in children(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.cgroup is not None:
            try:
                (self.cgroup / "cgroup.kill").write_text("1")
            except OSError:
                pass
        if not self.is_root:
            return  # not a dedicated uid: the pid namespace / group is all we can kill
        end = time.monotonic() + KILL_GRACE_S
        while pids := uid_pids(self.uid):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > end:
                log.error("sandbox.kill_incomplete", sandbox=self.id, pids=pids)
                break
            time.sleep(0.005)

    def _oom_kills(self) -> int:
        if self.cgroup is None:
            return 0
        try:
            for line in (self.cgroup / "memory.events").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    # -- files ---------------------------------------------------------------------
    def _open_parent(self, parts: list[str], create: bool) -> int:
        """An fd of the directory holding parts[-1], walked without following symlinks."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        fd = os.open(self.workdir, flags)
        try:
            for name in parts[:-1]:
                if create:
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                        if self.is_root:
                            os.chown(name, self.uid, self.gid, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                nfd = os.open(name, flags, dir_fd=fd)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _check_owned(self, fd: int, path: str) -> os.stat_result:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file: {path!r}")
        if self.is_root and st.st_uid != self.uid:
            raise PermissionError(errno.EPERM, f"not the sandbox's file: {path!r}")
        return st

    def read_file(self, path: str) -> bytes:
        """Bytes of a regular file the sandbox owns, under the work dir (no symlinks)."""
        self._require_started()
        parts = sandbox_path_parts(path)
        dfd = self._open_parent(parts, create=False)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            st = self._check_owned(fd, path)
            if st.st_size > MAX_READ_FILE:
                raise OSError(errno.EFBIG, f"file too large: {path!r} ({st.st_size} bytes)")
            return f.read(MAX_READ_FILE)

    def write_file(self, path: str, data: bytes) -> None:
        """Create or replace a file under the work dir, owned by the sandbox uid."""
        self._require_started()
        parts = sandbox_path_parts(path)
        dfd = self._open_parent(parts, create=True)
        base = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        created = True
        try:
            try:
                fd = os.open(parts[-1], base | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            except FileExistsError:
                created = False
                fd = os.open(parts[-1], base, dir_fd=dfd)
        finally:
            os.close(dfd)
        with os.fdopen(fd, "wb") as f:
            if created and self.is_root:
                os.fchown(fd, self.uid, self.gid)
            self._check_owned(fd, path)
            os.ftruncate(fd, 0)
            f.write(data)
