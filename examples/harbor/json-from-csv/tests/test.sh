#!/bin/bash
# Runs as user "nobody" ([verifier] user): reads /app, writes only /logs/verifier.
cd /app
if PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
