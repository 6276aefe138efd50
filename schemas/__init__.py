"""Wire messages (MessagePack, validated on decode). See `schemas.envelope`, `schemas.episode`
and `schemas.messages`."""

from schemas.envelope import (
    SCHEMA_VERSION,
    DecodeError,
    Message,
    new_msg_id,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from schemas.episode import ChatMessage, Reward, Task, ToolCall, Trajectory, Turn, render_prompt
from schemas.glance import RewardGlance, glance_reward
from schemas.messages import (
    DeadLetter,
    EvalResult,
    Metric,
    TaskFate,
    TaskFates,
    WeightPrefetch,
    WeightVersion,
    decode,
    encode,
)
from schemas.payload_ref import BlobRef

__all__ = [
    "SCHEMA_VERSION",
    "BlobRef",
    "ChatMessage",
    "DeadLetter",
    "DecodeError",
    "EvalResult",
    "Message",
    "Metric",
    "Reward",
    "RewardGlance",
    "Task",
    "TaskFate",
    "TaskFates",
    "ToolCall",
    "Trajectory",
    "Turn",
    "WeightPrefetch",
    "WeightVersion",
    "decode",
    "encode",
    "glance_reward",
    "new_msg_id",
    "pack_f32",
    "pack_i32",
    "render_prompt",
    "unpack_f32",
    "unpack_i32",
]
