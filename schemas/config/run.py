"""Config sections of the run itself: identity and limits, the policy model, the SFT warm start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from schemas.config.base import Section


class RunSection(Section):
    """Identity and limits of a run."""

    run_id: str = ""
    """Run id ([A-Za-z0-9_-]); empty = generated from the config name and time."""
    run_dir: str = "runs"
    """Parent folder; each run writes only under <run_dir>/<run_id>/."""
    max_steps: int = Field(default=0, ge=0)
    """Stop after this many learner steps (0 = no step limit)."""
    max_minutes: float = Field(default=0.0, ge=0.0)
    """Stop after this much wall time, set-up included (0 = no time limit)."""
    seed: int = 0
    """Seed for task generation, model init and sampling."""
    nats_url: str = ""
    """Connect to this NATS server; empty = start an embedded one."""
    drain_seconds: float = Field(default=20.0, ge=0.0)
    """At stop, how long the pipeline may drain after the sampler stops."""
    heartbeat_timeout_s: float = Field(default=60.0, ge=0.0)
    """`rlbus up` kills and restarts a worker that has sent heartbeats (every second) and then none for
    this long while the launcher was connected (a frozen process: SIGSTOP, a deadlock); 0 = never."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Prometheus /metrics port of each worker (0 = off). Several workers on one host take
    the first free port from here upward; env RLBUS_METRICS_PORT sets one process's port."""
    nats_tls_ca: str = ""
    """CA file that verifies the NATS server's certificate (empty = plain TCP unless env RLBUS_NATS_TLS_CA)."""
    nats_tls_cert: str = ""
    """Client certificate for mutual TLS (with nats_tls_key; empty = none). Paths, never the secrets themselves."""
    nats_tls_key: str = ""
    """Private key of nats_tls_cert (mount it from a secret; never bake it into an image)."""


class ModelSection(Section):
    """The policy model: an existing HF checkpoint or a tiny one built locally."""

    path: str = ""
    """Local HF model dir to start from; empty = build a tiny model in the run dir."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """Architecture of the tiny model when building one."""
    tokenizer: Literal["bpe", "char"] = "bpe"
    """Tokenizer of the tiny model when building one: `bpe` (byte-level BPE trained on the
    domains' text, ChatML chat template: chat prompts go through it) or `char` (one id per
    printable ASCII character, no template: prompts are the plain contents). Ignored with `path`."""
    hidden_size: int = 128
    """Tiny model width."""
    num_layers: int = 4
    """Tiny model depth."""
    num_heads: int = 4
    """Tiny model attention heads."""
    max_position_embeddings: int = Field(default=512, ge=16)
    """Tiny model context in tokens (prompt + generation); longer contexts end an episode with `length`."""
    rope_scaling: str = ""
    """RoPE scaling of the tiny model as `KIND:FACTOR` (KIND linear, dynamic or yarn; FACTOR > 1):
    the rotary embedding is scaled from max_position_embeddings / FACTOR original positions
    (HF `rope_scaling`, as `rlbus init-model --rope-scaling`); empty = none. Ignored with `path`."""

    @field_validator("rope_scaling")
    @classmethod
    def _rope_scaling_form(cls, value: str) -> str:
        if value:
            parse_rope_scaling(value)
        return value


ROPE_KINDS = ("linear", "dynamic", "yarn")
"""RoPE scaling kinds a tiny model may be built with (HF `rope_scaling.rope_type`)."""


def parse_rope_scaling(spec: str) -> tuple[str, float]:
    """`KIND:FACTOR` (e.g. `linear:4`, `yarn:2.5`) as (kind, factor); ValueError naming the form."""
    kind, _, factor = spec.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    if kind not in ROPE_KINDS or not value > 1.0:
        raise ValueError(
            f"rope scaling {spec!r}: expected KIND:FACTOR with KIND one of {list(ROPE_KINDS)} and FACTOR > 1, e.g. linear:4"
        )
    return kind, value


class SFTSection(Section):
    """Supervised warm start before RL."""

    enabled: bool = True
    """Run SFT on the domain's demonstrations before RL."""
    seconds: float = 75.0
    """Wall-time budget of SFT."""
    max_steps: int = 100_000
    """Step cap of SFT."""
    batch_size: int = 64
    """Demonstrations per SFT step."""
    lr: float = 3e-3
    """SFT learning rate."""
    difficulty: int = 3
    """Difficulty of the demonstrations."""
    threads: int = 2
    """torch threads for SFT (nothing else runs then)."""
