"""Wire messages (MessagePack, validated on decode). See `schemas.messages`."""

from schemas.glance import RewardGlance, glance_reward
from schemas.messages import (
    SCHEMA_VERSION,
    BlobRef,
    ChatMessage,
    DeadLetter,
    DecodeError,
    EvalResult,
    Message,
    Metric,
    Reward,
    Task,
    TaskFate,
    TaskFates,
    ToolCall,
    Trajectory,
    Turn,
    WeightPrefetch,
    WeightVersion,
    decode,
    encode,
    new_msg_id,
    pack_f32,
    pack_i32,
    render_prompt,
    unpack_f32,
    unpack_i32,
)

__all__ = ["SCHEMA_VERSION", "BlobRef", "ChatMessage", "DeadLetter", "DecodeError", "EvalResult", "Message", "Metric", "Reward",
           "RewardGlance", "Task", "TaskFate", "TaskFates", "ToolCall", "Trajectory", "Turn", "WeightPrefetch",
           "WeightVersion", "decode", "encode", "glance_reward", "new_msg_id", "pack_f32", "pack_i32", "render_prompt",
           "unpack_f32", "unpack_i32"]
