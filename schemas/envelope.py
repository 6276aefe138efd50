"""The envelope every bus message shares, and the wire primitives its fields use.

Guarantees:
- `Message` holds the envelope fields `schema_version`, `run_id`, `msg_id`, `created_at`;
  every message kind (`schemas.episode`, `schemas.messages`) extends it and forbids
  unknown fields.
- `new_msg_id()` is globally unique (sent as `Nats-Msg-Id`, so JetStream de-duplicates).
- Token ids and log-probs travel as packed little-endian arrays (`int32` / `float32`
  bytes: `pack_i32` / `pack_f32`), never as lists of Python ints; a `PackedI32` /
  `PackedF32` field rejects bytes whose length is not a multiple of 4.
- `DecodeError` names the offending field (or `<payload>`) in `field` and why in `reason`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

SCHEMA_VERSION = 1


def new_msg_id() -> str:
    """A fresh, globally unique message id (used as `Nats-Msg-Id`)."""
    return uuid.uuid4().hex


def pack_i32(values: Any) -> bytes:
    """Pack a sequence or array of ints as little-endian int32 bytes."""
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    """Inverse of `pack_i32` (a read-only int32 array)."""
    return np.frombuffer(data, dtype="<i4")


def pack_f32(values: Any) -> bytes:
    """Pack a sequence or array of floats as little-endian float32 bytes."""
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(data: bytes) -> np.ndarray:
    """Inverse of `pack_f32` (a read-only float32 array)."""
    return np.frombuffer(data, dtype="<f4")


class DecodeError(ValueError):
    """Bytes that are not a valid message: `field` is what is wrong, `reason` why."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def _packed(multiple: int):
    def check(v: bytes) -> bytes:
        if len(v) % multiple:
            raise ValueError(f"packed array length {len(v)} is not a multiple of {multiple}")
        return v

    return AfterValidator(check)


PackedI32 = Annotated[bytes, _packed(4)]
PackedF32 = Annotated[bytes, _packed(4)]


class Message(BaseModel):
    """Envelope shared by every message."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    KIND: ClassVar[str] = ""

    schema_version: int = SCHEMA_VERSION
    """Wire schema version; decode rejects any other."""
    run_id: str
    """The run this message belongs to."""
    msg_id: str = Field(default_factory=new_msg_id)
    """Unique id, sent as Nats-Msg-Id for JetStream de-duplication."""
    created_at: float = Field(default_factory=time.time)
    """Unix time the message was created."""
    _wire: dict | None = PrivateAttr(default=None)
    # for a decoded Trajectory (frozen): the validated map it was decoded from, so a
    # Reward can embed it without dumping it again; None for messages built in code
