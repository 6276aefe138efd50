"""The repo verifier's in-process guard (stdlib only): imported by the RUNNER of
`verifier_workers.repo_harness` as `_rlbus_guard` (/work/.rlbus/lib, root-owned), BEFORE any
repository path is on `sys.path`, so nothing here can be shadowed by candidate code.

It closes what candidate code running inside pytest's interpreter could use to forge a verdict:
- comparable data only (`plain`, `truth`: `repo_harness_guard_data`): no `__eq__` the
  candidate wrote ever decides an assert;
- the report channel (`sender`: `repo_harness_guard_report`): a MAC'd line only from
  pytest's genuine call stack, the key never reachable from candidate code;
- the audit hook (`audit_hook`: `repo_harness_guard_audit`): no frame access, tracing, `gc`
  walks, ctypes memory access, code replacement, `/proc/*/mem`, writes under /work or code
  compiled under a trusted file name;
- this module: `integrity_check(...)`, what was rebound since the snapshot (builtins, sys,
  os, pytest/pluggy/unittest and this guard, key classes, the harness's globals; then every
  hook's implementations, the test modules and test functions), and `Plugin`, which reports
  every phase of every expected test through the sender and runs those checks.

The guard is four parts joined into ONE module before it is shipped
(`verifier_workers.harness_programs.repo_guard`, which drops their imports of each other):
`repo_harness_guard_data`, `repo_harness_guard_audit`, `repo_harness_guard_report`, then
this module; in the sandbox every name is a global of `_rlbus_guard` (its `__file__` is the
one the audit hook trusts for frame access).

Residual (documented in docs/architecture.md): a candidate can still read the hidden tests'
module objects (their constants and parametrisations) in its interpreter, and a crafted `.pyc`
(marshal) could carry a code object whose file name looks trusted.
"""

import os
import sys
import types

from verifier_workers.repo_harness_guard_audit import code_of

WATCHED_PREFIXES = ("_pytest", "pytest", "pluggy", "unittest", "_rlbus_guard")
SYS_VOLATILE = frozenset(
    (
        "unraisablehook",
        "excepthook",
        "displayhook",
        "breakpointhook",
        "last_type",
        "last_value",
        "last_traceback",
        "last_exc",
        "ps1",
        "ps2",
        "exc_info",
    )
)
KEY_CLASSES = (
    "_pytest.reports:BaseReport",
    "_pytest.reports:TestReport",
    "_pytest.reports:CollectReport",
    "_pytest.runner:CallInfo",
    "_pytest.nodes:Node",
    "_pytest.nodes:Item",
    "_pytest.python:Function",
    "_pytest.main:Session",
    "_pytest.config:Config",
    "_pytest.outcomes:OutcomeException",
    "pluggy._hooks:HookCaller",
    "pluggy._manager:PluginManager",
    "unittest.case:TestCase",
    "_pytest.unittest:TestCaseFunction",
)


def base_spaces(extra):
    """(name, namespace, keep-all?) of builtins, sys, os, the watched modules, key classes and `extra`."""
    import builtins

    spaces = [
        ("builtins", vars(builtins), False),
        ("sys", vars(sys), False),
        ("os", vars(os), False),
        ("harness", extra, False),
    ]
    spaces += [
        (m, vars(sys.modules[m]), False)
        for m in sorted(list(sys.modules))
        if m.split(".")[0] in WATCHED_PREFIXES and sys.modules[m] is not None
    ]
    for ref in KEY_CLASSES:
        mod, _, cls = ref.partition(":")
        if mod in sys.modules and hasattr(sys.modules[mod], cls):
            spaces.append((ref, getattr(sys.modules[mod], cls).__dict__, True))
    return spaces


def integrity_check(spaces):
    """check(): '' or what was rebound since now in `spaces` ((name, dict, keep_all) triples: callables,
    classes and modules, or every entry when keep_all)."""
    snap = []
    for name, ns, keep_all in spaces:
        keep = {
            k: v
            for k, v in ns.items()
            if (keep_all or callable(v) or isinstance(v, (type, types.ModuleType)))
            and not (name == "sys" and k in SYS_VOLATILE)
        }
        snap.append((name, ns, keep))
    missing = object()

    def check():
        for name, ns, keep in snap:
            for k, v in keep.items():
                if ns.get(k, missing) is not v:
                    return "rebound %s.%s" % (name, k)
        return ""

    return check


