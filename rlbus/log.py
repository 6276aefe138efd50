"""structlog set-up, done once per process.

Guarantees: JSON lines when stderr is not a TTY, pretty console output on a TTY;
`run_id`, `role` and (per message) `msg_id` come from contextvars, so every event
carries them without being passed around. Event names are dotted (`rollout.batch`).
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.contextvars import bind_contextvars, bound_contextvars  # noqa: F401  (re-exported)

_configured = False


def configure_logging(role: str, run_id: str | None = None, level: str = "INFO", json_logs: bool | None = None) -> None:
    """Configure structlog for this process and bind role/run_id."""
    global _configured
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    if not _configured:
        renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    bind_contextvars(role=role, **({"run_id": run_id} if run_id else {}))
