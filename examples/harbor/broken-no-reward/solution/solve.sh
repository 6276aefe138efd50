#!/bin/bash
set -euo pipefail
echo done > /app/out.txt
