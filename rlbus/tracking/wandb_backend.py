"""wandb backend of the tracker: one wandb run per rlbus run, offline unless a key is set.

Guarantees:
- Mode: `WANDB_MODE` when set; else `online` when `WANDB_API_KEY` is set; else `offline`,
  which writes the usual offline run dir `<run>/wandb/offline-run-*` (wandb's `dir` is the
  run folder) for `wandb sync` to upload later. Needs the `wandb` package (extra
  `.[tracking]`); a missing package is a `TrackingUnavailable` naming it.
- The wandb run id is the rlbus run id and `resume="allow"`: a restarted tracker (or
  `rlbus up --resume`) continues the same wandb run; offline, each tracker process writes
  its own `offline-run-*` dir under that id and `wandb sync` joins them.
- The resolved run config (every URL's password redacted: schemas.redact) is the wandb
  run config; project, entity, name and tags come
  from `[tracking]`.
- Every row carries `learner/step` (the x axis every metric is defined against) and
  `wall_time` (the source message's stored time; wandb's own `_timestamp` is when the
  tracker logged it). A samples table is a `wandb.Table` under `samples`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlbus.tracking.backends import EXTRA, TrackingUnavailable
from rlbus.tracking.points import SAMPLE_COLUMNS, Point, Table
from schemas.redact import redact_tree

STEP_KEY, TIME_KEY = "learner/step", "wall_time"


def wandb_mode(env: dict[str, str] | None = None) -> str:
    """`WANDB_MODE` if set, else online with `WANDB_API_KEY`, else offline."""
    env = os.environ if env is None else env
    if env.get("WANDB_MODE", "").strip():
        return env["WANDB_MODE"].strip()
    return "online" if env.get("WANDB_API_KEY", "").strip() else "offline"


class WandbBackend:
    """Scalars and sample tables into one wandb run (id = the rlbus run id)."""

    name = "wandb"

    def __init__(self, cfg, run_path: Path):
        try:
            import wandb
        except ImportError as exc:
            raise TrackingUnavailable(f"tracking backend 'wandb' needs the wandb package ({exc}): {EXTRA}") from None
        self.wandb = wandb
        tc = cfg.tracking
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True, disable_git=True, save_code=False)
        self.run = wandb.init(
            project=tc.project,
            entity=tc.entity or None,
            name=tc.run_name or cfg.run.run_id,
            id=cfg.run.run_id,
            resume="allow",
            dir=str(run_path),
            tags=list(tc.tags),
            config=redact_tree(cfg.model_dump(mode="json")),
            mode=wandb_mode(),
            settings=settings,
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric(TIME_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def write(self, points: list[Point], tables: list[Table]) -> None:
        """Log the points as one row per learner step (in step order), then the tables."""
        rows: dict[int, dict] = {}
        for p in points:
            row = rows.setdefault(p.step, {TIME_KEY: p.wall_time})
            row[p.tag] = p.value
            row[TIME_KEY] = max(row[TIME_KEY], p.wall_time)
        for step in sorted(rows):
            self.run.log({**rows[step], STEP_KEY: step})
        for t in tables:
            data = [[json.dumps(c, sort_keys=True) if isinstance(c, dict) else c for c in row] for row in t.rows]
            self.run.log(
                {
                    t.tag: self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=data),
                    STEP_KEY: t.step,
                    TIME_KEY: t.wall_time,
                }
            )

    def flush(self) -> None:
        """Nothing to do: each `log` is handed to wandb's service process as it is called."""

    def close(self) -> None:
        self.run.finish()
