"""The repo guard's trust rules and audit hook: which code is trusted, what candidate code may not do.

Part 2 of the guard program (`verifier_workers.repo_harness_guard`, installed in the sandbox
as ONE module `_rlbus_guard`; stdlib only, joined with the other parts before it is shipped).

Guarantees:
- `trusted_prefixes(extra)` / `make_is_trusted(trusted, files)`: code is trusted when it comes
  from the stdlib, site-packages, the guard's own directory, `extra`, importlib's frozen
  modules, or one of `files` (the repository's protected files, written by the verifier).
- `audit_hook(...)`: refuses (tamper) frame access (`sys._getframe`, `tb_frame`, `gi_frame`,
  `cr_frame`, `ag_frame`) unless the requester is the guard itself, a stdlib user that keeps
  the frame to itself (namedtuple, typing, enum, logging's caller lookup, traceback's
  summaries) or trusted code with no candidate frame on the stack; `sys._current_frames`,
  `sys.settrace`, `sys.setprofile`, `gc` walks, ctypes memory access, setting a function's
  `__code__`/`__kwdefaults__`, opening any `/proc/*/mem`, writes under /work, and compiling
  code under a trusted file name with other text.
"""

import os
import sys
import sysconfig
import types


def trusted_prefixes(extra=()):
    paths = sysconfig.get_paths()
    dirs = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)]
    out = {d.rstrip("/") + "/" for d in dirs} | {os.path.realpath(d) + "/" for d in dirs}
    out.update(p.rstrip("/") + "/" for p in extra)
    out.add(os.path.dirname(os.path.realpath(__file__)) + "/")
    return tuple(sorted(out))


def code_of(fn):
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def _nested(code, name):
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and c.co_name == name:
            return c
    return None


def internal_frame_users():
    """{code: set of allowed parent codes, or None for any}: stdlib code that keeps frames to itself."""
    import collections
    import enum
    import logging
    import traceback
    import typing

    ss = traceback.StackSummary
    ext = code_of(ss.extract)
    gen = _nested(ext, "extended_frame_gen") if ext else None
    extract_from = code_of(ss._extract_from_extended_frame_gen)
    out = {
        code_of(collections.namedtuple): None,
        code_of(getattr(typing, "_caller", None)): None,
        code_of(getattr(enum.EnumType, "_create_", None)): None,
        code_of(traceback.extract_stack): None,
        code_of(traceback.format_stack): None,
        code_of(traceback.print_stack): None,
        code_of(logging.currentframe): {code_of(logging.Logger.findCaller)},
        code_of(logging.Handler.handleError): None,
        code_of(traceback.walk_tb): {gen},
        code_of(traceback.walk_stack): {gen},
        code_of(getattr(traceback, "_walk_tb_with_full_positions", None)): {extract_from},
    }
    out.pop(None, None)
    return out


FRAME_ATTRS = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame"))
TRACE_EVENTS = frozenset(("sys.settrace", "sys.setprofile"))
ALWAYS_FORBIDDEN = frozenset(("sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents"))
PATH_EVENTS = frozenset(
    (
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.symlink",
        "os.link",
        "os.utime",
        "shutil.rmtree",
    )
)


def make_is_trusted(trusted, files=frozenset()):
    """is_trusted(filename): code from the stdlib, site-packages, the harness, importlib's frozen
    modules, or one of `files` (the protected files of the repository: tests, conftests, helpers,
    whose text the verifier wrote)."""

    def is_trusted(filename):
        return isinstance(filename, str) and (
            filename.startswith(trusted) or filename.startswith("<frozen ") or filename in files
        )

    return is_trusted


def _under(path, prefix):
    if isinstance(path, bytes):
        path = path.decode("utf-8", "replace")
    return isinstance(path, str) and (os.path.realpath(path) + "/").startswith(prefix)


def _is_mem(path):
    """Whether `path` is a process's memory file (/proc/<pid>/mem, /proc/<pid>/task/<tid>/mem, ...)."""
    if isinstance(path, bytes):
        path = path.decode("utf-8", "replace")
    if not isinstance(path, str):
        return False
    p = os.path.realpath(path)
    return p.startswith("/proc/") and p.rsplit("/", 1)[-1] == "mem"


def _source_matches(source, filename):
    try:
        with open(filename, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if isinstance(source, str):
        source = source.encode("utf-8")
    return isinstance(source, (bytes, bytearray)) and bytes(source) == data


def audit_hook(tamper, is_trusted, work="/work"):
    """The runner's audit hook (see the module docstring); `is_trusted`: `make_is_trusted`'s."""
    getframe, ident = sys._getframe, __import__("_thread").get_ident
    internal, busy, guard_file = internal_frame_users(), set(), os.path.realpath(__file__)
    coroutine_code = code_of(types.coroutine)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    work_prefix = work + "/"

    def candidate_on_stack(f):
        while f is not None:
            if not is_trusted(f.f_code.co_filename):
                return True
            f = f.f_back
        return False

    def frame_ok():
        """'' when the Python frame that raised the event may have a frame object, else who asked."""
        me = ident()
        if me in busy:
            return ""
        busy.add(me)
        try:
            req = getframe(2)  # 0: frame_ok, 1: hook, 2: the requester
            code = req.f_code
            where = " (by %s in %s)" % (code.co_name, code.co_filename[-120:])
            if code.co_filename == guard_file:
                return ""
            if code in internal:
                parents = internal[code]
                return "" if parents is None or (req.f_back is not None and req.f_back.f_code in parents) else where
            return "" if is_trusted(code.co_filename) and not candidate_on_stack(req) else where
        finally:
            busy.discard(me)

    def hook(event, args):
        if event == "sys._getframe" or (event == "object.__getattr__" and len(args) > 1 and args[1] in FRAME_ATTRS):
            who = frame_ok()
            if who:
                tamper("forbidden frame access: %s%s" % (event if event == "sys._getframe" else args[1], who))
        elif event in TRACE_EVENTS:  # doctest restores the trace function it found; repository code may not set one
            who = frame_ok()
            if who:
                tamper("forbidden operation: %s%s" % (event, who))
        elif event in ALWAYS_FORBIDDEN:
            tamper("forbidden operation: %s" % event)
        elif event.startswith("ctypes.") and event not in ("ctypes.dlopen", "ctypes.dlsym"):
            tamper("forbidden operation: %s" % event)
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__kwdefaults__"):
            tamper("replaced a function's %s" % args[1])
        elif event == "open" and args:
            path, mode, flags = args[0], args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else 0
            if _is_mem(path):
                tamper("tried to open %s" % path)
            writing = (mode and any(c in str(mode) for c in "wax+")) or (not mode and flags and flags & write_flags)
            if writing and _under(path, work_prefix):
                tamper("tried to write %s" % path)
        elif event in PATH_EVENTS and args and any(_under(a, work_prefix) for a in args[:2]):
            tamper("tried %s on %s" % (event, args[0]))
        elif event == "compile" and len(args) > 1 and isinstance(args[1], str):
            name = args[1]
            if name.startswith("<frozen") or (is_trusted(name) and not _source_matches(args[0], name)):
                tamper("compiled code under the trusted file name %s" % name[:200])
        elif event == "code.__new__" and len(args) > 1 and is_trusted(args[1]):
            req = getframe(1).f_back
            if req is not None and req.f_code is not coroutine_code and candidate_on_stack(req):
                tamper("built a code object under the trusted file name %s" % str(args[1])[:200])

    return hook
