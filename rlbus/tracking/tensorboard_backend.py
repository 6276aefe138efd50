"""TensorBoard backend of the tracker: standard event files under `<run>/tensorboard/`.

Guarantees:
- Written through `torch.utils.tensorboard.SummaryWriter` (needs the `tensorboard`
  package, extra `.[tracking]`); a missing package is a `TrackingUnavailable` naming it.
- Every scalar keeps the learner step as its step and the source message's stored time
  as its wall time; a samples table becomes a Markdown text summary (tag `samples`).
- `flush` returns once the events are on disk. Each tracker process appends its own event
  file; the tracker's step guard (`rlbus.tracking.points.Steps`) keeps every tag strictly
  increasing across them, so TensorBoard sees no point twice.
"""

from __future__ import annotations

from pathlib import Path

from rlbus.tracking.backends import EXTRA, TrackingUnavailable
from rlbus.tracking.points import SAMPLE_COLUMNS, Point, Table


def _cell(value) -> str:
    text = value if isinstance(value, str) else repr(value) if not isinstance(value, float) else f"{value:.4g}"
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown_table(table: Table) -> str:
    """The samples of `table` as a Markdown table (TensorBoard renders it)."""
    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(_cell(c) for c in row) + " |\n" for row in table.rows)


class TensorBoardBackend:
    """Scalars and sample tables into TensorBoard event files."""

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        try:
            import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it; say which extra if missing
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TrackingUnavailable(
                f"tracking backend 'tensorboard' needs the tensorboard package ({exc}): {EXTRA}"
            ) from None
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=3600, max_queue=100_000)

    def write(self, points: list[Point], tables: list[Table]) -> None:
        """Queue the points and tables (written at the next `flush`)."""
        for p in points:
            self.writer.add_scalar(p.tag, p.value, global_step=p.step, walltime=p.wall_time)
        for t in tables:
            self.writer.add_text(t.tag, markdown_table(t), global_step=t.step, walltime=t.wall_time)

    def flush(self) -> None:
        """Everything written so far is on disk."""
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
