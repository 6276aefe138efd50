#!/bin/bash
# words.txt has 37 lines as built; the expected value is fixed here so editing words.txt does not help.
got=$(tr -d '[:space:]' 2>/dev/null < /app/count.txt)
if [ "$got" = "37" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "count.txt holds '${got}', expected 37" >&2
  echo 0 > /logs/verifier/reward.txt
fi
