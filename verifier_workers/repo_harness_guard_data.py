"""The repo guard's comparable-data rules: what the rewritten hidden tests may compare.

Part 1 of the guard program (`verifier_workers.repo_harness_guard`, installed in the sandbox
as ONE module `_rlbus_guard`; stdlib only, joined with the other parts before it is shipped).

Guarantees:
- `plain(x, changed)` / `truth(x, changed)`: what the rewritten hidden tests compare
  (`repo_harness_rewrite`): `x` itself when it is comparable data (exact builtin scalars,
  `Decimal`, `Fraction`, `datetime` types and builtin containers; any other object only when
  every comparison/truth method of its class (`__eq__`, `__ne__`, `__lt__`..., `__bool__`,
  `__len__`, `__contains__`, `__iter__`, `__hash__`) is a builtin slot, stdlib code (never
  unittest.mock's), or repository code whose function the candidate's diff did not change,
  and its contents and `__dict__` values are comparable too), else AssertionError naming the
  method: no `__eq__` the candidate wrote ever decides an assert.
- `MRO(t)` is `type.__mro__` read through the type's own descriptor (a metaclass cannot fake it).
"""

import datetime
import decimal
import fractions
import os
import sysconfig
import types

_PLAIN_SCALARS = frozenset(
    (
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        type(Ellipsis),
        decimal.Decimal,
        fractions.Fraction,
        datetime.date,
        datetime.datetime,
        datetime.time,
        datetime.timedelta,
    )
)
_PLAIN_SEQS = frozenset((list, tuple, set, frozenset))
MRO = type.__dict__["__mro__"].__get__


REPO_PREFIX = "/work/repo/"
_HEAPTYPE = 1 << 9
_CMP_DUNDERS = (
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__bool__",
    "__len__",
    "__contains__",
    "__iter__",
    "__hash__",
)
_SLOT_TYPES = (types.WrapperDescriptorType, types.MethodDescriptorType)
_STD_PREFIXES = tuple(
    sorted(
        {sysconfig.get_paths()[k].rstrip("/") + "/" for k in ("stdlib", "platstdlib")}
        | {os.path.realpath(sysconfig.get_paths()[k]) + "/" for k in ("stdlib", "platstdlib")}
    )
)


def _dunder_ok(t, changed):
    """'' when every comparison/truth method of type `t` is a builtin slot, stdlib code (not
    unittest.mock), or repository code that the candidate's diff did not change; else why not."""
    for name in _CMP_DUNDERS:
        for k in MRO(t):
            if name not in k.__dict__:
                continue
            v = k.__dict__[name]
            if not (k.__flags__ & _HEAPTYPE) or isinstance(v, _SLOT_TYPES) or v is None:
                break
            code = getattr(v, "__code__", None) if isinstance(v, types.FunctionType) else None
            fn = code.co_filename if code is not None else ""
            if (fn.startswith(_STD_PREFIXES) or fn.startswith("<frozen ")) and not (k.__module__ or "").startswith(
                "unittest.mock"
            ):
                break
            rel = fn[len(REPO_PREFIX) :] if fn.startswith(REPO_PREFIX) else None
            if (
                rel is not None
                and "%s::%s" % (rel, code.co_qualname) not in changed
                and "%s::*" % rel not in changed
                and not ("<lambda>" in code.co_qualname and "%s::<lambda>" % rel in changed)
            ):
                break
            return "%s.%s (from %s)" % (k.__qualname__, name, fn or type(v).__name__)
    return ""


def plain(x, changed=(), _seen=None):
    """`x` if it is comparable data, else AssertionError naming what is not (see the module
    docstring): exact builtin scalars and containers, and objects whose comparison and truth
    methods are builtin, stdlib or unchanged repository code (`changed`: the rewriter's
    'path::qualname' entries of the functions the diff changed), with comparable contents."""
    t = type(x)
    if t in _PLAIN_SCALARS:
        return x
    seen = _seen if _seen is not None else set()
    if id(x) in seen:
        return x
    seen.add(id(x))
    if t not in _PLAIN_SEQS and t is not dict:
        why = _dunder_ok(t, changed)
        if why:
            raise AssertionError(
                "rlbus: the hidden tests compare only data whose comparison is not the "
                "candidate's own code; %s.%s uses %s" % (t.__module__, t.__qualname__, why)
            )
    if isinstance(x, dict):
        for k, v in list(dict.items(x)):
            plain(k, changed, seen)
            plain(v, changed, seen)
    elif isinstance(x, (list, tuple, set, frozenset)):
        base = next(b for b in (list, tuple, set, frozenset) if isinstance(x, b))
        for it in list(base.__iter__(x)):
            plain(it, changed, seen)
    try:
        inner = object.__getattribute__(x, "__dict__")
    except (AttributeError, TypeError):
        inner = None
    if type(inner) is dict:
        for v in list(dict.values(inner)):
            plain(v, changed, seen)
    return x


def truth(x, changed=()):
    """`x` for a bare `assert x`: comparable data (`plain`), or an object whose truth no class defines."""
    t = type(x)
    if t in _PLAIN_SCALARS or t in _PLAIN_SEQS or t is dict:
        return plain(x, changed)
    for k in MRO(t):
        if "__bool__" in k.__dict__ or "__len__" in k.__dict__:
            return plain(x, changed)
    return x
