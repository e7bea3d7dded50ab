"""How the roles log: a level, and plain lines or one JSON object per line (for log collectors)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

__all__ = ["LOG_LEVELS", "configure_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")
_TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JSONFormatter(logging.Formatter):
    """One JSON object a record: time (UTC, ISO 8601), level, logger, message, and the exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str = "info", *, json_lines: bool = False) -> None:
    """Log to stderr at ``level`` (one of LOG_LEVELS), as text lines or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if json_lines else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
