"""The run store: SQL tables that record a run, on SQLite (default) or PostgreSQL.

Guarantees:
- `open_store(url, run_path)` opens `<run_path>/run.db` (SQLite, WAL, busy timeout)
  unless a SQLAlchemy URL is given, or the env var `RLBUS_DB_URL` names one. A bare
  `postgresql://` URL uses the psycopg (v3) driver. Tables (`scheduler.store_rows`) are
  created if missing; opening twice changes nothing.
- Every message-derived row is keyed on the message's `msg_id`, and every write is
  insert-or-ignore (`ON CONFLICT DO NOTHING` on SQLite and PostgreSQL; a per-row
  savepoint on other dialects). JetStream delivers at least once, so the same message
  written twice, or by two recorders, still gives exactly one row.
- Writes are batched: one statement and one transaction per call, committed before the
  call returns (callers ack messages only after that).
- Rows that are not messages are upserts with a natural key: `CostRow` on
  (run_id, stage) holds cumulative totals, `DomainStatRow` on
  (run_id, domain, window_s, window_start) is recomputed from `RewardRow` by
  `scheduler.domain_stats.domain_stats`.
- Every write (insert-or-ignore, upsert, status) that loses its connection (the database
  restarting: `OperationalError`) is retried with backoff for up to `WRITE_RETRY_S` before
  the error reaches the caller; the writes are idempotent, so a retry never duplicates.
- A store created before a column was added (`ADDED_COLUMNS`, e.g. `eval_results.purpose`)
  gets it, with its default (NULL for a nullable column), when opened.
- Cost so far: every `EvalResultRow` carries the run's cumulative cost when it was recorded:
  CPU/GPU seconds and tokens summed over the `costs` rows (heartbeat totals per stage, None
  before any), and sandbox seconds summed over the recorded rewards (`RewardRow.sandbox_seconds`:
  the episode's tool executions plus the verifier's own sandbox time, `reward_sandbox_seconds`;
  message-derived, so a redelivered reward never counts twice; None before any reward).
"""

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel, func, select

from scheduler.store_rows import (
    ADDED_COLUMNS,
    TABLES,
    CostRow,
    CurriculumUpdateRow,
    DeadLetterRow,
    EvalResultRow,
    GateCheckRow,
    RewardRow,
    RunRow,
    WeightVersionRow,
)
from schemas.redact import is_redacted, redact_tree

DB_URL_ENV = "RLBUS_DB_URL"
WRITE_RETRY_S = 20.0
"""How long a write waits out a lost database connection (a PostgreSQL restart) before it raises."""


def retrying(work):
    """Run one idempotent write; retry it on `OperationalError` (connection lost) for up to WRITE_RETRY_S."""
    deadline, delay = time.monotonic() + WRITE_RETRY_S, 0.25
    while True:
        try:
            return work()
        except sa.exc.OperationalError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 4.0)


