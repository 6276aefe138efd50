#!/bin/bash
f=/app/notes.txt
if [ -f "$f" ] && [ "$(cat "$f")" = "$(printf 'step one\nstep two')" ] && [ "$(wc -l < "$f")" -eq 2 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
