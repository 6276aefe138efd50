"""Plugins by name: built-ins first, then the entry points of one group (domains, verifiers).

A `Registry(group, builtins)` resolves a name to an object: a built-in, given as
`module:attribute` and imported on first use, else an installed package's entry point of
`group` (`rlbus.domains`, `rlbus.verifiers`, ...). Both plugin mechanisms of the project
(`producers.domains`, `verifier_workers.registry`) are one instance each.

Guarantees:
- A built-in always wins: an entry point under a built-in's name is ignored, with a warning;
  of two entry points with one name, the first found is kept (a warning when they differ).
- Entry points are discovered once per registry (`reset()` forgets them and the plugins
  loaded from them: tests, or after installing a plugin) and each is imported on its first
  `load()`; built-ins are imported on first use too, so naming a kind never imports another.
- `load(name)` returns the same object for the same name while its reference is unchanged
  (loaded once, then `prepare(name, ref, obj)` applied once, when given). An unknown name,
  or a reference that fails to import (whatever it raises) or that `prepare` refuses, raises
  the registry's `error` type (default ValueError) with a message naming the known names
  or the reference.
- Thread-safe: one lock guards discovery and loading.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import structlog

log = structlog.get_logger()


def import_ref(ref: str) -> Any:
    """The object a `module:attr.sub` reference names (ImportError / AttributeError when absent)."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


class Registry:
    """Named plugins of one kind: `builtins` (name -> `module:attr`), then entry points of `group`."""

    def __init__(
        self,
        group: str,
        builtins: dict[str, str],
        *,
        what: str = "plugin",
        error: type[Exception] = ValueError,
        prepare: Callable[[str, str, Any], Any] | None = None,
    ) -> None:
        self.group = group
        self.builtins = builtins
        """The built-in table itself (not a copy): an entry added to it is a built-in at once."""
        self.what = what
        self.error = error
        self.prepare = prepare
        self._lock = threading.RLock()
        self._eps: dict[str, EntryPoint] | None = None
        self._loaded: dict[str, tuple[str, Any]] = {}

    def entry_points(self) -> dict[str, EntryPoint]:
        """The group's entry points by name, built-in names excluded (discovered once)."""
        with self._lock:
            if self._eps is None:
                found: dict[str, EntryPoint] = {}
                for ep in entry_points(group=self.group):
                    if ep.name in self.builtins:
                        log.warning(
                            "plugin ignored: shadows a built-in", group=self.group, name=ep.name, value=ep.value
                        )
                    elif ep.name in found and found[ep.name].value != ep.value:
                        log.warning(
                            "plugin ignored: name taken",
                            group=self.group,
                            name=ep.name,
                            value=ep.value,
                            kept=found[ep.name].value,
                        )
                    else:
                        found.setdefault(ep.name, ep)
                self._eps = found
            return self._eps

    def reset(self) -> None:
        """Forget the discovered entry points and every plugin loaded from one."""
        with self._lock:
            self._eps = None
            self._loaded = {n: v for n, v in self._loaded.items() if n in self.builtins}

    def names(self) -> list[str]:
        """Every known name (built-ins and entry points), sorted."""
        return sorted(set(self.builtins) | set(self.entry_points()))

    def __contains__(self, name: object) -> bool:
        return name in self.builtins or name in self.entry_points()

    def ref(self, name: str) -> str | None:
        """The `module:attr` reference `name` resolves to (None when unknown)."""
        if name in self.builtins:
            return self.builtins[name]
        ep = self.entry_points().get(name)
        return None if ep is None else ep.value

    def load(self, name: str) -> Any:
        """The object registered as `name` (see the module guarantees)."""
        with self._lock:
            ref = self.ref(name)
            if ref is None:
                raise self.error(f"unknown {self.what} {name!r}; known: {self.names()}")
            cached = self._loaded.get(name)
            if cached is not None and cached[0] == ref:
                return cached[1]
            try:
                obj = import_ref(ref) if name in self.builtins else self.entry_points()[name].load()
            except Exception as exc:  # a broken plugin is a config/input error, never a crash
                raise self.error(f"{self.what} {name!r} ({ref}) failed to load: {type(exc).__name__}: {exc}") from exc
            if self.prepare is not None:
                obj = self.prepare(name, ref, obj)
            self._loaded[name] = (ref, obj)
            return obj
