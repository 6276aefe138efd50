#!/bin/bash
set -euo pipefail
printf 'Hello, Harbor!\n' > /app/hello.txt
