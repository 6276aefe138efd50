#!/bin/bash
# Runs /app/sum.sh several ways; reward 1 only if every case passes.
s=/app/sum.sh
fail=0
check() { # expected args...
  local want=$1; shift
  local got
  got=$(cd /tmp && timeout 10 "$s" "$@" 2>/dev/null | tr -d '[:space:]')
  if [ "$got" != "$want" ]; then
    echo "FAIL: sum.sh $* -> '${got}', expected '${want}'" >&2
    fail=1
  fi
}
if [ ! -f "$s" ] || [ ! -x "$s" ]; then
  echo "FAIL: $s is missing or not executable" >&2
  fail=1
else
  check 6 1 2 3
  check 0
  check 7 7
  check -2 -5 3
  check -5 10 -20 5
  check 0 -3 3
  check 1000000 999999 1
fi
if [ "$fail" -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
