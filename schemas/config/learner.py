"""Config sections of the learner: the step, LoRA, replay and off-policy correction."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.config.base import Section


class LoraSection(Section):
    """LoRA adapters (peft) instead of full fine-tuning (learner/lora.py)."""

    rank: int = Field(default=0, ge=0)
    """LoRA rank; 0 = full fine-tuning. With LoRA only adapter weights are published."""
    alpha: float = Field(default=16.0, gt=0.0)
    """LoRA alpha (scaling alpha / rank)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """LoRA dropout."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get LoRA adapters."""


class ReplaySection(Section):
    """An NLL loss on a replay batch of general data added to each step (learner/replay.py)."""

    share: float = Field(default=0.0, ge=0.0)
    """Coefficient of the replay NLL (0 = off); the scheduler's forgetting guard may raise it."""
    data: str = ""
    """JSONL of general text/demonstrations ({"prompt","completion"} or {"text"}); needed when share > 0."""
    batch_size: int = Field(default=8, ge=1)
    """Replay examples per step."""


class OffPolicySection(Section):
    """Correction for stale samples (learner/offpolicy.py)."""

    mode: Literal["none", "tis", "decoupled"] = "none"
    """`none` clips the ratio against the behaviour log-probs; `tis` truncated importance
    sampling; `decoupled` PPO with a proximal policy (AReaL)."""
    tis_cap: float = Field(default=2.0, gt=0.0)
    """Truncation cap C of the behaviour->proximal importance weight (tis and decoupled)."""


