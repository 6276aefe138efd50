#!/bin/bash
set -euo pipefail
cat > /app/textutils.py <<'PY'
"""Text helpers."""

import re


def slugify(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
PY
