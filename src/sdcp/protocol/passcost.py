"""What a verifier's pass costs by its rows, and what speculation is worth against it (issue 38:
speculate only where the measured curve and the acceptance say it pays).

The verifier measures its curve (sdcp.engines.verifier.observe.PassCurves) and decides from it how
many tokens a session's pass scores after its own row: a self-decoding pass's guess, a drafter's
next proposal (SDCP 6.5.1 m_cap). It reports the curve and the sessions sharing its passes in its
status (extension members), and the router ranks a drafter against the verifier decoding alone with
the same functions (sdcp.protocol.router), so that neither speculates where the other would not.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from sdcp.protocol.drafter import expected_tokens

__all__ = [
    "FIRST_CURVE_MS",
    "PASS_ROWS",
    "PassCurve",
    "drafted_rate",
    "self_decoded_rate",
    "speculation_length",
]

# What a pass of SmolLM2 cost on this 2-core CPU by its rows (llama.cpp, Q4_1, 2 threads; issue 38,
# docs/performance.md): the start of PassCurve, which measures the curve on this machine before the
# verifier serves and keeps current from its passes (PassCurves: the short-context curve's level, the
# longer contexts' points). A second row costs about half a one-row pass.
PASS_ROWS = (1, 2, 4, 8, 16, 32)
FIRST_CURVE_MS = (9.3, 14.2, 21.0, 36.0, 67.0, 130.0)
_COST_WEIGHT = 0.2
# The least a pass is taken to cost (ms): a rate is never a division by zero.
_LEAST_MS = 1e-3


@dataclass
class PassCurve:
    """What a pass costs (ms) by the rows it scores, whoever's they are: measured at ``rows``
    (ascending, default PASS_ROWS), linear between them and past the last. A pass's rows, not its
    sessions, set its cost on both backends (a packed sequence costs its rows,
    sdcp.models.hf.ragged; llama.cpp a row each)."""

    points_ms: list[float] = field(default_factory=lambda: list(FIRST_CURVE_MS))
    rows: tuple[int, ...] = PASS_ROWS

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.points_ms) != len(self.rows) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a pass curve needs two or more ascending row counts, one cost each; got {self.rows}")
        if self.rows[0] < 1:
            raise ValueError(f"a pass holds at least one row, got {self.rows[0]}")

    def ms(self, rows: int) -> float:
        """The cost of a pass of ``rows`` rows."""
        rows = max(1, rows)
        points = self.rows
        for index in range(1, len(points)):
            if rows <= points[index]:
                low, high = points[index - 1], points[index]
                share = (rows - low) / (high - low)
                return self.points_ms[index - 1] + share * (self.points_ms[index] - self.points_ms[index - 1])
        slope = (self.points_ms[-1] - self.points_ms[-2]) / (points[-1] - points[-2])
        return self.points_ms[-1] + slope * (rows - points[-1])

    def never_falls(self) -> bool:
        """Whether a pass of more rows never costs less (measured points can fall, by noise)."""
        points = self.points_ms
        return all(low <= high for low, high in itertools.pairwise(points))

    def measured(self, rows: int, seconds: float) -> None:
        """A probe's pass of exactly ``rows`` (one of the curve's): that point is the measurement."""
        self.points_ms[self.rows.index(rows)] = 1000 * seconds

    def record(self, seconds: float, rows: int) -> None:
        """A served pass of ``rows`` rows: the nearest measured point moves towards what it implies,
        in proportion, so that the curve keeps its shape between the points."""
        if rows < 1 or seconds <= 0:
            return
        nearest = min(range(len(self.rows)), key=lambda index: abs(math.log(rows / self.rows[index])))
        implied = 1000 * seconds * self.points_ms[nearest] / self.ms(rows)
        self.points_ms[nearest] += _COST_WEIGHT * (implied - self.points_ms[nearest])

    def follow_level(self, seconds: float, rows: int) -> None:
        """A served pass of ``rows`` rows: every point moves towards what it implies, in
        proportion, so that the curve keeps the shape it was measured with and follows the load.
        Where passes are served at the context the shape was measured at, a pass that took longer
        says the machine got busier, not that rows of its size got dearer: each point learning
        only from passes of its own size left points learned at other loads beside each other, a
        16-row point at its idle figure beside an 8-row point learned at 4 busy streams, and rows
        past 8 looked nearly free (docs/performance.md, session 31)."""
        if rows < 1 or seconds <= 0:
            return
        factor = 1 + _COST_WEIGHT * (1000 * seconds / self.ms(rows) - 1)
        self.points_ms = [point * factor for point in self.points_ms]

    def rows_share(self, sessions: int) -> int:
        """The most rows each of ``sessions`` sessions may add to a pass after its own: its share of
        what the largest measured pass holds beyond one row a session. Past it the curve is only
        extrapolated: at 16 sessions, each scoring 16 tokens it accepted in full, passes of 272
        rows took 2.3 s where the extrapolation said 1.1 and 16 rows took 90 ms (docs/performance.md,
        session 26)."""
        sessions = max(1, sessions)
        return max(0, self.rows[-1] - sessions) // sessions


def speculation_length(
    acceptance: float, sessions: int, most: int, curve: PassCurve | None = None, *, apart: bool = False
) -> int:
    """How many tokens, up to ``most`` and the session's share of rows (PassCurve.rows_share), a
    session's pass is worth scoring after its own row: the guess of a self-decoding pass
    (``acceptance``: the per-token share of the lookahead's predicted tokens that were right), or a
    drafter's proposal (SDCP 6.5.1 m_cap; ``acceptance``: the session's per-token acceptance).

    The j-th token is used with a chance of about ``acceptance ** j``, and then saves the session a
    pass, of which its share is the pass's cost over its ``sessions`` (a row each); scoring k of
    them costs what k more rows add to that pass on the measured ``curve``. The length is the one
    that saves the most, zero included: where a second row costs half a one-row pass (llama.cpp on
    2 cores), a lone session scores a guess only above a 53 % hit rate, one among 16 only above 94 %.
    ``apart``: where other sessions share the pass, the target runs a session's rows after its first
    as a pass of their own (llama.cpp with a cache per sequence runs a call in ubatches of
    sequences feeding as many tokens each, docs/models.md), so k of them cost a pass of k rows: at
    16 sessions a guess then never pays (a 17-row pass took 86-103 ms against 74 for 16).
    """
    curve = curve if curve is not None else PassCurve()
    sessions = max(1, sessions)
    most = min(most, curve.rows_share(sessions))
    base_ms = curve.ms(sessions)
    share_ms = base_ms / sessions
    # The walk stops where no longer length can gain more: rows never get cheaper on a curve that
    # does not fall, and what the tokens past this one could save is at most a geometric tail. The
    # verifier asks this at every delivery of a run, where the whole walk was a tenth of the loop's
    # work for the run's tokens.
    bounded = 0 <= acceptance < 1 and curve.never_falls()
    best, best_gain, saved = 0, 0.0, 0.0
    for length in range(1, most + 1):
        used = acceptance**length
        saved += used * share_ms
        rows_ms = _rows_ms(curve, sessions, length, apart)
        gain = saved - rows_ms
        if gain > best_gain:
            best, best_gain = length, gain
        if bounded and saved + share_ms * used * acceptance / (1 - acceptance) - rows_ms <= best_gain:
            break
    return best


def self_decoded_rate(sessions: int, curve: PassCurve) -> float:
    """Tokens per second of the verifier's time that a session decoded alone commits, one a pass:
    the pass's cost shared among the ``sessions`` in it."""
    sessions = max(1, sessions)
    return 1000 * sessions / max(_LEAST_MS, curve.ms(sessions))


