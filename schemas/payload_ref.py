"""`BlobRef`: a public payload too large for a message, named by reference (see `bus.payloads`).

Guarantees: a `BlobRef` validates only if its uri is `nats-object://<kind>s-<run>/sha256-<h>`
(kind `workspace` or `artifact`: the run's two payload buckets) with `h` its own `sha256` (64 lowercase hex digits) and its size is not negative, so a
message can never point a reader at another bucket or at an object that is not named by
its content.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

PAYLOAD_URI = re.compile(r"^nats-object://(?:workspaces|artifacts)-[A-Za-z0-9_-]{1,64}/sha256-([0-9a-f]{64})$")


class BlobRef(BaseModel):
    """A public payload too large for a message, by reference (immutable): an object of the run's
    payload store (`bus.payloads`), named by its content's sha256. The reader checks size and
    sha256 before it uses a byte; a ref whose uri does not name `sha256-<its sha256>` in a
    `workspaces-<run>` or `artifacts-<run>` bucket does not validate."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)
    uri: str
    """`nats-object://workspaces-<run>/sha256-<sha256>` (or `artifacts-<run>`)."""
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Hex sha256 of the payload's bytes."""
    size: int = Field(ge=0)
    """Payload size in bytes."""

    @model_validator(mode="after")
    def _uri_names_the_content(self):
        m = PAYLOAD_URI.match(self.uri)
        if m is None or m.group(1) != self.sha256:
            raise ValueError(
                f"payload uri {self.uri!r} must be nats-object://workspaces-<run>/sha256-<sha256 of the "
                "payload> (or artifacts-<run>)"
            )
        return self
