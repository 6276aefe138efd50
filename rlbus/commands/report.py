"""`rlbus report RUN_PATH`: write a run's `report.md` and `plots/*.png` from its run store.

Guarantees: what `rlbus.report.build.build_report` guarantees (reads only the SQL run
store, needs no NATS server); prints one JSON object naming the report and the plots,
exit 0; exit 2 with the reason on stderr when the run store is not there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """examples:
  rlbus report runs/demo-20250101-120000                   # -> runs/.../report.md and runs/.../plots/*.png
  rlbus report runs/demo-20250101-120000 --db-url postgresql://user@host/rlbus --run-id demo-20250101-120000
"""


def _main(args) -> int:
    from rlbus.report.build import build_report

    try:
        path = build_report(Path(args.run_path), args.db_url, args.run_id, args.bucket_s)
    except FileNotFoundError as exc:
        print(f"rlbus report: {exc}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {"report": str(path), "plots": sorted(str(p) for p in (path.parent / "plots").glob("*.png"))}, indent=1
        )
    )
    return 0


def register(sub) -> None:
    """Add `rlbus report` to the `rlbus` parser."""
    p = sub.add_parser(
        "report",
        help="write a run's report.md and plots/*.png from its run store",
        description="Read the run store (SQLite <run>/run.db by default) and write report.md plus plots: "
        "reward per domain, capability vs cost, curriculum weights, throughput and staleness.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "run_path", metavar="RUN_PATH", help="the run folder, <run-dir>/<run_id> (report and plots go there)"
    )
    p.add_argument("--db-url", help="run store URL (default: $RLBUS_DB_URL, else RUN_PATH/run.db)")
    p.add_argument("--run-id", help="run id in the store (default: the folder's name)")
    p.add_argument("--bucket-s", type=float, default=10.0, help="throughput bucket in seconds (default 10)")
    p.set_defaults(func=_main)
