"""Speculation limit and escalation ladder of one session (SDCP 6.5).

The verifier owns one ``SpeculationControl`` per session for the whole session, across drafter
switches and self-decoding periods, because the ladder position j must persist across both
(SDCP 6.5.2). Choices the draft leaves open (documented in docs/interpretations.md):

- m_cap ceiling by load: up to ``HIGH_LOAD_PERCENT`` the ceiling is m_max; above it, half of
  m_max (at least 1). m_cap above the ceiling is lowered at once; below it, m_cap grows by one per
  round that is not low.
- Self-decoded rounds carry no proposal, so they are neither low nor not low: c and g keep their
  values. Counting them as "not low" would reset j after R self-decoded tokens and loop the ladder.
- The end of a self-decoding period yields ``Action.SWITCH`` (the kind of the event that asks the
  router to assign a drafter again).
"""

from __future__ import annotations

from typing import NamedTuple

from sdcp.protocol.messages import Action, Contract
from sdcp.protocol.problems import ProblemType, ProtocolError

__all__ = [
    "HIGH_LOAD_PERCENT",
    "ControlDecision",
    "SelfDecodeNotPermitted",
    "SpeculationControl",
    "is_low_round",
    "m_cap_ceiling",
]

HIGH_LOAD_PERCENT = 80
_PERCENT = 100


class SelfDecodeNotPermitted(ProtocolError):
    """The contract or the verifier's load does not permit self-decoding now (SDCP 6.5.2)."""

    def __init__(self, detail: str) -> None:
        super().__init__(None, detail, status=409)


class ControlDecision(NamedTuple):
    """What a verdict carries from speculation control: the action and next round's m_cap."""

    action: Action
    m_cap: int


def is_low_round(accepted: int, proposed: int, low_ratio: int | None) -> bool:
    """SDCP 6.5.2: low if 100 * a < low_ratio * M, or, with low_ratio zero or absent, if a = 0."""
    if proposed < 1 or not 0 <= accepted <= proposed:
        raise ValueError(f"need 0 <= accepted <= proposed and proposed >= 1, got {accepted}/{proposed}")
    if not low_ratio:
        return accepted == 0
    return _PERCENT * accepted < low_ratio * proposed


