"""What the command line writes where its output is not a terminal (a pipe, a file, a script):
help as plain paragraphs and tables as plain lines, never wrapped or cut at 80 columns."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Literal

__all__ = ["help_markup_mode", "is_terminal", "plain_table"]


def is_terminal() -> bool:
    return sys.stdout.isatty()


def help_markup_mode() -> Literal["rich"] | None:
    """Typer's help: rich panels in a terminal; elsewhere click's plain help, whose paragraphs are
    filled whole and whose option texts are never cut."""
    return "rich" if is_terminal() else None


def plain_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Rows under their column names, each column as wide as its widest cell, two spaces apart: one
    line per row however long (a URI is copied whole)."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (columns, *rows)
    ]
    return "\n".join(lines)
