#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
import json

with open("/app/people.csv", newline="", encoding="utf-8") as fh:
    rows = [{"name": r["name"], "age": int(r["age"])} for r in csv.DictReader(fh)]
with open("/app/people.json", "w", encoding="utf-8") as out:
    json.dump(rows, out, ensure_ascii=False, indent=2)
    out.write("\n")
PY
chmod 644 /app/people.json
