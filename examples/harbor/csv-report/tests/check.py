"""Score /app/report.csv in three parts and write /logs/verifier/reward.json.

header: 1 when the first line is exactly `region,total`
rows:   the fraction of regions that have exactly one row, with the right total
sorted: 1 when there is one row per region and the totals never increase
reward: 1 when all three are 1, else their mean
"""

import json
import sys

REPORT = "/app/report.csv"
OUT = "/logs/verifier/reward.json"
EXPECTED = {"south": 400.0, "north": 250.0, "east": 216.0, "west": 105.0}


def score() -> dict[str, float]:
    try:
        with open(REPORT, encoding="utf-8") as fh:
            lines = [ln.rstrip("\r\n") for ln in fh.read().splitlines()]
    except OSError:
        return {"header": 0.0, "rows": 0.0, "sorted": 0.0}
    while lines and not lines[-1].strip():
        lines.pop()
    header = 1.0 if lines and lines[0] == "region,total" else 0.0
    body = lines[1:] if lines and lines[0].lower().startswith("region") else lines
    parsed: list[tuple[str, float | None]] = []
    for ln in body:
        parts = ln.split(",")
        total: float | None = None
        if len(parts) == 2:
            try:
                total = float(parts[1])
            except ValueError:
                total = None
        parsed.append((parts[0].strip(), total))
    names = [n for n, _ in parsed]
    good = 0
    for region, want in EXPECTED.items():
        hits = [t for n, t in parsed if n == region]
        if len(hits) == 1 and hits[0] is not None and abs(hits[0] - want) < 0.005:
            good += 1
    rows = good / len(EXPECTED)
    totals = [t for _, t in parsed]
    ok_sorted = (
        len(parsed) == len(EXPECTED)
        and sorted(names) == sorted(EXPECTED)
        and all(t is not None for t in totals)
        and all(a >= b for a, b in zip(totals, totals[1:]))
    )
    return {"header": header, "rows": rows, "sorted": 1.0 if ok_sorted else 0.0}


def main() -> None:
    parts = score()
    vals = list(parts.values())
    reward = 1.0 if all(v == 1.0 for v in vals) else round(sum(vals) / len(vals), 4)
    result = {"reward": reward, **parts}
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
        fh.write("\n")
    print(json.dumps(result))
    sys.exit(0 if reward == 1.0 else 1)


if __name__ == "__main__":
    main()
