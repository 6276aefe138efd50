"""The program the repository tools run INSIDE an episode's sandbox (stdlib only, Python 3.8+).

`rollout_workers.repo_tools` sends this file's text as `python3 -c SOURCE OP ARGS...` with
the sandbox's work dir (the repository, `/work`) as cwd, so every tool call is one recorded
execution whose output is the observation the model sees (signed like any other).

Ops (argv after the source):
- `list PATH`: the files under PATH, sorted, one per line (junk dirs skipped, see `SKIP_DIRS`).
- `read PATH START END`: lines START..END (1-based, inclusive; 0 = to the end) with numbers.
- `grep PATTERN PATH IGNORE_CASE MAX`: the lines matching the Python regex PATTERN in the file
  PATH, or in every file under the directory PATH, as `LINE:TEXT` (`FILE:LINE:TEXT` under a
  directory), each clipped to `GREP_LINE_CHARS`; at most MAX lines, then one line counting the
  rest; `(no matching lines)` when none (exit 0); a pattern that does not compile: exit 2.
- `write PATH`: the content staged in `INPUT` becomes PATH (parents created).
- `patch`: the unified diff staged in `INPUT` is applied atomically: every file's hunks
  must match (exact context lines, any offset, no fuzz) or nothing is written.
- `state`: one JSON object {path: sha256 hex of its bytes} of every file of the
  repository (the rollout side diffs it against the original tree); bounded: a file over
  8 MiB is "toolarge", an unreadable one "unreadable", and a listing over 512 KiB is
  `{"": reason}` instead (so the listing never outgrows the sandbox's output cap).

Guarantees: paths must stay inside the repository (no absolute path, no `..`, no
symlink component) or the op fails with exit 2 and a message; a failing op writes
nothing; the staged input is removed by every op that reads it. Nothing here is a
security boundary: the sandbox is (the model can run any command anyway).
"""

import hashlib
import json
import os
import re
import sys

INPUT = ".rlbus-tool-input"
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class Refused(Exception):
    pass


def safe(path):
    """`path` normalized relative to the repository, refusing anything outside it."""
    path = path.strip()
    if path in ("", "."):
        return "."
    if path.startswith("/") or "\\" in path or ".." in path.split("/"):
        raise Refused("path %r must be relative to the repository root, without '..'" % path)
    norm = os.path.normpath(path)
    parts = norm.split(os.sep)
    for i in range(1, len(parts) + 1):
        if os.path.islink(os.path.join(*parts[:i])):
            raise Refused("path %r goes through a symlink" % path)
    return norm


def walk(top):
    out = []
    for root, dirs, files in os.walk(top):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS and not d.endswith(".egg-info") and not os.path.islink(os.path.join(root, d))
        )
        for name in files:
            full = os.path.normpath(os.path.join(root, name))
            if full != INPUT and not name.endswith(".pyc") and os.path.isfile(full) and not os.path.islink(full):
                out.append(full)
    return sorted(out)


def take_input():
    with open(INPUT, "rb") as f:
        data = f.read()
    os.remove(INPUT)
    return data.decode("utf-8")


def op_list(path):
    top = safe(path)
    if not os.path.isdir(top):
        raise Refused("no directory %r" % path)
    files = walk(top)
    print("\n".join(files) if files else "(no files)")


