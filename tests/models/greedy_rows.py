"""Rows of greedy decoding one token per pass, and their comparison bit for bit: what the prefix
caches' tests check on either backend (a cached prefix must change no row)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sdcp.models.backend import Target


def greedy_rows(target: Target, session: bytes, prompt: Sequence[int], steps: int) -> list[np.ndarray]:
    """Open ``session`` on ``prompt`` and decode ``steps`` greedy tokens, one per pass: every row."""
    target.open_session(session, prompt)
    rows = []
    try:
        for _ in range(steps):
            (row,) = target.score([(session, ())])
            rows.append(row[0].copy())
            target.commit(session, 0, [int(np.argmax(row[0]))])
    finally:
        target.close_session(session)
    return rows


def assert_same(warm: list[np.ndarray], cold: list[np.ndarray]) -> None:
    assert len(warm) == len(cold)
    for step, (a, b) in enumerate(zip(warm, cold, strict=True)):
        assert np.array_equal(a, b), f"row {step} differs"
