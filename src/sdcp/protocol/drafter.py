"""Drafter-side session state and the choice of M (SDCP 6.2), sans-IO.

A ``DrafterSession`` follows one assignment: it builds proposals on the committed prefix it last
learned, keeps at most one outstanding, applies verdicts and resynchronises on sdcp-stale-base.
The drafting itself (model, KV cache, cache artifacts) lives in the services and models packages.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from sdcp.protocol.messages import (
    Action,
    Assignment,
    Constraint,
    Contract,
    Proposal,
    Sampling,
    SessionState,
    Status,
    Verdict,
)
from sdcp.protocol.problems import BadMessage, ProblemType, ProtocolError
from sdcp.protocol.rules import get_rule

__all__ = [
    "CONSTRAINED",
    "PLAIN",
    "SESSION_CLASSES",
    "AcceptanceEstimate",
    "DrafterSession",
    "ProposalNotAllowed",
    "choose_m",
    "expected_rate",
    "expected_tokens",
    "session_class",
]

_MILLI = 1000
# Actions after which this drafter stops proposing for the session: switch and self_decode hand
# the session to another party (SDCP 6.5.2), finish and fail end it.
_STOPPING_ACTIONS = frozenset({Action.SWITCH, Action.SELF_DECODE, Action.FINISH, Action.FAIL})
# Problems after which this drafter can no longer serve the session.
_STOPPING_PROBLEMS = frozenset({ProblemType.STALE_EPOCH, ProblemType.NOT_ASSIGNED, ProblemType.SESSION_CLOSED})


# Classes of sessions whose acceptance a drafter measures, and the router weighs, apart (the
# estimate of SDCP 6.2 is local): a constrained session (structured output, session-open's
# `constraint`) is drafted far better by a drafter that proposes what its grammar forces, and far
# worse by one that does not, than the drafter's other sessions; one average would misjudge both.
PLAIN, CONSTRAINED = "plain", "constrained"
SESSION_CLASSES = (PLAIN, CONSTRAINED)


def session_class(constraint: Constraint | None) -> str:
    """The class of a session whose output language is ``constraint`` (None: any text)."""
    return PLAIN if constraint is None else CONSTRAINED


class ProposalNotAllowed(RuntimeError):
    """The session does not allow a proposal now: one is outstanding, or the drafter stopped."""


def expected_tokens(alpha: float, m: int) -> float:
    """Expected tokens committed by a round of M proposed tokens: sum of alpha^k, k = 0..M.

    This equals (1 - alpha^(M+1)) / (1 - alpha), and M + 1 at alpha = 1 [LEVIATHAN], without the
    cancellation that formula suffers as alpha approaches 1.
    """
    return float(sum(alpha**k for k in range(m + 1)))


def expected_rate(alpha: float, t_d: float, t_v: float, m_limit: int) -> tuple[int, float]:
    """The M in 1..m_limit maximising expected tokens per unit time, and that rate (SDCP 6.2,
    RECOMMENDED rule).

    ``t_d`` is the time to draft one token (artifacts included), ``t_v`` the expected verification
    time, in any one unit; the rate is in tokens per that unit. Ties go to the smaller M, which
    wastes less drafting.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if t_d < 0 or t_v < 0 or t_d + t_v <= 0:
        raise ValueError(f"times must be non-negative and not both zero, got t_d={t_d} t_v={t_v}")
    if m_limit < 1:
        raise ValueError(f"m_limit must be at least 1, got {m_limit}")
    best_m, best_rate = 1, -1.0
    for m in range(1, m_limit + 1):
        rate = expected_tokens(alpha, m) / (m * t_d + t_v)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m, best_rate


def choose_m(alpha: float, t_d: float, t_v: float, m_limit: int) -> int:
    """The M of ``expected_rate``: what a drafter proposes next."""
    return expected_rate(alpha, t_d, t_v, m_limit)[0]


