#!/bin/bash
set -euo pipefail
mkdir -p /app/out
echo 42 > /app/out/result.txt
