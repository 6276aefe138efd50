#!/bin/bash
set -euo pipefail
printf 'step one\n' > /app/notes.txt
printf 'step two\n' >> /app/notes.txt
