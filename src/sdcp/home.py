"""Where sdcp keeps its state on a host: fetched models, the local cluster (`$SDCP_HOME`)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["sdcp_home"]


def sdcp_home() -> Path:
    """`$SDCP_HOME`, or `~/.cache/sdcp` when unset."""
    configured = os.environ.get("SDCP_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "sdcp"