def episode_tokens(trajectory) -> int:
    """Tokens of a trajectory's turns (prompt, model, tool: its context at the end); packed int32 ids."""
    return sum(len(t.token_ids) // 4 for t in trajectory.turns)


def reward_sandbox_seconds(reward) -> float:
    """A `Reward`'s sandbox wall seconds: its episode's executed tool calls plus its verifier's own."""
    episode = sum(c.duration_ms for c in reward.trajectory.tool_calls if not c.error) / 1000.0
    return float(episode + getattr(reward, "sandbox_seconds", 0.0))


def resolve_url(url: str | None, run_path: Path) -> str:
    """The database URL: `url`, else `$RLBUS_DB_URL`, else SQLite `<run_path>/run.db`.
    A `url` whose password was redacted (`***`, as config.json keeps it: schemas.redact) is
    replaced by `$RLBUS_DB_URL`, where `rlbus up` hands the real one to its workers; without
    it this raises (fail closed: never a login with the placeholder)."""
    if url and is_redacted(url):
        if not os.environ.get(DB_URL_ENV):
            raise ValueError(
                f"the run store URL {url} has its password redacted (the run folder never keeps it); "
                f"set {DB_URL_ENV} to the full URL"
            )
        url = None
    url = url or os.environ.get(DB_URL_ENV) or None
    if url is None:
        Path(run_path).mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{Path(run_path).resolve() / 'run.db'}"
    for bare in ("postgresql://", "postgres://"):
        if url.startswith(bare):
            return "postgresql+psycopg://" + url[len(bare) :]
    return url


def _make_engine(url: str) -> sa.Engine:
    if not url.startswith("sqlite"):
        return sa.create_engine(url, pool_pre_ping=True)
    engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()

    return engine


class Store:
    """The run's SQL tables behind idempotent, batched writes."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        SQLModel.metadata.create_all(engine, tables=[t.__table__ for t in TABLES])
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """Columns added to a table after a store was created (`create_all` never alters an
        existing table): ALTER TABLE ADD COLUMN with its default, so a store of an older run
        opens and resumes."""
        inspector = sa.inspect(self.engine)
        for model, column, default in ADDED_COLUMNS:
            table = model.__table__
            if column not in {c["name"] for c in inspector.get_columns(table.name)}:
                kind = table.c[column].type.compile(dialect=self.engine.dialect)
                null = "" if default.upper() == "NULL" else " NOT NULL"
                with self.engine.begin() as conn:
                    conn.execute(
                        sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column} {kind}{null} DEFAULT {default}")
                    )

    @property
    def dialect(self) -> str:
        """`sqlite`, `postgresql`, ..."""
        return self.engine.dialect.name

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    # -- generic writes -----------------------------------------------------------------
    def _insert(self, model: type[SQLModel]):
        table = model.__table__
        if self.dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        elif self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            return None
        return insert(table)

    def insert_ignore(self, model: type[SQLModel], rows: Sequence[dict[str, Any]]) -> int:
        """Insert rows in one transaction, skipping any whose primary key exists.
        Returns how many were new (exact on SQLite and PostgreSQL)."""
        if not rows:
            return 0
        return retrying(lambda: self._insert_ignore(model, rows))

    def _insert_ignore(self, model: type[SQLModel], rows: Sequence[dict[str, Any]]) -> int:
        stmt = self._insert(model)
        with self.engine.begin() as conn:
            if stmt is not None:
                # RETURNING lists only the rows actually inserted (executemany rowcount
                # is not reliable across drivers)
                key = next(iter(model.__table__.primary_key.columns))
                result = conn.execute(stmt.on_conflict_do_nothing().returning(key), list(rows))
                return len(result.all())
            new = 0
            for row in rows:  # portable fallback: a savepoint per row
                try:
                    with conn.begin_nested():
                        conn.execute(model.__table__.insert(), row)
                    new += 1
                except IntegrityError:
                    pass
            return new

    def upsert(self, model: type[SQLModel], rows: Sequence[dict[str, Any]]) -> None:
        """Insert rows, replacing the non-key columns of rows whose primary key exists."""
        if not rows:
            return
        retrying(lambda: self._upsert(model, rows))

    def _upsert(self, model: type[SQLModel], rows: Sequence[dict[str, Any]]) -> None:
        table = model.__table__
        keys = [c.name for c in table.primary_key.columns]
        stmt = self._insert(model)
        with self.engine.begin() as conn:
            if stmt is not None:
                cols = {c: getattr(stmt.excluded, c) for c in rows[0] if c not in keys}
                conn.execute(stmt.on_conflict_do_update(index_elements=keys, set_=cols), list(rows))
                return
            for row in rows:
                where = sa.and_(*(table.c[k] == row[k] for k in keys))
                if conn.execute(table.update().where(where).values(**row)).rowcount == 0:
                    conn.execute(table.insert(), row)

    # -- message writes -----------------------------------------------------------------
    def ensure_run(self, run_id: str, config: dict | None = None, status: str = "running") -> bool:
        """Create the run's row if it does not exist (its config with URL passwords redacted); True if created."""
        # no credential in the stored config (issue 27): every URL's password is redacted
        return (
            self.insert_ignore(
                RunRow,
                [{"run_id": run_id, "config": redact_tree(config or {}), "started_at": time.time(), "status": status}],
            )
            > 0
        )

    def set_run_status(self, run_id: str, status: str) -> None:
        """Set the run's status (`running`, `finished`, `failed`, ...)."""

        def write() -> None:
            with self.engine.begin() as conn:
                conn.execute(
                    sa.update(RunRow.__table__).where(RunRow.__table__.c.run_id == run_id).values(status=status)
                )

        retrying(write)

    def record_rewards(self, rewards: Iterable) -> int:
        """Rows for `Reward` messages; returns how many were new."""
        return self.insert_ignore(
            RewardRow,
            [
                {
                    "msg_id": r.msg_id,
                    "run_id": r.run_id,
                    "domain": r.trajectory.domain,
                    "difficulty": r.trajectory.difficulty,
                    "purpose": r.trajectory.purpose,
                    "reward": float(r.reward),
                    "status": r.status,
                    "policy_version": r.trajectory.policy_version,
                    "task_msg_id": r.trajectory.task_msg_id,
                    "created_at": r.created_at,
                    "sandbox_seconds": reward_sandbox_seconds(r),
                    "tokens": episode_tokens(r.trajectory),
                }
                for r in rewards
            ],
        )

    def record_weights(self, versions: Iterable) -> int:
        """Rows for `WeightVersion` messages; returns how many were new."""
        return self.insert_ignore(
            WeightVersionRow,
            [
                {
                    "msg_id": w.msg_id,
                    "run_id": w.run_id,
                    "version": w.version,
                    "step": w.step,
                    "sha256": w.sha256,
                    "uri": w.uri,
                    "bytes": w.bytes,
                    "created_at": w.created_at,
                    "metrics": dict(w.metrics),
                }
                for w in versions
            ],
        )

    def record_evals(self, results: Iterable) -> int:
        """Rows for `EvalResult` messages, with the run's cumulative cost at recording
        time (None when no cost was recorded yet); returns how many were new."""
        results = list(results)
        costs = {run_id: self.cost_totals(run_id) for run_id in {e.run_id for e in results}}
        sandbox = {run_id: self.sandbox_seconds(run_id) for run_id in costs}
        return self.insert_ignore(
            EvalResultRow,
            [
                {
                    "msg_id": e.msg_id,
                    "run_id": e.run_id,
                    "version": e.version,
                    "step": e.step,
                    "domain": e.domain,
                    "score": e.score,
                    "n": e.n,
                    "eval_set_sha256": e.eval_set_sha256,
                    "purpose": e.purpose,
                    "created_at": e.created_at,
                    "cost_sandbox_seconds": sandbox[e.run_id],
                    "groups": dict(getattr(e, "groups", None) or {}),
                    **_cost_columns(costs[e.run_id]),
                }
                for e in results
            ],
        )

    def record_dead_letters(self, letters: Iterable) -> int:
        """Rows for `DeadLetter` messages; returns how many were new."""
        return self.insert_ignore(
            DeadLetterRow,
            [
                {
                    "msg_id": d.msg_id,
                    "run_id": d.run_id,
                    "stage": d.stage,
                    "reason": d.reason,
                    "error_type": d.error_type,
                    "original_subject": d.original_subject,
                    "original_msg_id": d.original_msg_id,
                    "delivery_count": d.delivery_count,
                    "task_msg_id": d.task_msg_id,
                    "created_at": d.created_at,
                }
                for d in letters
            ],
        )

    def record_curriculum_update(
        self,
        run_id: str,
        msg_id: str,
        weights: dict[str, float],
        levels: dict[str, int],
        reason: str = "",
        created_at: float | None = None,
    ) -> bool:
        """One curriculum update (idempotent on `msg_id`); True if it was new."""
        return (
            self.insert_ignore(
                CurriculumUpdateRow,
                [
                    {
                        "msg_id": msg_id,
                        "run_id": run_id,
                        "weights": dict(weights),
                        "levels": dict(levels),
                        "reason": reason,
                        "created_at": time.time() if created_at is None else created_at,
                    }
                ],
            )
            > 0
        )

    def set_cost(
        self, run_id: str, stage: str, *, cpu_seconds: float, gpu_seconds: float = 0.0, tokens: int = 0
    ) -> None:
        """Set a stage's cumulative cost totals (idempotent: the totals replace the old ones)."""
        self.upsert(
            CostRow,
            [
                {
                    "run_id": run_id,
                    "stage": stage,
                    "cpu_seconds": float(cpu_seconds),
                    "gpu_seconds": float(gpu_seconds),
                    "tokens": int(tokens),
                    "updated_at": time.time(),
                }
            ],
        )

    def record_gate_check(self, row: dict[str, Any]) -> None:
        """Upsert one `GateCheckRow` (keyed on run_id + version: re-checking a version replaces it)."""
        self.upsert(
            GateCheckRow,
            [{"scores": {}, "floors": {}, "failures": {}, "overrides": {}, "created_at": time.time(), **row}],
        )

    def latest_released(self, run_id: str) -> int | None:
        """The newest version whose gate check released it, or None."""
        t = GateCheckRow.__table__.c
        with self.engine.connect() as conn:
            v = conn.execute(sa.select(func.max(t.version)).where(t.run_id == run_id, t.released)).scalar()
        return None if v is None else int(v)

    # -- reads --------------------------------------------------------------------------
    def rows(self, model: type[SQLModel], run_id: str | None = None, order_by: str | None = None) -> list:
        """All rows of a table (of one run), optionally ordered by a column (retried like a write)."""
        q = select(model)
        if run_id is not None:
            q = q.where(model.run_id == run_id)
        if order_by:
            q = q.order_by(getattr(model, order_by))

        def read() -> list:
            with Session(self.engine) as s:
                return list(s.exec(q).all())

        return retrying(read)

    def count(self, model: type[SQLModel], run_id: str | None = None) -> int:
        """Number of rows of a table (of one run)."""
        with Session(self.engine) as s:
            q = select(func.count()).select_from(model)
            if run_id is not None:
                q = q.where(model.run_id == run_id)
            return int(s.exec(q).one())

    def cost_totals(self, run_id: str) -> dict[str, float] | None:
        """Summed cost over every stage of a run, or None if none is recorded."""
        t = CostRow.__table__.c
        with self.engine.connect() as conn:
            n, cpu, gpu, tokens = conn.execute(
                sa.select(func.count(), func.sum(t.cpu_seconds), func.sum(t.gpu_seconds), func.sum(t.tokens)).where(
                    t.run_id == run_id
                )
            ).one()
        if not n:
            return None
        return {"cpu_seconds": float(cpu or 0), "gpu_seconds": float(gpu or 0), "tokens": int(tokens or 0)}

    def sandbox_seconds(self, run_id: str) -> float | None:
        """Sandbox wall seconds summed over a run's recorded rewards, or None if none is recorded."""
        t = RewardRow.__table__.c
        with self.engine.connect() as conn:
            n, total = conn.execute(
                sa.select(func.count(), func.sum(t.sandbox_seconds)).where(t.run_id == run_id)
            ).one()
        return float(total or 0.0) if n else None

    def delete_run(self, run_id: str) -> None:
        """Delete every row of a run, in every table."""
        with self.engine.begin() as conn:
            for model in TABLES:
                conn.execute(sa.delete(model.__table__).where(model.__table__.c.run_id == run_id))


def _cost_columns(cost: dict[str, float] | None) -> dict[str, Any]:
    if cost is None:
        return {"cost_cpu_seconds": None, "cost_gpu_seconds": None, "cost_tokens": None}
    return {
        "cost_cpu_seconds": cost["cpu_seconds"],
        "cost_gpu_seconds": cost["gpu_seconds"],
        "cost_tokens": cost["tokens"],
    }


def open_store(url: str | None, run_path: Path) -> Store:
    """Open (creating tables if needed) the run store; see `resolve_url`."""
    return Store(_make_engine(resolve_url(url, run_path)))
