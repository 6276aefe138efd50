#!/bin/bash
# Lines containing ERROR in /app/logs/*.log: app.log 2, db.log 3, worker.log 1 = 6
# (grep -c per file gives 2, 3, 1; occurrences would be 7; including notes.txt 8).
expected=6
got=$(tr -d '[:space:]' 2>/dev/null < /app/answer.txt)
if [ "$got" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "answer.txt holds '${got}', expected ${expected}" >&2
  echo 0 > /logs/verifier/reward.txt
fi
