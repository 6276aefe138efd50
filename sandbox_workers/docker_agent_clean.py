"""The docker sandbox agent's own work on the container: write the files, kill, wipe, prove clean.

Standalone, stdlib only (Python 3.9+): the second part of the agent program
(`sandbox_workers.docker_agent`); it runs as the agent (uid 0 with only SETUID, SETGID
and KILL) and never runs untrusted code.

- File work is done with the effective uid/gid of the sandbox user (`USER`, 65534:
  `seteuid`/`setegid` only, real and saved ids stay 0), so the agent can create or
  remove nothing the sandbox user could not. Request paths are relative to /work (or
  absolute under it); `..`, an empty path, or a path outside /work is a ValueError, a
  component that is a symlink or not a directory is refused, and files are opened
  with O_NOFOLLOW.
- `kill_all` SIGKILLs every process but pid 1 (docker-init) and the agent, with the
  agent's own CAP_KILL and without forking (a fork bomb at the pids limit cannot stop
  it), reaps its children, and is True only once no such process is left.
- `wipe_and_prove` empties /work, /tmp and /dev/mqueue as the sandbox user (modes
  repaired first), removes SysV IPC (`ipcrm -a` as the sandbox user, only when
  /proc/sysvipc lists something), then checks that the dirs are empty, /proc/sysvipc is
  empty and no process but pid 1 and the agent is left; it returns every problem
  found (none: the container is clean).
"""

import os
import stat
import time

from sandbox_workers.docker_agent_protocol import write_all

USER = 65534
WORK = "/work"
WIPE_DIRS = ("/work", "/tmp", "/dev/mqueue")
OOM_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")
CHILD_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": WORK,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}


class AsUser:
    """Effective uid/gid 65534 for file work (real and saved uid stay 0)."""

    def __enter__(self):
        os.setegid(USER)
        os.seteuid(USER)

    def __exit__(self, *exc):
        os.seteuid(0)
        os.setegid(0)


def safe_path(path):
    if path.startswith(WORK + "/"):
        path = path[len(WORK) + 1 :]
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or path.startswith("/"):
        raise ValueError("bad path %r" % path)
    return parts


def write_files(files):
    with AsUser():
        for path, data in files:
            parts = safe_path(path)
            d = WORK
            for part in parts[:-1]:
                d = d + "/" + part
                try:
                    os.mkdir(d, 0o755)
                except FileExistsError:
                    if os.path.islink(d) or not os.path.isdir(d):
                        raise ValueError("not a directory: %r" % d) from None
            fd = os.open(d + "/" + parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)


def report_exists(paths):
    """Bit i set when `paths[i]` (the first 32) exists under /work, looked at as the sandbox user."""
    exists = 0
    with AsUser():
        for i, path in enumerate(paths[:32]):
            try:
                if os.path.lexists(WORK + "/" + "/".join(safe_path(path))):
                    exists |= 1 << i
            except ValueError:
                pass
    return exists


def oom_kills():
    for name in OOM_FILES:
        try:
            with open(name) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return 0


def others():
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def kill_all(z, wait_s=3.0):
    """SIGKILL every process but pid 1 and the agent, reap ours; True once none is left."""
    end = time.monotonic() + wait_s
    delay = 0.0005
    while True:
        try:
            os.kill(-1, 9)
        except OSError:
            pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            if z is not None and pid == z.pid and z.status is None:
                z.status = status
        if not others():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def remove_tree(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
        for entry in os.listdir(path):
            remove_tree(path + "/" + entry)
        os.rmdir(path)
    else:
        os.unlink(path)


def ipc_left():
    left = []
    for kind in ("shm", "msg", "sem"):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        left += ["%s %s" % (kind, r.split()[1] if len(r.split()) > 1 else "?") for r in rows if r.strip()]
    return left


def run_ipcrm():
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(USER, USER, USER)
            os.setresuid(USER, USER, USER)
            fd = os.open("/dev/null", os.O_RDWR)
            for i in (0, 1, 2):
                os.dup2(fd, i)
            os.closerange(3, 1 << 16)
            os.execvpe("ipcrm", ["ipcrm", "-a"], dict(CHILD_ENV))
        finally:
            os._exit(127)
    os.waitpid(pid, 0)


def _entries(d, problems):
    """Names in directory `d` ([] if it does not exist; an unreadable one is a problem)."""
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []
    except OSError as exc:
        problems.append("list %s: %s" % (d, exc.strerror))
        return []


def wipe_and_prove():
    """Empty the writable places as 65534, then prove it; returns the problems found."""
    problems = []
    with AsUser():
        try:
            os.chmod(WORK, 0o700)
        except OSError as exc:
            problems.append("chmod /work: %s" % exc.strerror)
        for d in WIPE_DIRS:
            for entry in _entries(d, problems):
                try:
                    remove_tree(d + "/" + entry)
                except OSError:
                    pass
        for d in WIPE_DIRS:
            problems += ["left %s/%s" % (d, e) for e in _entries(d, problems)[:5]]
    if ipc_left():
        run_ipcrm()
        problems += ipc_left()
    if others():
        problems += ["pid %d" % p for p in others()[:5]]
    return problems
