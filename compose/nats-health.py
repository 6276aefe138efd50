#!/usr/bin/env python3
"""Container healthcheck of nats-server: JetStream enabled and healthy (monitoring port 8222)."""

import os
import sys
import urllib.request

port = os.environ.get("NATS_MONITOR_PORT", "8222")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz?js-enabled-only=true", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
    print(f"nats unhealthy: {exc}", file=sys.stderr)
    sys.exit(1)
