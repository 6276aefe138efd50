"""The base of every config section, and the check that turns a renamed key into an error
that names its new key."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


def renamed_errors(place: str, renamed: dict[str, str], data: dict) -> list[str]:
    """One message per old key of `renamed` (old -> new, relative to `place`) present in
    `data`. An old key that became a section of the same name (`curriculum` ->
    `curriculum.enabled`) is old only when its value is not a table (or, when a field is
    assigned on a built model, not the section itself)."""
    prefix = f"{place}." if place else ""
    out = []
    for old, new in renamed.items():
        if old not in data or (new.startswith(f"{old}.") and isinstance(data[old], (dict, BaseModel))):
            continue
        value = data[old]
        shown = json.dumps(value) if isinstance(value, (bool, int, float, str)) else None
        hint = f" = {shown}" if shown is not None and new.startswith(f"{old}.") else ""
        out.append(f"{prefix}{old} was renamed: use {prefix}{new}{hint}")
    return out


class Section(BaseModel):
    """Base of every config section: unknown keys rejected, field docstrings kept, and the
    section's renamed keys (`RENAMED`, old -> new) rejected naming the new key."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
    PLACE: ClassVar[str] = ""
    """Dotted place of the section in the run config (for messages)."""
    RENAMED: ClassVar[dict[str, str]] = {}
    """Old key -> its new key (both relative to PLACE)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if cls.RENAMED and isinstance(data, dict):
            errors = renamed_errors(cls.PLACE, cls.RENAMED, data)
            if errors:
                raise ValueError("; ".join(errors))
        return data
