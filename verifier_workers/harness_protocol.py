"""The code harness's framing and plain-data rules, spoken by both of its processes.

Part 1 of the harness program (`verifier_workers.harness`; stdlib only, joined with the
other parts into ONE program before it is shipped: `verifier_workers.harness_programs`).

Guarantees:
- `send(fd, obj)` writes one frame: a 4-byte big-endian length, then `marshal.dumps(obj, 4)`.
- `read_exact(fd, n, deadline)` returns exactly `n` bytes, or raises `Deadline` once
  `deadline` (monotonic; None: no deadline) passed, or `RunnerGone` at end of file.
- `plain(value)` is True only for exact builtin scalars (`PLAIN_ATOMS`) and exact
  list/tuple/set/frozenset/dict of them, at most 200 levels deep.
- `hmac_sha256(key, msg)` is RFC 2104 HMAC-SHA256 (hex) without importing hmac/hashlib.
"""

import marshal
import os
import select
import struct
import time

try:
    from _sha256 import sha256  # CPython <= 3.11: no OpenSSL import (startup time matters here)
except ImportError:  # pragma: no cover - newer / other interpreters
    from hashlib import sha256

START = "RLBUS-HARNESS-START"
RESULT = "RLBUS-RESULT "
PASS = "RLBUS-PASS "
MAX_MSG = 16 * 1024 * 1024
TAMPER_EXIT = 86
PLAIN_ATOMS = (type(None), bool, int, float, complex, str, bytes)
PLAIN_CONTAINERS = (list, tuple, set, frozenset, dict)


# ---------------------------------------------------------------- framing (both sides)
def send(fd, obj):
    data = marshal.dumps(obj, 4)
    msg = struct.pack(">I", len(data)) + data
    while msg:
        msg = msg[os.write(fd, msg) :]


def read_exact(fd, n, deadline):
    buf = b""
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Deadline()
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise Deadline()
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise RunnerGone()
        buf += chunk
    return buf


class Deadline(BaseException):
    """The run's deadline passed (not an Exception: test code cannot swallow it)."""


class RunnerGone(BaseException):
    """The runner closed its pipe (exited or crashed)."""


class RunnerTamper(BaseException):
    """The runner reported a tamper attempt."""


def hmac_sha256(key, msg):
    """RFC 2104 HMAC-SHA256 (hex), without importing hmac/hashlib."""
    if len(key) > 64:
        key = sha256(key).digest()
    key = key.ljust(64, b"\0")
    inner = sha256(bytes(b ^ 0x36 for b in key) + msg).digest()
    return sha256(bytes(b ^ 0x5C for b in key) + inner).hexdigest()


def plain(value, depth=0):
    """True iff value is plain data (exact builtin types, bounded depth)."""
    if depth > 200:
        return False
    t = type(value)
    if t in PLAIN_ATOMS:
        return True
    if t in (list, tuple, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if t is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False
