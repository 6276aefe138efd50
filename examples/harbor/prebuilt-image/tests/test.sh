#!/bin/bash
# The image has no /app and its WORKDIR is /: use absolute paths only, and do not
# cd into /app before knowing it exists.
reward=0
if [ -d /app/out ] && [ -f /app/out/result.txt ] \
   && [ "$(tr -d '[:space:]' < /app/out/result.txt)" = "42" ]; then
  reward=1
else
  echo "/app/out/result.txt is missing or does not hold 42" >&2
fi
echo "$reward" > /logs/verifier/reward.txt
