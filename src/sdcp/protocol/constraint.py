"""A session's constraint in its target distribution (extension of session-open, docs/interpretations.md,
"Structured output").

A constraint names a language; the verifier holds it as a ``TokenConstraint``, which says which tokens
may follow the committed output and any tokens after it (a grammar matcher, ``sdcp.grammar``). The
target distribution at a position is then SDCP 4.1's p computed from logits in which every token the
constraint disallows there is -inf: the target restricted to the allowed tokens and renormalised,
before temperature, top-k and top-p. Rule 1 takes the most probable allowed token, rule 2 accepts and
draws from the restricted p, so both stay exact whatever a drafter proposes: a disallowed proposed
token has p = 0 and is rejected at its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["DeadEnd", "TokenConstraint", "constrain_rows"]


class DeadEnd(ValueError):
    """The constraint allows no token at a position: no output of its language continues the
    tokens before it (docs/interpretations.md: the session then ends with fail)."""


class TokenConstraint(Protocol):
    """Which tokens may come next, after the session's committed output."""

    def allowed(self, tokens: Sequence[int]) -> np.ndarray:
        """Boolean rows (n + 1, V): row j holds the tokens allowed after the committed output and
        ``tokens[:j]``, where n is how many leading ``tokens`` are allowed (the rows after a
        disallowed token are not defined). Stop tokens are allowed exactly where the output is
        complete. The committed state is left as it was."""
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """Extend the committed output by ``tokens``, each allowed in turn (ValueError otherwise)."""
        ...

    def forced(self, after: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens that the constraint forces after the committed output and
        ``after``: what a drafter or the verifier's lookahead proposes at full confidence."""
        ...

    def fork(self) -> TokenConstraint:
        """An independent copy at the same committed output."""
        ...


def constrain_rows(
    logits: np.ndarray, allowed: np.ndarray, first_index: int, min_new: int, stop: Sequence[int]
) -> np.ndarray:
    """``logits`` (rows for output indices ``first_index``, ``first_index + 1``, ...) with the tokens
    that ``allowed`` leaves out at -inf, in its first rows (later rows are left as they are: they
    follow a disallowed proposed token, and no rule reads them). Before output index ``min_new`` the
    stop tokens are left out too, unless they are all the constraint allows: the output must be in
    the language, so a complete one ends (docs/interpretations.md). The caller's array is never changed."""
    rows = np.array(logits, dtype=np.float64)
    view = rows.reshape(-1, rows.shape[-1])
    masks = np.asarray(allowed, dtype=bool)
    stops = [token for token in stop if token < view.shape[-1]]
    for index, mask in enumerate(masks[: view.shape[0]]):
        if not mask.any():
            # A language whose every continuation is cut off has no distribution to draw from: that
            # is the constraint's fault, never something to decide a token by.
            raise DeadEnd(f"the constraint allows no token at output index {first_index + index}")
        keep = mask
        if first_index + index < min_new and stops:
            without_stops = mask.copy()
            without_stops[stops] = False
            if without_stops.any():
                keep = without_stops
        view[index, ~keep] = -np.inf
    return rows
