"""Verifiers by name: built-ins first, then plugins from Python entry points.

A verifier is a callable `fn(traj: Trajectory, hidden: dict | None = None) -> Verdict`
(see `verifiers.Verdict`); `hidden` is the task's verifier-only payload when it has a
`hidden_ref` (resolved by the worker through `bus.hidden`), else None.

Guarantees:
- Lookup order: names added with `register()`, then the built-ins (`arith`, `constant`,
  `math`, `extract`, `files`, `model`, ...: see BUILTINS), then the entry points of group `rlbus.verifiers`. A plugin can
  never shadow a built-in (it is ignored, with a warning), and `register()` refuses to
  replace an existing name unless asked to.
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
- `compose()` turns named components into the scalar reward: a weighted sum, by default
  just the `correct` component.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

import structlog

from verifier_workers.errors import VerifierInfraError  # (re-exported)

if TYPE_CHECKING:
    from verifier_workers.verifiers import Verdict

Verifier = Callable[..., "Verdict"]

GROUP = "rlbus.verifiers"

BUILTINS: dict[str, str] = {
    "arith": "verifier_workers.verifiers:verify_arith",
    "constant": "verifier_workers.verifiers:verify_constant",
    "math": "verifier_workers.math_verifier:verify_math",
    "extract": "verifier_workers.extract_verifier:verify_extract",
    "code": "verifier_workers.code_verifier:verify_code",
    "tool_calc": "verifier_workers.tool_calc_verifier:verify_tool_calc",
    "files": "verifier_workers.files_verifier:verify_files",
    "model": "verifier_workers.model_verifier:verify_model",
    "reasoning_gym": "verifier_workers.reasoning_gym_verifier:verify_reasoning_gym",
    "repo": "verifier_workers.repo_verifier:verify_repo",
}
"""Built-in verifiers, as `module:attribute`, imported on first use."""

log = structlog.get_logger()
_lock = threading.RLock()
_registered: dict[str, Verifier] = {}
_loaded: dict[str, Verifier] = {}
_entry_points: dict[str, EntryPoint] | None = None


def _input_error(msg: str) -> Exception:
    from verifier_workers.verifiers import VerifierInputError

    return VerifierInputError(msg)


def _discover() -> dict[str, EntryPoint]:
    """The `rlbus.verifiers` entry points, discovered once (built-in names excluded)."""
    global _entry_points
    with _lock:
        if _entry_points is None:
            found: dict[str, EntryPoint] = {}
            for ep in entry_points(group=GROUP):
                if ep.name in BUILTINS:
                    log.warning("verifier plugin ignored: shadows a built-in", name=ep.name, value=ep.value)
                elif ep.name in found and found[ep.name].value != ep.value:
                    log.warning("verifier plugin ignored: name taken", name=ep.name, value=ep.value,
                                kept=found[ep.name].value)
                else:
                    found.setdefault(ep.name, ep)
            _entry_points = found
        return _entry_points


def reset_entry_points() -> None:
    """Forget discovered and loaded plugins (tests; after installing a plugin)."""
    global _entry_points
    with _lock:
        _entry_points = None
        for name in [n for n in _loaded if n not in BUILTINS]:
            del _loaded[name]


def register(name: str, fn: Verifier, *, replace: bool = False, untrusted: bool = False) -> None:
    """Register `fn` as verifier `name` (refuses an existing name unless `replace`); `untrusted`:
    every call runs in the answer pool (see the module docstring)."""
    if not callable(fn):
        raise TypeError(f"verifier {name!r} is not callable: {fn!r}")
    if untrusted or getattr(fn, "untrusted", False) is True:
        fn = pooled(f"{fn.__module__}:{fn.__qualname__}")
    with _lock:
        if not replace and (name in _registered or name in BUILTINS or name in _discover()):
            raise ValueError(f"verifier {name!r} is already registered")
        _registered[name] = fn


def unregister(name: str) -> None:
    """Remove a verifier added with `register()` (no-op if absent)."""
    with _lock:
        _registered.pop(name, None)


def names() -> list[str]:
    """Every known verifier name, sorted."""
    return sorted(set(_registered) | set(BUILTINS) | set(_discover()))


def _load(name: str, ref: str | EntryPoint) -> Verifier:
    try:
        if isinstance(ref, EntryPoint):
            fn = ref.load()
        else:
            module, _, attr = ref.partition(":")
            fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # a broken plugin is a bad task, not a crash of the worker
        where = ref.value if isinstance(ref, EntryPoint) else ref
        raise _input_error(f"verifier {name!r} ({where}) failed to load: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise _input_error(f"verifier {name!r} is not callable: {fn!r}")
    if getattr(fn, "untrusted", False) is True:
        return pooled(ref.value if isinstance(ref, EntryPoint) else ref)
    return fn


def call_in_job(ref: str, traj: dict, hidden: dict | None, with_hidden: bool) -> dict:
    """In an answer-pool job: the verifier `ref` on the rebuilt trajectory, its Verdict as plain data."""
    from schemas import Trajectory

    module, _, attr = ref.partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    t = Trajectory.model_validate(traj)
    v = fn(t, hidden) if with_hidden else fn(t)
    return {"components": dict(v.components), "status": str(v.status), "details": str(v.details)[:4000],
            "weights": dict(v.weights), "sandbox_s": float(v.sandbox_s)}


def _verdict(data: object, ref: str) -> Verdict:
    from verifier_workers.verifiers import Verdict

    try:
        assert isinstance(data, dict)
        nums = {k: {str(n): float(x) for n, x in dict(data[k]).items()} for k in ("components", "weights")}
        assert all(math.isfinite(x) for d in nums.values() for x in d.values())
        return Verdict(nums["components"], str(data["status"])[:40], str(data["details"])[:4000], nums["weights"],
                       max(0.0, float(data["sandbox_s"])))
    except (AssertionError, KeyError, TypeError, ValueError) as exc:
        raise VerifierInfraError(f"untrusted verifier {ref} returned no valid verdict: {type(exc).__name__}") from None


def pooled(ref: str) -> Verifier:
    """A verifier that runs `ref` ("module:attr") in the answer pool (see the module docstring)."""
    def run(traj, hidden: dict | None = None) -> Verdict:
        from verifier_workers import answer_pool
        from verifier_workers.verifiers import Verdict

        out = answer_pool.call("verifier_workers.registry:call_in_job",
                               (ref, traj.model_dump(), hidden, hidden is not None))
        if out.kind == "limit":
            return Verdict({"correct": 0.0}, status="answer_limit", details=f"untrusted verifier hit the {out.limit} limit")
        if out.kind == "raised" and out.error.startswith("VerifierInputError"):
            raise _input_error(f"untrusted verifier {ref}: {out.error}")
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
        if name in _loaded:
            return _loaded[name]
        ref: str | EntryPoint | None = BUILTINS.get(name) or _discover().get(name)
        if ref is None:
            raise _input_error(f"unknown verifier {name!r}; known: {names()}")
        fn = _loaded[name] = _load(name, ref)
        return fn


def compose(components: Mapping[str, float], weights: Mapping[str, float] | None = None,
            default: str = "correct") -> float:
    """The scalar reward: sum of weight x component (a missing component counts 0).

    With `weights` None the scalar is the `default` component alone (0.0 if absent).
    A non-finite component or weight raises ValueError.
    """
    if weights is None:
        weights = {default: 1.0}
    total = 0.0
    for key, w in weights.items():
        value = float(components.get(key, 0.0))
        if not (math.isfinite(value) and math.isfinite(float(w))):
            raise ValueError(f"non-finite reward component/weight {key!r}: {value!r} x {w!r}")
        total += float(w) * value
    return total
