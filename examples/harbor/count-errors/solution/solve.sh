#!/bin/bash
set -euo pipefail
cat /app/logs/*.log | grep -c 'ERROR' > /app/answer.txt