def op_read(path, start, end):
    p = safe(path)
    if not os.path.isfile(p):
        raise Refused("no file %r" % path)
    with open(p, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    lo = max(1, int(start))
    hi = len(lines) if int(end) <= 0 else min(len(lines), int(end))
    print("%s: lines %d-%d of %d" % (p, lo, hi, len(lines)))
    for i in range(lo, hi + 1):
        print("%6d  %s" % (i, lines[i - 1]))


GREP_LINE_CHARS = 300
GREP_MAX_FILE = 8 << 20


def op_grep(pattern, path, ignore_case, limit):
    try:
        rx = re.compile(pattern, re.IGNORECASE if ignore_case == "1" else 0)
    except re.error as exc:
        raise Refused("pattern %r does not compile: %s" % (pattern, exc)) from None
    p = safe(path)
    if os.path.isdir(p):
        files, named = walk(p), True
    elif os.path.isfile(p):
        files, named = [p], False
    else:
        raise Refused("no file or directory %r" % path)
    shown, more = 0, 0
    for f in files:
        if os.path.getsize(f) > GREP_MAX_FILE:
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            for i, line in enumerate(fh, 1):
                if not rx.search(line):
                    continue
                if shown >= int(limit):
                    more += 1
                    continue
                text = line.rstrip("\n")[:GREP_LINE_CHARS]
                print(("%s:%d:%s" % (f, i, text)) if named else ("%d:%s" % (i, text)))
                shown += 1
    if more:
        print("(%d more matching lines not shown: narrow the pattern or read a line range)" % more)
    if not shown:
        print("(no matching lines)")


def write(path, text):
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def op_write(path):
    p = safe(path)
    text = take_input()
    if os.path.isdir(p):
        raise Refused("%r is a directory" % path)
    write(p, text)
    print("wrote %s (%d lines, %d bytes)" % (p, len(text.splitlines()), len(text.encode())))


def strip_prefix(raw):
    raw = raw.split("\t")[0].strip()
    if raw == "/dev/null":
        return None
    if raw[:2] in ("a/", "b/"):
        raw = raw[2:]
    return safe(raw)


def parse(diff):
    """[(old path or None, new path or None, hunks)], each hunk (old_start, lines)."""
    lines = diff.splitlines(True)
    patches, i = [], 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = strip_prefix(lines[i][4:]), strip_prefix(lines[i + 1][4:])
            hunks, i = [], i + 2
            while i < len(lines) and HUNK.match(lines[i]):
                m = HUNK.match(lines[i])
                n_old, n_new = int(m.group(2) or 1), int(m.group(4) or 1)
                body, i = [], i + 1
                while i < len(lines) and (n_old > 0 or n_new > 0 or lines[i].startswith("\\")):
                    line = lines[i]
                    if line.startswith("\\"):
                        if body:
                            body[-1] = (body[-1][0], body[-1][1].rstrip("\n"))
                    elif line[:1] in (" ", "-", "+") or line in ("\n", "\r\n"):
                        tag = line[:1] if line[:1] in (" ", "-", "+") else " "
                        body.append((tag, line[1:] if line[:1] in (" ", "-", "+") else "\n"))
                        n_old -= tag != "+"
                        n_new -= tag != "-"
                    else:
                        raise Refused("malformed hunk line %r" % line[:60])
                    i += 1
                hunks.append((int(m.group(1)), body))
            if not hunks:
                raise Refused("no hunks for %s" % (new or old))
            patches.append((old, new, hunks))
        else:
            i += 1
    if not patches:
        raise Refused("no file patches found (need '--- a/PATH' / '+++ b/PATH' headers and @@ hunks)")
    return patches


def apply_hunks(text, hunks, path):
    src = text.splitlines(True)
    out, pos = [], 0
    for start, body in hunks:
        old = [t for tag, t in body if tag != "+"]
        want = max(0, start - 1)
        found = None
        for delta in range(0, len(src) + 1):
            for at in (want - delta, want + delta) if delta else (want,):
                if pos <= at <= len(src) - len(old) and src[at : at + len(old)] == old:
                    found = at
                    break
            if found is not None:
                break
        if found is None:
            raise Refused("%s: hunk at line %d does not match the file" % (path, start))
        out.extend(src[pos:found])
        out.extend(t for tag, t in body if tag != "-")
        pos = found + len(old)
    out.extend(src[pos:])
    return "".join(out)


def op_patch():
    diff = take_input()
    result = {}
    for old, new, hunks in parse(diff):
        if old is not None and not os.path.isfile(old):
            raise Refused("%s: not in the repository" % old)
        if old is None and new is not None and os.path.exists(new):
            raise Refused("%s: already exists" % new)
        current = result.get(old) if old in result else (open(old, encoding="utf-8").read() if old else "")
        patched = apply_hunks(current or "", hunks, new or old)
        if old and old != new:
            result[old] = None
        if new is not None:
            result[new] = patched
    for path, text in sorted(result.items()):
        if text is None:
            os.remove(path)
        else:
            write(path, text)
    print("applied: %s" % ", ".join(("deleted %s" % p) if t is None else p for p, t in sorted(result.items())))


STATE_BUDGET = 512 * 1024
MAX_STATE_FILE = 8 << 20


def op_state():
    """{path: sha256} of every file; a file over MAX_STATE_FILE is "toolarge", one that cannot be read
    "unreadable"; a listing over STATE_BUDGET bytes is replaced by {"": reason} (the policy's doing)."""
    state, size = {}, 2
    for path in walk("."):
        try:
            if os.path.getsize(path) > MAX_STATE_FILE:
                state[path] = "toolarge"
            else:
                with open(path, "rb") as f:
                    state[path] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            state[path] = "unreadable"
        size += len(json.dumps(path)) + len(state[path]) + 6
        if size > STATE_BUDGET:
            print(
                json.dumps(
                    {"": "the repository's state listing is over %d bytes (%d+ files)" % (STATE_BUDGET, len(state))}
                )
            )
            return
    print(json.dumps(state, sort_keys=True))


def main(argv):
    ops = {"list": op_list, "read": op_read, "grep": op_grep, "write": op_write, "patch": op_patch, "state": op_state}
    try:
        ops[argv[0]](*argv[1:])
    except Refused as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
