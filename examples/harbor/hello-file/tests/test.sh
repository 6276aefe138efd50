#!/bin/bash
# Reward 1 when /app/hello.txt is exactly "Hello, Harbor!\n", else 0.
f=/app/hello.txt
reward=0
if [ -f "$f" ] && [ "$(wc -c < "$f")" -eq 15 ] && [ "$(cat "$f")" = "Hello, Harbor!" ] \
   && [ "$(tail -c 1 "$f" | od -An -c | tr -d ' ')" = '\n' ]; then
  reward=1
else
  echo "hello.txt is missing or its content is not exactly 'Hello, Harbor!' plus newline" >&2
fi
echo "$reward" > /logs/verifier/reward.txt
