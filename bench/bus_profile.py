"""Profiling the worker processes of bench/bus.py (`python bench/bus.py --profile DIR`), and
counting the NATS messages each role sends and receives per trajectory (every run).

Message counts: the server's `/connz` monitoring endpoint, read before and after the window,
gives each connection's in_msgs (what the client published: messages, acks, API requests)
and out_msgs (what the server delivered to it: fetched messages, replies); connections are
named `rlbus-<role>` by `bus.session`.

Two profilers, both writing into DIR, one file set per worker role:
- `py-spy` (default): attaches to each running worker for exactly the measurement window
  (`py-spy record --pid --nonblocking`, 100 Hz, idle samples dropped), so startup and
  warm-up do not count and the workers run at nearly full speed. Raw collapsed stacks
  (`<role>.pyspy.txt`) are summarised as `<role>.pyspy-self.txt` (the leaf frame of each
  sample: where the CPU went) and `<role>.pyspy-inclusive.txt` (every frame on the stack).
- `cprofile`: each worker runs under `python -m cProfile -o <role>.prof` for its whole life
  (written when SIGTERM stops it), summarised as `<role>.cumulative.txt` and
  `<role>.tottime.txt`. cProfile slows the workers several-fold and times wall clock, so
  its figures shift toward waiting (socket sends, GIL hand-offs); py-spy's are the ones to
  cut by.
"""

from __future__ import annotations

import io
import json
import pstats
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from urllib.request import urlopen

PROFILERS = ("py-spy", "cprofile")
PY_SPY_RATE = 100


def cprofile_prefix(profile_dir: Path | None, profiler: str, role: str) -> list[str]:
    """The interpreter arguments that run a worker under cProfile (none unless profiling with it)."""
    if profile_dir is None or profiler != "cprofile":
        return []
    return ["-m", "cProfile", "-o", str(profile_dir / f"{role}.prof")]


def py_spy_bin() -> str:
    """The py-spy executable beside this interpreter, else on PATH (RuntimeError saying how to install it)."""
    here = Path(sys.executable).with_name("py-spy")
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("py-spy is not installed: `.venv/bin/pip install py-spy`, or use --profiler cprofile")
    return found


def start_py_spy(pids: dict[str, int], profile_dir: Path, seconds: float) -> list[subprocess.Popen]:
    """Attach py-spy to each worker for `seconds`; wait on the returned processes after the window."""
    exe = py_spy_bin()
    procs = []
    for role, pid in pids.items():
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(round(seconds))), "--rate", str(PY_SPY_RATE)]
        cmd += ["--nonblocking", "--format", "raw", "--output", str(profile_dir / f"{role}.pyspy.txt")]
        log = open(profile_dir / f"{role}.pyspy.log", "wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()
    return procs


def _frame_name(frame: str) -> str:
    """`func (path/to/file.py:LINE)` -> `func (file.py:LINE)`."""
    name, _, where = frame.partition(" (")
    return f"{name} ({Path(where.rstrip(')')).name})" if where else name


def summarise_py_spy(raw: Path, top: int = 60) -> dict[str, str]:
    """Self and inclusive sample shares of a py-spy raw (collapsed stacks) file, as text tables."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), [_frame_name(f) for f in stack.split(";")]
        total += n
        self_c[frames[-1]] += n
        for f in set(frames):
            incl_c[f] += n
    out = {}
    for kind, counter in (("self", self_c), ("inclusive", incl_c)):
        lines = [f"{raw.name}: {total} samples at {PY_SPY_RATE} Hz (idle dropped); {kind} share", ""]
        lines += [f"{100 * c / max(1, total):6.2f}%  {c:7d}  {f}" for f, c in counter.most_common(top)]
        out[kind] = "\n".join(lines) + "\n"
    return out


def write_summaries(profile_dir: Path, top: int = 60) -> list[Path]:
    """Text summaries of every profile in `profile_dir` (see the module docstring); their paths."""
    written = []
    for prof in sorted(profile_dir.glob("*.prof")):
        for key in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(str(prof), stream=buf).strip_dirs().sort_stats(key).print_stats(top)
            path = prof.with_suffix(f".{key}.txt")
            path.write_text(buf.getvalue())
            written.append(path)
    for raw in sorted(profile_dir.glob("*.pyspy.txt")):
        role = raw.name.removesuffix(".pyspy.txt")
        for kind, text in summarise_py_spy(raw, top).items():
            path = profile_dir / f"{role}.pyspy-{kind}.txt"
            path.write_text(text)
            written.append(path)
    return written


def connz(monitor_url: str | None) -> dict[str, dict[str, int]]:
    """in_msgs/out_msgs/in_bytes/out_bytes per connection name (summed over same-named ones);
    {} without a monitor URL or when the endpoint does not answer."""
    if not monitor_url:
        return {}
    try:
        with urlopen(f"{monitor_url}/connz?limit=4096", timeout=5) as r:
            conns = json.load(r).get("connections") or []
    except (OSError, ValueError):
        return {}
    out: dict[str, dict[str, int]] = {}
    for c in conns:
        agg = out.setdefault(c.get("name") or f"cid{c.get('cid')}", {})
        for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes"):
            agg[k] = agg.get(k, 0) + int(c.get(k, 0))
    return out


def msgs_per_trajectory(before: dict, after: dict, trajectories: int) -> dict[str, dict[str, float]]:
    """Per connection name: (after - before) in_msgs and out_msgs per trajectory."""
    if not trajectories:
        return {}
    return {
        name: {
            k: round((a.get(k, 0) - before.get(name, {}).get(k, 0)) / trajectories, 3) for k in ("in_msgs", "out_msgs")
        }
        for name, a in sorted(after.items())
    }