def drafted_rate(
    acceptance: float,
    sessions: int,
    m_limit: int,
    curve: PassCurve,
    draft_ms: float = 0.0,
    *,
    apart: bool = False,
) -> float:
    """Tokens per second of the verifier's time that a drafted session commits at its best
    proposal length (1 to ``m_limit``, within its share of rows): expected_tokens(acceptance, M)
    (SDCP 6.2) a round, against its share of the pass plus what its M rows add to it, plus
    ``draft_ms`` a drafted token (a drafter beside the verifier takes the same cores). On the scale
    of `self_decoded_rate`, so that a drafter is chosen only where its proposals save the verifier
    more than their rows cost it, as `speculation_length` judges them. 0 where the session has no
    share of rows (PassCurve.rows_share): the verifier scores no proposal's row after the first
    there, and a drafter is only for a session the verifier may not decode alone. ``apart``: the M
    rows cost a pass of M rows where other sessions share the pass (as in `speculation_length`)."""
    sessions = max(1, sessions)
    longest = min(m_limit, curve.rows_share(sessions))
    if longest < 1:
        return 0.0
    base_ms = curve.ms(sessions)
    share_ms = base_ms / sessions
    return max(
        1000
        * expected_tokens(acceptance, m)
        / max(_LEAST_MS, share_ms + _rows_ms(curve, sessions, m, apart) + m * draft_ms)
        for m in range(1, longest + 1)
    )


def _rows_ms(curve: PassCurve, sessions: int, rows: int, apart: bool) -> float:
    """What ``rows`` rows after a session's first add to a pass of ``sessions`` sessions: a pass of
    their own where the target runs them apart and other sessions share the pass, else the curve's
    step from ``sessions`` rows."""
    if apart and sessions > 1:
        return curve.ms(rows)
    return curve.ms(sessions + rows) - curve.ms(sessions)