@dataclass
class AcceptanceEstimate:
    """Exponentially weighted acceptance statistics of one session.

    ``alpha`` estimates the per-token acceptance probability of the cost model: each verdict is
    a accepted tokens and, when a < M, one rejection; alpha is the weighted share of acceptances
    among those trials (the maximum-likelihood estimate for the truncated geometric outcome,
    which a / M underestimates). ``accept_milli`` is the status report's EWMA of a / M x 1000
    (SDCP 5.2). ``weight`` is the share of the newest verdict in both averages.
    """

    weight: float = 0.25
    prior_alpha: float = 0.5
    _accepted: float = field(init=False)
    _trials: float = field(init=False)
    _ratio: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must lie in (0, 1], got {self.weight}")
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must lie in [0, 1], got {self.prior_alpha}")
        # The prior counts as one trial, so the first verdicts move alpha quickly.
        self._accepted = self.prior_alpha
        self._trials = 1.0

    def update(self, accepted: int, proposed: int) -> None:
        if proposed < 1 or not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed and proposed >= 1, got {accepted}/{proposed}")
        trials = accepted + (1 if accepted < proposed else 0)
        keep = 1.0 - self.weight
        self._accepted = keep * self._accepted + self.weight * accepted
        self._trials = keep * self._trials + self.weight * trials
        ratio = accepted / proposed
        self._ratio = ratio if self._ratio is None else keep * self._ratio + self.weight * ratio

    @property
    def alpha(self) -> float:
        return min(1.0, self._accepted / self._trials)

    @property
    def accept_milli(self) -> int | None:
        """EWMA of a / M in thousandths, or None before the first verdict."""
        return None if self._ratio is None else round(self._ratio * _MILLI)


