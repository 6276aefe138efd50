#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
from collections import defaultdict

totals = defaultdict(float)
with open("/app/sales.csv", newline="") as fh:
    for row in csv.DictReader(fh):
        totals[row["region"]] += float(row["amount"])
with open("/app/report.csv", "w") as out:
    out.write("region,total\n")
    for region, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        out.write(f"{region},{total:.2f}\n")
PY
