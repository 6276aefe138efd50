#!/bin/bash
set -euo pipefail
cat > /app/calc/ops.py <<'PY'
"""Arithmetic operations."""


def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b


def div(a, b):
    return a / b
PY