class DrafterSession:
    """The drafter's view of one assigned session (SDCP 6.2, 6.3, 6.9)."""

    def __init__(self, assignment: Assignment, estimate: AcceptanceEstimate | None = None) -> None:
        self.contract: Contract = assignment.contract
        self._needs_q = get_rule(self.contract.rule).needs_q
        self.session = assignment.session
        self.epoch = assignment.epoch
        self.drafter = assignment.drafter
        self.verifier = assignment.verifier
        self.sampling: Sampling | None = (
            assignment.sampling if assignment.sampling is not None else self.contract.sampling
        )
        self.round = assignment.round
        self.committed = assignment.committed
        self.digest = assignment.digest
        # The round and committed length last told by the verifier (or the router), which bound
        # the rounds decided since then: each round commits at least one token.
        self._known = (assignment.round, assignment.committed)
        # SDCP 6.2: m_init limits M before the first verdict.
        self.m_cap = self._clamp(assignment.m_init)
        self.estimate = estimate if estimate is not None else AcceptanceEstimate()
        self.outstanding: Proposal | None = None
        self.stopped_by: Action | ProblemType | None = None

    @property
    def m_limit(self) -> int:
        """SDCP 6.2: the largest M allowed in the next proposal, min(m_max, m_cap)."""
        return min(self.contract.m_max, self.m_cap)

    @property
    def may_propose(self) -> bool:
        return self.stopped_by is None and self.outstanding is None

    def choose_m(self, t_d: float, t_v: float) -> int:
        """The cost-model choice of M for the next proposal at the current acceptance estimate."""
        return choose_m(self.estimate.alpha, t_d, t_v, self.m_limit)

    def m_after_full_acceptance(self, t_d: float, t_v: float) -> int:
        """How many tokens a pre-draft made while the outstanding proposal is verified needs.

        SDCP 6.2 lets the next proposal be prepared assuming full acceptance. The M chosen after
        that verdict is at least as large as the current choice, since acceptance can only rise, so
        a pre-draft as long as the current proposal would hold every later proposal at that length.
        The verdict's m_cap is not known yet; m_max bounds it.
        """
        proposal = self.outstanding
        if proposal is None:
            raise ProposalNotAllowed("no proposal is outstanding")
        estimate = copy.copy(self.estimate)
        estimate.update(len(proposal.tokens), len(proposal.tokens))
        return choose_m(estimate.alpha, t_d, t_v, self.contract.m_max)

    def propose(
        self,
        tokens: tuple[int, ...],
        *,
        status: Status,
        q_rows: str | None = None,
        draft_kv: str | None = None,
    ) -> Proposal:
        """Build the next proposal on the committed prefix last learned and mark it outstanding."""
        if self.stopped_by is not None:
            raise ProposalNotAllowed(f"the drafter stopped proposing ({self.stopped_by.name.lower()})")
        if self.outstanding is not None:
            # SDCP 6.2: at most one outstanding proposal per session.
            raise ProposalNotAllowed(f"the proposal for round {self.outstanding.round} is outstanding")
        if not 1 <= len(tokens) <= self.m_limit:
            raise ProtocolError(ProblemType.LIMIT, f"{len(tokens)} tokens; allowed 1..{self.m_limit}")
        if self._needs_q and q_rows is None:
            # SDCP 6.4: a proposal under rule 2 carries q_rows.
            raise ProtocolError(ProblemType.BAD_PROPOSAL, f"rule {self.contract.rule} needs q_rows")
        self.outstanding = Proposal(
            session=self.session,
            epoch=self.epoch,
            round=self.round + 1,
            drafter=self.drafter,
            base=self.committed,
            base_digest=self.digest,
            tokens=tuple(tokens),
            q_rows=q_rows,
            draft_kv=draft_kv,
            status=status,
        )
        return self.outstanding

    def apply_verdict(self, verdict: Verdict) -> Action:
        """Take in the verdict of the outstanding proposal; return its action."""
        proposal = self.outstanding
        if proposal is None:
            raise BadMessage("a verdict arrived while no proposal was outstanding")
        if (verdict.session, verdict.epoch, verdict.round) != (proposal.session, proposal.epoch, proposal.round):
            raise BadMessage(
                f"verdict for round {verdict.round} (epoch {verdict.epoch}) does not answer the proposal "
                f"for round {proposal.round} (epoch {proposal.epoch})"
            )
        if verdict.accepted > len(proposal.tokens):
            raise BadMessage(f"verdict accepts {verdict.accepted} of {len(proposal.tokens)} tokens")
        if verdict.committed != proposal.base + len(verdict.emitted):
            raise BadMessage(
                f"verdict commits {verdict.committed} tokens; base {proposal.base} plus "
                f"{len(verdict.emitted)} emitted differs"
            )
        self.estimate.update(verdict.accepted, len(proposal.tokens))
        self.round = verdict.round
        self.committed = verdict.committed
        self._known = (verdict.round, verdict.committed)
        self.digest = verdict.digest
        self.m_cap = self._clamp(verdict.m_cap)
        self.outstanding = None
        if verdict.action in _STOPPING_ACTIONS:
            # SDCP 6.5.2: on switch the current drafter MUST stop proposing for the session.
            self.stopped_by = verdict.action
        return verdict.action

    def resync(self, state: SessionState) -> None:
        """Adopt the verifier's session-state (from sdcp-stale-base) as the committed prefix."""
        if state.session != self.session:
            raise BadMessage("session-state names another session")
        if state.epoch != self.epoch:
            # The session moved to another epoch: this assignment is void (SDCP 6.9).
            self.stopped_by = ProblemType.STALE_EPOCH
            self.outstanding = None
            return
        self.round = state.round
        self.committed = state.committed
        self.digest = state.digest
        self._known = (state.round, state.committed)
        self.outstanding = None

    def learn_prefix(self, committed: int, digest: bytes) -> None:
        """Adopt a longer committed prefix read from the output, after sdcp-stale-base without a
        session-state (docs/interpretations.md). The round stays: a round the verifier decided
        since is answered with its verdict (SDCP 6.3 Idempotency), from which the drafter resyncs."""
        if committed < self.committed:
            raise BadMessage(f"the output holds {committed} tokens, fewer than the {self.committed} committed")
        self.committed, self.digest, self.outstanding = committed, digest, None

    def try_later_round(self) -> bool:
        """After sdcp-stale-base without a session-state on the current prefix, move to the next
        round number, which rounds without a verdict to replay (self-decoded ones) make necessary.
        False once the round would pass the latest the verifier can have reached."""
        known_round, known_committed = self._known
        self.outstanding = None
        if self.round >= known_round + (self.committed - known_committed):
            return False
        self.round += 1
        return True

    def on_problem(self, error: ProtocolError) -> None:
        """React to a problem answering the outstanding proposal (SDCP 6.3 Table 2)."""
        if error.problem is ProblemType.STALE_BASE and error.state is not None:
            self.resync(error.state)
        elif error.problem in _STOPPING_PROBLEMS:
            self.stopped_by = error.problem
            self.outstanding = None
        else:
            # The round committed nothing (q unavailable, limit, bad proposal, malformed): the
            # drafter may build a fresh proposal for the same round.
            self.outstanding = None

    def _clamp(self, m_cap: int) -> int:
        # SDCP 6.5.1: 1 <= m_cap <= m_max; a verdict outside that range is read at its bound.
        return max(1, min(m_cap, self.contract.m_max))