def m_cap_ceiling(m_max: int, verifier_load: int, worth: int | None = None) -> int:
    """The largest m_cap the verifier grants at ``verifier_load`` percent (SDCP 6.5.1), and never
    above ``worth``, the longest proposal its pass costs make worth scoring now, where known (at
    least 1 is granted)."""
    if not 0 <= verifier_load <= _PERCENT:
        raise ValueError(f"verifier load is a percentage, got {verifier_load}")
    ceiling = max(1, m_max // 2) if verifier_load > HIGH_LOAD_PERCENT else m_max
    return ceiling if worth is None else min(ceiling, max(1, worth))


class SpeculationControl:
    """Counters c, g, j and the speculation limit m_cap of one session (SDCP 6.5)."""

    def __init__(self, contract: Contract, m_init: int) -> None:
        # Contract validation already guarantees m_max >= 1, low_rounds >= 1 and a non-empty
        # fallback list of ladder actions (SDCP 4.1, 6.5.2).
        self._contract = contract
        self.consecutive_low = 0  # c
        self.consecutive_good = 0  # g
        self.ladder_position = 0  # j
        self.m_cap = self._clamp(m_init)
        self.self_decoded = 0
        self.self_decoding = False
        self.ended: Action | None = None

    def __copy__(self) -> SpeculationControl:
        # Each round decides on a copy of the counters: copy's generic reduce path was a fifth of
        # deciding a self-decoded round.
        copied = SpeculationControl.__new__(SpeculationControl)
        copied.__dict__.update(self.__dict__)
        return copied

    @property
    def low(self) -> int:
        """The verdict's ``low`` member: the number of consecutive low rounds (c)."""
        return self.consecutive_low

    def check_length(self, proposed: int) -> None:
        """SDCP 6.2: 1 <= M <= min(m_max, m_cap); otherwise the proposal gets sdcp-limit."""
        self._require_open()
        limit = min(self._contract.m_max, self.m_cap)
        if not 1 <= proposed <= limit:
            raise ProtocolError(
                ProblemType.LIMIT, f"proposal of {proposed} tokens; allowed 1..{limit} (m_cap {self.m_cap})"
            )

    def assign_drafter(self, m_init: int) -> None:
        """A new assignment: its m_init becomes m_cap; c, g and j carry on (SDCP 6.5.2)."""
        self._require_open()
        self.self_decoding = False
        self.m_cap = self._clamp(m_init)

    def start_self_decode(self, verifier_load: int) -> None:
        """A self-decoding period the router asked for instead of a drafter (docs/interpretations.md,
        "Self-decoding at the router's request"): permitted as for the ladder's self_decode entry
        (SDCP 6.5.2); c, g and j keep their values, since no round was low or good."""
        self._require_open()
        if not self._self_decode_permitted(verifier_load):
            raise SelfDecodeNotPermitted(
                f"self-decoding needs self_load in the contract and a load of at most it (load {verifier_load})"
            )
        if not self.self_decoding:
            self.self_decoding = True
            self.self_decoded = 0

    def after_round(
        self, accepted: int, proposed: int, verifier_load: int, worth: int | None = None
    ) -> ControlDecision:
        """Update the counters after a verified round and return its action and next m_cap;
        ``worth``: the longest proposal the verifier's pass costs make worth scoring now, if known
        (at least 1 is granted)."""
        self._require_open()
        if self.self_decoding:
            raise ValueError("a proposal round during a self-decoding period")
        # SDCP 6.5.1: the verifier lowers m_cap when its own load makes long proposals costly.
        ceiling = m_cap_ceiling(self._contract.m_max, verifier_load, worth)
        if is_low_round(accepted, proposed, self._contract.low_ratio):
            self.consecutive_low += 1
            self.consecutive_good = 0
        else:
            self.consecutive_low = 0
            self.consecutive_good += 1
            if self.consecutive_good >= self._contract.low_rounds:
                self.ladder_position = 0
            # SDCP 6.5.1: m_cap is restored gradually, one per round that is not low.
            self.m_cap += 1
        self.m_cap = min(self.m_cap, ceiling)
        action = Action.CONTINUE
        if self.consecutive_low >= self._contract.low_rounds:
            action = self._escalate(verifier_load)
            self.consecutive_low = 0
        return ControlDecision(action, self.m_cap)

    def after_self_decode_token(self, verifier_load: int) -> Action:
        """Count one self-decoded token (a round without a proposal); say whether to go on.

        SDCP 6.5.2: self-decoding stops after self_max tokens (if present) or when the load
        exceeds self_load; it then yields ``Action.SWITCH`` so that a drafter is assigned again.
        """
        self._require_open()
        if not self.self_decoding:
            raise ValueError("no self-decoding period is in progress")
        self.self_decoded += 1
        self_max = self._contract.self_max
        if (self_max is not None and self.self_decoded >= self_max) or not self._self_decode_permitted(verifier_load):
            self.self_decoding = False
            return Action.SWITCH
        return Action.SELF_DECODE

    def self_decode_room(self) -> int | None:
        """Tokens the current self-decoding period may still commit by self_max (SDCP 6.5.2); None
        where the contract sets no self_max (the load alone may end the period)."""
        self_max = self._contract.self_max
        return None if self_max is None else max(0, self_max - self.self_decoded)

    def finish(self) -> ControlDecision:
        """Generation ended on a stop token or max_new (SDCP 6.3): the session is over."""
        return self._end(Action.FINISH)

    def fail(self) -> ControlDecision:
        """The verifier ends the session with an error."""
        return self._end(Action.FAIL)

    def _escalate(self, verifier_load: int) -> Action:
        # SDCP 6.5.2: apply entry j, skipping entries that are not permitted, advancing j past every
        # entry applied or skipped; with no entry left, apply "fail".
        # An unknown fallback value reads as fail (SDCP 5.2).
        ladder = self._contract.ladder
        while self.ladder_position < len(ladder):
            entry = ladder[self.ladder_position]
            self.ladder_position += 1
            if entry == Action.SELF_DECODE and not self._self_decode_permitted(verifier_load):
                continue
            return self._apply(entry)
        return self._apply(Action.FAIL)

    def _apply(self, entry: Action) -> Action:
        if entry == Action.REDUCE:
            self.m_cap = max(1, self.m_cap // 2)
        elif entry == Action.SELF_DECODE:
            self.self_decoding = True
            self.self_decoded = 0
        elif entry == Action.FAIL:
            self.ended = Action.FAIL
        return entry

    def _self_decode_permitted(self, verifier_load: int) -> bool:
        # SDCP 6.5.2: only if the contract has self_load and the load does not exceed it.
        # A self_max of 0 allows no self-decoded token: the entry is skipped like a forbidden one.
        self_load = self._contract.self_load
        return self_load is not None and verifier_load <= self_load and self._contract.self_max != 0

    def _end(self, action: Action) -> ControlDecision:
        self._require_open()
        self.ended = action
        self.self_decoding = False
        return ControlDecision(action, self.m_cap)

    def _clamp(self, m_cap: int) -> int:
        # SDCP 6.5.1: 1 <= m_cap <= m_max.
        return max(1, min(m_cap, self._contract.m_max))

    def _require_open(self) -> None:
        if self.ended is not None:
            raise ProtocolError(ProblemType.SESSION_CLOSED, f"session ended with {self.ended.name.lower()}")
