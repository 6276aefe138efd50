"""The framed protocol between the host and the docker sandbox's resident agent.

Standalone, stdlib only (Python 3.9+): the first part of the agent program
(`sandbox_workers.docker_agent`) and the module the host reads the protocol's
constants from (`sandbox_workers.docker_oneshot`), so both sides share one definition.

Frames, both directions: a 4-byte big-endian length (`HEADER`), then the payload.
- host -> agent: `marshal` data (the host is the only writer of the agent's stdin),
  `{"op": "run", "files": [(path, bytes)...], "argv": [...] | "python": path,
  "timeout": s, "cap": bytes per stream, "report": [paths], "limits": {"cpu": s,
  "fsize": bytes, "nofile": n}}`, every key present (exactly one of `argv` and
  `python`). A frame over `MAX_REQUEST` bytes ends the agent.
- agent -> host: `REPLY` (fixed fields, no object decoding on the host) + stdout +
  stderr + message. The first frame, unasked, is a `HELLO` carrying `VERSION`; every
  request the agent reads gets exactly one `RESULT` or `ERROR`, or the agent exits (the
  host sees EOF).
- `HeadTail` keeps at most `cap` bytes of a stream (head and tail halves) plus a
  one-line marker that says how many bytes were dropped between them.
"""

import os
import struct

VERSION = 1
MAX_REQUEST = 256 * 1024 * 1024
HEADER = struct.Struct(">I")
REPLY = struct.Struct(">BiBIdIIII")
"""kind, exit_code, flags, oom_kills, duration_s, exists mask, len stdout, len stderr, len message."""
HELLO, RESULT, ERROR = 0, 1, 2
TIMED_OUT, TRUNC_OUT, TRUNC_ERR, CLEAN = 1, 2, 4, 8


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send(kind, exit_code=0, flags=0, oom=0, duration=0.0, exists=0, out=b"", err=b"", msg=b""):
    head = REPLY.pack(kind, exit_code, flags, oom, duration, exists, len(out), len(err), len(msg))
    body = head + out + err + msg
    write_all(1, HEADER.pack(len(body)) + body)


class HeadTail:
    """Keeps the first cap//2 and last cap - cap//2 bytes of a stream."""

    def __init__(self, cap):
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk):
        self.total += len(chunk)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_cap:
            self.tail += chunk
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def value(self):
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped <= 0:
            return bytes(self.head + self.tail), False
        return bytes(self.head) + ("\n...[truncated %d bytes]...\n" % dropped).encode() + bytes(self.tail), True
