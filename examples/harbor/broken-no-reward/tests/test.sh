#!/bin/bash
# DELIBERATELY BROKEN: this verifier runs its check but never writes
# /logs/verifier/reward.txt or reward.json. It exists to show how rlbus treats a
# verifier that leaves no reward file. Do not "fix" it.
cd /app
if [ "$(cat /app/out.txt 2>/dev/null)" = "done" ]; then
  echo "out.txt is right"
else
  echo "out.txt is missing or wrong"
fi
exit 0
