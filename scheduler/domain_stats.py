"""Per-domain statistics of training rewards over time windows, from the run store's `rewards`.

Guarantees:
- `domain_stats(store, run_id, window_s)` counts only training samples (purpose `train`) the
  verifier scored (status `ok`), in windows of `window_s` seconds aligned to the Unix epoch
  (the same buckets on SQLite and PostgreSQL).
- The rows are upserted into `domain_stats` (`DomainStatRow`, keyed on run_id, domain,
  window_s, window_start): recomputing is idempotent and never duplicates a row.
"""

import math

import sqlalchemy as sa
from sqlmodel import func

from scheduler.store import Store
from scheduler.store_rows import DomainStatRow, RewardRow


def domain_stats(
    store: Store, run_id: str, window_s: float, *, success_threshold: float = 0.5, since: float | None = None
) -> list[DomainStatRow]:
    """Per-domain statistics of training rewards (purpose `train`, status `ok`) over
    windows of `window_s` seconds aligned to the Unix epoch; a sample succeeds when its
    reward is at least `success_threshold`. The rows are upserted into `domain_stats`
    (recomputing is idempotent) and returned ordered by (window_start, domain)."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    t = RewardRow.__table__.c
    bucket = t.created_at / window_s
    # floor() on PostgreSQL; SQLite truncates a positive REAL cast to INTEGER (= floor)
    index = func.floor(bucket) if store.dialect == "postgresql" else sa.cast(bucket, sa.Integer)
    success = sa.case((t.reward >= success_threshold, 1.0), else_=0.0)
    q = (
        sa.select(t.domain, index.label("w"), func.count(), func.avg(t.reward), func.avg(success))
        .where(t.run_id == run_id, t.purpose == "train", t.status == "ok")
        .group_by(t.domain, index)
    )
    if since is not None:
        q = q.where(t.created_at >= since)
    with store.engine.connect() as conn:
        found = conn.execute(q).all()
    rows = [
        {
            "run_id": run_id,
            "domain": d,
            "window_start": math.floor(w) * window_s,
            "window_s": float(window_s),
            "n": int(n),
            "reward_mean": float(mean),
            "success_rate": float(rate),
        }
        for d, w, n, mean, rate in found
    ]
    rows.sort(key=lambda r: (r["window_start"], r["domain"]))
    store.upsert(DomainStatRow, rows)
    return [DomainStatRow(**r) for r in rows]
