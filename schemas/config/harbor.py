"""`[harbor]`: the operator's settings for Harbor task directories (the `harbor` domain kind)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Section

DEFAULT_PROTECTED = (
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/local/bin",
    "/usr/local/sbin",
    "/usr/local/lib",
    "/etc/ld.so.preload",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/ld.so.cache",
)
"""Paths whose changes by the agent never reach the tests (restored from the task image)."""


class HarborSection(Section):
    """How Harbor tasks build, run and verify (every `kind = "harbor"` domain shares it)."""

    PLACE = "harbor"
    image_map: dict[str, str] = Field(default_factory=dict)
    """Base image -> local image, applied to `FROM` lines and `docker_image` (no registry is
    reachable here or in many clusters), e.g. `{ "ubuntu:24.04" = "python:3.11-slim" }`."""
    allow_internet: bool = False
    """The operator's consent: a task gets a network only when it says `allow_internet = true`
    AND this is true; otherwise it runs without one (logged once per task)."""
    verify_in: Literal["same", "fresh"] = "same"
    """`same`: the tests run on a snapshot of the agent's container, sharing its network
    namespace (services the agent left running answer on localhost); `fresh`: the snapshot
    only, after the agent's container is removed (no live agent process anywhere). Both
    restore `protected` paths from the task image (docs/architecture.md says what remains)."""
    skip_invalid: bool = False
    """A task folder without instruction.md or task.toml, or with a TOML error: false stops
    `rlbus up` naming the file; true skips it and counts it."""
    protected: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECTED))
    """Paths (and everything under them) whose changes are undone before the tests run."""
    toolchain_image: str = "rlbus-repo-sandbox:latest"
    """The trusted image whose Python packages (pytest) are mounted read-only, first on PATH,
    for `test.sh` (`rlbus sandbox build-image --repo` builds the default)."""
    handover_ttl_s: float = Field(default=3600.0, gt=0)
    """How long an ended episode's container waits for its verifier before the reaper removes it."""
    check_at_start: bool = True
    """`rlbus up` runs the oracle and empty checks of tasks not checked before (cached by content)."""
    tool_timeout_s: float = Field(default=60.0, gt=0)
    """Longest `bash` call (a call may ask for less with its `timeout` argument)."""
