"""Opening the disk tier's database while another process opens it (a local cluster's roles start
together on one MLC directory)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sdcp.cache.disk import _use_wal


def test_the_switch_to_wal_waits_until_another_process_lets_go_of_the_database(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN")
    holder.execute("SELECT * FROM t").fetchall()  # a read under way: the switch cannot have the file
    opener = sqlite3.connect(path, isolation_level=None, timeout=0.01)
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        holder.execute("COMMIT")

    _use_wal(opener, pause=pause)
    assert len(pauses) == 1
    assert opener.execute("PRAGMA journal_mode").fetchone() == ("wal",)