class LearnerSection(Section):
    """The learner (GRPO-style step)."""

    PLACE = "learner"
    RENAMED = {
        "lora_rank": "lora.rank",
        "lora_alpha": "lora.alpha",
        "lora_dropout": "lora.dropout",
        "lora_target_modules": "lora.target_modules",
        "replay_share": "replay.share",
        "replay_data": "replay.data",
        "replay_batch_size": "replay.batch_size",
        "off_policy": "off_policy.mode",
        "tis_cap": "off_policy.tis_cap",
    }

    policy: Literal["hf", "null"] = "hf"
    """`hf`: train the model; `null`: consume and account without a model (bus benchmarks)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    beta: float = 0.0
    """k3 KL coefficient to the frozen reference; 0 skips the reference model."""
    clip_low: float = 0.2
    """Lower PPO clip (ratio >= 1 - clip_low)."""
    clip_high: float = 0.28
    """Upper PPO clip (ratio <= 1 + clip_high)."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group std (GRPO)."""
    objective: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "grpo"
    """GRPO-family objective (learner/objectives.py): aggregation, advantages, ratio level."""
    kl_estimator: Literal["k3", "k1"] = "k3"
    """KL estimator to the reference when beta > 0."""
    groups_per_step: int = Field(default=8, ge=1)
    """Complete groups that make a step."""
    group_deadline_s: float = 30.0
    """A group incomplete after this long is trained if it has >= 2 samples, else filtered."""
    min_groups_per_step: int = Field(default=1, ge=1)
    """Fewest ready groups a closed time window may step on; below it the window is logged
    with its reason (how many ready, pending, expired) and extended."""
    step_window_s: float = 5.0
    """A step starts once this long has passed with at least one ready group."""
    max_staleness: int = Field(default=4, ge=0)
    """Samples older than this many versions are filtered with a reason."""
    publish_every: int = Field(default=1, ge=1)
    """Publish a WeightVersion every K steps."""
    checkpoint_every: int = Field(default=20, ge=1)
    """Checkpoint every C steps (and at stop)."""
    threads: int = 1
    """torch threads of this process."""
    skip_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no signal)."""
    refill_skipped: bool = False
    """With skip_zero_variance: only groups whose rewards differ count towards
    groups_per_step, so a step waits for that many (DAPO's dynamic sampling fills the
    batch); off: a step pops groups_per_step groups and trains the ones that differ.
    A step then consumes groups_per_step / (share of groups that differ) tasks, and the
    sampler bounds tasks in flight by groups_per_step x publish_every x max_staleness
    (`sampler.inflight_caps`):
    raise sampler.max_inflight_tasks and max_staleness with it (the e2e bench ran it with
    112 and 7 for 16 groups a step, where about 38 % of groups differ)."""
    skipped_keep_scale: bool = False
    """With skip_zero_variance: normalise each step's loss over every sample of the groups it
    popped, the skipped all-equal ones included, as if they had been trained (their
    advantages are 0, so they add only to the normaliser). Skipping is then a pure
    speed-up: with beta = 0 the step's gradient equals the full-batch GRPO/DAPO gradient,
    which is what TRL computes by training them (with beta > 0 the skipped samples' KL
    terms are missing either way). Off: normalised over the trained samples only (DAPO)."""
    off_policy: OffPolicySection = Field(default_factory=OffPolicySection)
    """Correction for stale samples."""
    replay: ReplaySection = Field(default_factory=ReplaySection)
    """Replay NLL on general data against forgetting."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters instead of full fine-tuning."""
    pcgrad: bool = False
    """Project conflicting per-domain gradients (PCGrad) before the optimizer step."""
    micro_batch_tokens: int = Field(default=0, ge=0)
    """Max padded tokens (rows x width) per micro-batch, gradients accumulated; 0 = no token cap."""
    micro_batch_size: int = Field(default=0, ge=0)
    """Max sequences per micro-batch; 0 = no cap (with micro_batch_tokens 0 too: one batch)."""
    micro_batch_max_padding: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Most padded share of a micro-batch: length-sorted samples start a new micro-batch before
    padding would pass it (mixed lengths pad at most this much); 0 = no padding cap."""
    activation_checkpointing: bool = False
    """Recompute activations in backward (model.gradient_checkpointing_enable)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype: bf16 runs forward passes under torch.autocast (fp32 master weights);
    refused at start where the hardware has no bf16 (CUDA without it; a CPU without
    AVX-512 BF16 / AMX)."""
    world_size: int = Field(default=1, ge=1)
    """Learner ranks. 1: one process (the checkpoint is `learner.pt`). N > 1: `rlbus worker
    learner` is rank 0 (the only one on the bus) and starts ranks 1..N-1 itself; the model
    is sharded with FSDP2, checkpoints are DCP (`checkpoints/learner.dcp/`). At most the
    CUDA devices (nccl) or CPU cores (gloo) present; not with LoRA or PCGrad."""
    launch: Literal["auto", "spawn", "external"] = "auto"
    """How the world_size > 1 ranks start. `spawn`: `rlbus worker learner` is rank 0 and starts
    ranks 1..N-1 on its own machine (one node). `external`: every rank is its own `rlbus worker
    learner` started from outside (a Kubernetes StatefulSet pod, an srun task), one per process,
    possibly on different machines; each finds the others through torch's env:// variables
    MASTER_ADDR / MASTER_PORT, RANK (else SLURM_PROCID, else the `-N` ordinal ending the host
    name, as a StatefulSet pod's), WORLD_SIZE (must equal world_size when set) and LOCAL_RANK
    (else SLURM_LOCALID, else 0) (learner/rendezvous.py). Rank 0 alone talks to the bus.
    `auto`: `spawn` where the learner runs (`rlbus up`, `rlbus worker`); the deploy renderers
    choose `external` for `rlbus k8s render` (one pod per rank) and for a Slurm learner larger
    than one node."""
    rendezvous_timeout_s: float = Field(default=600.0, gt=0.0)
    """`launch = "external"`: how long a rank waits for all world_size ranks to join (pods of
    one StatefulSet may start minutes apart: image pulls, scheduling) before it exits with
    an error naming the missing ranks."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend with world_size > 1: `auto` = nccl with CUDA, else gloo."""
    dist_timeout_s: float = Field(default=120.0, gt=0.0)
    """Timeout of one collective between learner ranks: a rank that hangs (a dead one is
    noticed at once) fails the learner after this long instead of blocking it."""
    weight_store: str = "nats"
    """Where weight blobs go: `nats` (run object store), `file:///dir`, or `s3://bucket/prefix` (boto3)."""
    keep_versions: int = Field(default=16, ge=0)
    """Weight versions kept in the store: after each publish, versions older than the newest
    `keep_versions` are deleted, except version 0 and the released one (learner/retention.py);
    0 keeps every version. Readers load only the newest, so a small number is safe."""
