"""Verifiers by name: built-ins first, then plugins from Python entry points.

A verifier is a callable `fn(traj: Trajectory, hidden: dict | None = None) -> Verdict`
(see `verifier_workers.verdict`); `hidden` is the task's verifier-only payload when it has a
`hidden_ref` (resolved by the worker through `bus.hidden`), else None.

Guarantees:
- Lookup order: names added with `register()`, then the built-ins (`arith`, `constant`,
  `math`, `extract`, `files`, `model`, ...: see BUILTINS), then the entry points of group
  `rlbus.verifiers`, through one `schemas.registry.Registry` (the domains' mechanism too). A
  plugin can never shadow a built-in (it is ignored, with a warning), and `register()`
  refuses to replace an existing name unless asked to.
- Built-ins are imported on first use, so `get("arith")` never pulls in sympy.
- Entry points are discovered once per process (`reset_entry_points()` forgets them,
  for tests) and each is loaded on its first `get()`; a plugin that fails to import or
  that is not callable raises `VerifierInputError` naming the entry point.
- An unknown name raises `VerifierInputError` listing every known name, which the
  verifier worker dead-letters with that reason.
- A verifier that cannot run for reasons outside the task (sandbox, model, network)
  raises `errors.VerifierInfraError` (re-exported here): the worker retries it and never
  turns it into a reward.
- Untrusted verifiers: a callable with `fn.untrusted = True`, or `register(..., untrusted=True)`,
  never runs in this process: the registry returns a wrapper that runs the whole call in an
  `answer_pool` job (limits, no credentials; the job imports the verifier by its `module:attr`
  reference, the trajectory and hidden payload travel as plain data), and rebuilds the Verdict
  from plain data (components must be finite numbers). A call at a limit is a 0 with status
  `answer_limit`; a verdict that is not plain data is a `VerifierInfraError`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from schemas.registry import Registry, import_ref
from verifier_workers.errors import VerifierInfraError  # (re-exported)
from verifier_workers.verdict import Verdict, VerifierInputError

Verifier = Callable[..., Verdict]

GROUP = "rlbus.verifiers"

BUILTINS: dict[str, str] = {
    "arith": "verifier_workers.verifiers.arith:verify_arith",
    "constant": "verifier_workers.verifiers.constant:verify_constant",
    "math": "verifier_workers.verifiers.math:verify_math",
    "extract": "verifier_workers.verifiers.extract:verify_extract",
    "code": "verifier_workers.verifiers.code:verify_code",
    "tool_calc": "verifier_workers.verifiers.tool_calc:verify_tool_calc",
    "files": "verifier_workers.verifiers.files:verify_files",
    "model": "verifier_workers.verifiers.model:verify_model",
    "reasoning_gym": "verifier_workers.verifiers.reasoning_gym:verify_reasoning_gym",
    "repo": "verifier_workers.verifiers.repo:verify_repo",
    "harbor": "verifier_workers.verifiers.harbor:verify_harbor",
    "openenv": "verifier_workers.verifiers.openenv:verify_openenv",
    "findoc": "verifier_workers.verifiers.findoc:verify_findoc",
    "recall": "verifier_workers.verifiers.recall:verify_recall",
}
"""Built-in verifiers, as `module:attribute`, imported on first use."""

_lock = threading.RLock()
_registered: dict[str, Verifier] = {}


def _prepare(name: str, ref: str, fn: Any) -> Verifier:
    """A loaded verifier made ready to call: callable, and pooled when it says `untrusted`."""
    if not callable(fn):
        raise VerifierInputError(f"verifier {name!r} is not callable: {fn!r}")
    if getattr(fn, "untrusted", False) is True:
        return pooled(ref)
    return fn


PLUGINS = Registry(GROUP, BUILTINS, what="verifier", error=VerifierInputError, prepare=_prepare)
"""The built-ins and the `rlbus.verifiers` entry points (names added by `register()` come first)."""


def reset_entry_points() -> None:
    """Forget discovered and loaded plugins (tests; after installing a plugin)."""
    PLUGINS.reset()


def register(name: str, fn: Verifier, *, replace: bool = False, untrusted: bool = False) -> None:
    """Register `fn` as verifier `name` (refuses an existing name unless `replace`); `untrusted`:
    every call runs in the answer pool (see the module docstring)."""
    if not callable(fn):
        raise TypeError(f"verifier {name!r} is not callable: {fn!r}")
    if untrusted or getattr(fn, "untrusted", False) is True:
        fn = pooled(f"{fn.__module__}:{fn.__qualname__}")
    with _lock:
        if not replace and (name in _registered or name in PLUGINS):
            raise ValueError(f"verifier {name!r} is already registered")
        _registered[name] = fn


def unregister(name: str) -> None:
    """Remove a verifier added with `register()` (no-op if absent)."""
    with _lock:
        _registered.pop(name, None)


def names() -> list[str]:
    """Every known verifier name, sorted."""
    return sorted(set(_registered) | set(PLUGINS.names()))


def call_in_job(ref: str, traj: dict, hidden: dict | None, with_hidden: bool) -> dict:
    """In an answer-pool job: the verifier `ref` on the rebuilt trajectory, its Verdict as plain data."""
    from schemas import Trajectory

    fn = import_ref(ref)
    t = Trajectory.model_validate(traj)
    v = fn(t, hidden) if with_hidden else fn(t)
    return {
        "components": dict(v.components),
        "status": str(v.status),
        "details": str(v.details)[:4000],
        "weights": dict(v.weights),
        "sandbox_s": float(v.sandbox_s),
    }


def _verdict(data: object, ref: str) -> Verdict:
    try:
        assert isinstance(data, dict)
        nums = {k: {str(n): float(x) for n, x in dict(data[k]).items()} for k in ("components", "weights")}
        assert all(math.isfinite(x) for d in nums.values() for x in d.values())
        return Verdict(
            nums["components"],
            str(data["status"])[:40],
            str(data["details"])[:4000],
            nums["weights"],
            max(0.0, float(data["sandbox_s"])),
        )
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise VerifierInfraError(f"untrusted verifier {ref} returned no valid verdict: {type(exc).__name__}") from None


def pooled(ref: str) -> Verifier:
    """A verifier that runs `ref` ("module:attr") in the answer pool (see the module docstring)."""

    def run(traj, hidden: dict | None = None) -> Verdict:
        from verifier_workers import answer_pool

        out = answer_pool.call(
            "verifier_workers.registry:call_in_job", (ref, traj.model_dump(), hidden, hidden is not None)
        )
        if out.kind == "limit":
            return Verdict(
                {"correct": 0.0}, status="answer_limit", details=f"untrusted verifier hit the {out.limit} limit"
            )
        if out.kind == "raised" and out.error.startswith("VerifierInputError"):
            raise VerifierInputError(f"untrusted verifier {ref}: {out.error}")
        if out.kind != "ok":
            raise VerifierInfraError(f"untrusted verifier {ref} failed in the answer pool: {out.error}"[:500])
        return _verdict(out.value, ref)

    run.pooled_ref = ref  # type: ignore[attr-defined]
    return run


def get(name: str) -> Verifier:
    """The verifier named `name`, or VerifierInputError listing the known ones."""
    with _lock:
        if name in _registered:
            return _registered[name]
        if name not in PLUGINS:
            raise VerifierInputError(f"unknown verifier {name!r}; known: {names()}")
        return PLUGINS.load(name)
