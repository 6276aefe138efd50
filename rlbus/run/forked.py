"""Workers forked from the launcher: the early roles of `rlbus up` share the modules it imported.

A role's start on a small machine is mostly imports (torch and transformers' model code: about
5 CPU-seconds per process here). The launcher imports them once (it needs them itself to build the
tiny model and run SFT) and forks the early roles from that state, before it has run any torch
operation or started a thread of its own: each child starts with those modules already loaded.

Guarantees:
- `fork_worker(argv, env, log_path)` runs `python -m rlbus.cli <argv>` (as `runpy` runs it) in a child of the
  launcher, in its own session (`os.setsid`, so its process group holds what it starts), with
  stdout and stderr unbuffered into `log_path` (appended), stdin from /dev/null and exactly `env`
  as its environment, like `Supervisor.start`'s `subprocess.Popen`. Its command line (process
  title) reads `<python> -m rlbus.cli <argv>`, as a fresh worker's would.
- `can_fork()` is False where forking is unsafe or the title cannot be set; the launcher then
  starts fresh processes.
- The child never runs the launcher's exit handlers (they are cleared before the worker starts)
  and never returns into the launcher's code: it ends with `os._exit` and the worker's exit code
  (1 after an uncaught exception, whose traceback goes to the log; a `SystemExit` message too).
- The child's logging starts afresh (`rlbus.log.configure_logging` runs again for the worker's role
  and level); a module logger the launcher had already used before the fork keeps the launcher's
  level (WARNING), since structlog caches a logger on first use.
- `ForkedWorker` is the part of `subprocess.Popen`'s interface the supervisor and the watchdog
  use (pid, returncode, poll, wait, send_signal, terminate, kill), on the child's pid.
"""

from __future__ import annotations

import atexit
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path


class ForkedWorker:
    """A forked worker, driven like a `subprocess.Popen`."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the child has exited (reaped here), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, code unknown
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code; `subprocess.TimeoutExpired` after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Signal the child while it runs (a no-op once it has exited)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fresh_logging() -> None:
    """Forget the launcher's structlog set-up (level WARNING, its role): the worker configures its own."""
    import structlog

    import rlbus.log

    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    rlbus.log._configured = False


def can_fork() -> bool:
    """Whether this process may fork workers: it has no thread but the main one (a forked child
    would inherit the locks other threads hold), and `setproctitle` can give the child a
    worker's command line."""
    import threading
    from importlib.util import find_spec

    return threading.active_count() == 1 and find_spec("setproctitle") is not None


def fork_worker(argv: list[str], env: dict[str, str], log_path: Path) -> ForkedWorker:
    """Fork `rlbus <argv>` as a worker of this launcher (see the module guarantees)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedWorker(pid, argv)
    code = 1
    try:  # the child: never returns from this function
        os.setsid()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        import setproctitle  # before the environment changes: it finds argv's memory next to environ's

        # what a fresh worker's command line reads (ps, pgrep -f, `rlbus up --resume`'s check of leftover workers)
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "rlbus.cli", *argv]))
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()  # the launcher's handlers (its server, its console) are not this process's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _fresh_logging()
        import runpy

        sys.argv = [sys.executable, *argv]  # exactly `python -m rlbus.cli <argv>`, with the imports done
        runpy.run_module("rlbus.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (1 if exc.code else 0)
    except BaseException:  # noqa: BLE001 - the child's last word goes to its log
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