def hook_snapshot(pm, is_trusted, repo):
    """check() over every hook's implementations (same objects, same functions), or raises ValueError
    naming a hook implementation that is neither trusted code nor a conftest of the repository."""
    relay, rows = pm.hook, []
    for name in sorted(vars(relay)):
        hc = getattr(relay, name)
        impls = tuple(hc.get_hookimpls()) if hasattr(hc, "get_hookimpls") else ()
        for impl in impls:
            code = code_of(impl.function)
            fn = code.co_filename if code is not None else ""
            if not (is_trusted(fn) or (fn.startswith(repo + "/") and fn.endswith("/conftest.py"))):
                raise ValueError("hook %s implemented by %s (%s)" % (name, impl.plugin_name, fn[:200]))
        rows.append((name, hc, impls, tuple(i.function for i in impls)))

    def check():
        for name, hc, impls, fns in rows:
            now = getattr(relay, name, None)
            got = tuple(now.get_hookimpls()) if now is hc else None
            if (
                got is None
                or len(got) != len(impls)
                or any(a is not b for a, b in zip(got, impls))
                or any(i.function is not f for i, f in zip(got, fns))
            ):
                return "pytest hook %s was changed" % name
        return ""

    return check


def item_spaces(items):
    """Integrity spaces of the test modules and test functions of `items` (kwdefaults included)."""
    out, seen = [], set()
    for it in items:
        mod = getattr(it, "module", None)
        if isinstance(mod, types.ModuleType) and id(mod) not in seen:
            seen.add(id(mod))
            out.append(("test module " + mod.__name__, vars(mod), False))
        fn = getattr(getattr(it, "obj", None), "__func__", getattr(it, "obj", None))
        kw = getattr(fn, "__kwdefaults__", None)
        if isinstance(kw, dict) and id(kw) not in seen:
            seen.add(id(kw))
            out.append(("kwdefaults of " + it.nodeid, kw, True))
    return out


class Plugin:
    """Reports every phase of every expected test through the sender; deselects the rest.

    The first integrity snapshot is taken in `pytest_load_initial_conftests` (after pytest's own
    early patches, before the conftests, the first place repository code can run); the hooks, test
    modules and test functions are added once collection is done. The hook/test checks run after
    every report, the base check (which a test's monkeypatch may rebind until its teardown) after
    each teardown."""

    def __init__(self, expected, send, tamper, harness_globals, is_trusted, repo):
        self.expected, self._send, self._tamper = frozenset(expected), send, tamper
        self._globals, self._is_trusted, self._repo = harness_globals, is_trusted, repo
        self.checks = []

    def _check(self, base=True):
        """Every check; with base=False (after a setup or call report, where a test's monkeypatch may
        still be active) only those of the hooks, test modules and test functions."""
        if not self.checks:
            self._tamper("no integrity snapshot")
        for check in self.checks if base else self.checks[1:]:
            bad = check()
            if bad:
                self._tamper(bad)

    def pytest_load_initial_conftests(self, early_config, parser, args):
        self.checks = [integrity_check(base_spaces(self._globals))]

    def pytest_collection_modifyitems(self, session, config, items):
        keep = [it for it in items if it.nodeid in self.expected]
        drop = [it for it in items if it.nodeid not in self.expected]
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)
        self._check()
        if self._send(({"k": "items"}, list(keep))):
            self._tamper("the collected items could not be recorded")
        try:
            self.checks.append(hook_snapshot(config.pluginmanager, self._is_trusted, self._repo))
        except ValueError as exc:
            self._tamper("a plugin of the candidate's: %s" % exc)
        self.checks.append(integrity_check(item_spaces(keep)))

    def pytest_collectreport(self, report):
        if report.failed:
            self._send(({"k": "collect_error", "id": report.nodeid, "msg": str(report.longrepr)[-600:]}, None))

    def pytest_runtest_logreport(self, report):
        msg = ""
        if not report.passed:
            crash = getattr(report.longrepr, "reprcrash", None)
            msg = crash.message if crash is not None else str(report.longrepr)[-400:]
        if self._send(
            (
                {
                    "k": "report",
                    "id": report.nodeid,
                    "when": report.when,
                    "outcome": report.outcome,
                    "xfail": hasattr(report, "wasxfail"),
                    "msg": msg,
                },
                report,
            )
        ):
            self._tamper("a forged test report")
        self._check(base=report.when == "teardown")

    def pytest_sessionfinish(self, session, exitstatus):
        self._check()
