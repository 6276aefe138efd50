"""The run store's tables: one SQLModel row class per table, and the columns added since.

Guarantees:
- Every message-derived row (`WeightVersionRow`, `EvalResultRow`, `DeadLetterRow`,
  `CurriculumUpdateRow`, `RewardRow`) has the message's `msg_id` as its primary key, so
  `scheduler.store.Store`'s insert-or-ignore keeps exactly one row per message.
- Rows that are not messages have a natural key: `RunRow` on run_id, `CostRow` on
  (run_id, stage), `DomainStatRow` on (run_id, domain, window_s, window_start),
  `GateCheckRow` on (run_id, version).
- Every table has a `run_id` column (`Store.delete_run` and per-run reads rely on it).
- Times are Unix seconds (float), as in the wire messages, so window arithmetic is
  the same on every database.
- `TABLES` lists every table; `ADDED_COLUMNS` every column added after the first release,
  with the SQL default an older store gets when opened.
"""

import time

from sqlmodel import JSON, Column, Field, SQLModel


class RunRow(SQLModel, table=True):
    """One run: its config and status."""

    __tablename__ = "runs"
    run_id: str = Field(primary_key=True)
    config: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    started_at: float = Field(default_factory=time.time)
    status: str = "running"


class WeightVersionRow(SQLModel, table=True):
    """A published policy version (from `WeightVersion`)."""

    __tablename__ = "weight_versions"
    msg_id: str = Field(primary_key=True)
    run_id: str = Field(index=True)
    version: int
    step: int
    sha256: str
    uri: str = ""
    created_at: float
    metrics: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    bytes: int = 0


class EvalResultRow(SQLModel, table=True):
    """An evaluation of one version on one domain, with the run's cumulative cost then."""

    __tablename__ = "eval_results"
    msg_id: str = Field(primary_key=True)
    run_id: str = Field(index=True)
    version: int
    step: int
    domain: str
    score: float
    n: int
    eval_set_sha256: str
    purpose: str = "train"
    """`train` (a trained domain) or `heldout` (a zero-shot domain, never trained on)."""
    created_at: float = Field(default_factory=time.time)
    cost_cpu_seconds: float | None = None
    cost_gpu_seconds: float | None = None
    cost_tokens: int | None = None
    cost_sandbox_seconds: float | None = None
    """Sandbox wall seconds of every reward recorded so far (episode tool executions + verifiers)."""
    groups: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False, default={}))
    """`EvalResult.groups`: {param: {value: fraction correct}} (long-context position bucket, length)."""


class DomainStatRow(SQLModel, table=True):
    """Training reward statistics of one domain over one time window."""

    __tablename__ = "domain_stats"
    run_id: str = Field(primary_key=True)
    domain: str = Field(primary_key=True)
    window_s: float = Field(primary_key=True)
    window_start: float = Field(primary_key=True)
    n: int
    reward_mean: float
    success_rate: float


class DeadLetterRow(SQLModel, table=True):
    """A dead-lettered message (the original bytes stay in the DLQ stream)."""

    __tablename__ = "dead_letters"
    msg_id: str = Field(primary_key=True)
    run_id: str = Field(index=True)
    stage: str
    reason: str
    error_type: str
    original_subject: str
    original_msg_id: str | None = None
    delivery_count: int
    task_msg_id: str | None = None
    created_at: float


class CurriculumUpdateRow(SQLModel, table=True):
    """One curriculum update: domain weights and difficulty levels."""

    __tablename__ = "curriculum_updates"
    msg_id: str = Field(primary_key=True)
    run_id: str = Field(index=True)
    weights: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    levels: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    reason: str = ""
    created_at: float = Field(default_factory=time.time)


class CostRow(SQLModel, table=True):
    """Cumulative cost of one stage of a run."""

    __tablename__ = "costs"
    run_id: str = Field(primary_key=True)
    stage: str = Field(primary_key=True)
    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0
    tokens: int = 0
    updated_at: float = Field(default_factory=time.time)


class RewardRow(SQLModel, table=True):
    """One scored sample (from `Reward`), the raw material of per-domain statistics."""

    __tablename__ = "rewards"
    msg_id: str = Field(primary_key=True)
    run_id: str = Field(index=True)
    domain: str
    difficulty: int
    purpose: str = "train"
    reward: float
    status: str
    policy_version: int
    task_msg_id: str = ""
    created_at: float
    sandbox_seconds: float = 0.0
    """Sandbox wall time of this sample: its episode's tool executions plus its verification's."""
    tokens: int = 0
    """Tokens of the episode's context at its end: prompt, model and tool turns (`rlbus report`'s cost per episode)."""


class GateCheckRow(SQLModel, table=True):
    """The gates' verdict on one evaluated version (`scheduler.gates`): release gate,
    forgetting guard and plateau detection. Upserted on (run_id, version)."""

    __tablename__ = "gate_checks"
    run_id: str = Field(primary_key=True)
    version: int = Field(primary_key=True)
    step: int = 0
    scores: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    floors: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    passed: bool = False
    failures: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    released: bool = False
    cost_samples: float | None = None
    capability: float | None = None
    forgetting: bool = False
    overrides: dict = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    plateau: bool = False
    gain_per_unit: float | None = None
    created_at: float = Field(default_factory=time.time)


TABLES: tuple[type[SQLModel], ...] = (
    RunRow,
    WeightVersionRow,
    EvalResultRow,
    DomainStatRow,
    DeadLetterRow,
    CurriculumUpdateRow,
    CostRow,
    RewardRow,
    GateCheckRow,
)
ADDED_COLUMNS: tuple[tuple[type[SQLModel], str, str], ...] = (
    (EvalResultRow, "purpose", "'train'"),
    (EvalResultRow, "cost_sandbox_seconds", "NULL"),
    (RewardRow, "sandbox_seconds", "0"),
    (EvalResultRow, "groups", "'{}'"),
    (RewardRow, "tokens", "0"),
)
"""(table, column, SQL default) of columns added after the first release: `Store` adds them to older
stores (NOT NULL unless the default is NULL)."""
