"""The verifier's session state machine (SDCP 6.3, 6.5.2 self_decode, 6.6, 6.7, 6.8).

The verifier is the sole commit authority. A round goes through three steps, and the service
around this module does the I/O between them:

1. ``begin_round(proposal, peer)`` runs the checks of SDCP 6.3 in order (authorization, fencing,
   idempotency, base and round, limits) and answers ``Replay`` (a verdict already exists),
   ``Wait`` (an identical request is being verified) or a ``RoundTicket`` to verify.
2. ``decide(ticket, logits, q_rows, load)`` applies the acceptance rule and speculation control and
   returns a ``PendingCommit``: the commit record to append and the verdict to release after it.
   Nothing in the session changes yet.
3. ``apply(pending)`` after the commit-log append succeeded makes the tokens committed and the
   verdict recorded, in one step; ``stop_serving()`` when the append was fenced; ``abandon(ticket)``
   when the round could not be verified (no output, no state change).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from sdcp.protocol.constraint import DeadEnd, TokenConstraint
from sdcp.protocol.control import SpeculationControl
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.logprobs import token_logprobs
from sdcp.protocol.messages import (
    LOAD_MAX,
    Action,
    Assignment,
    Contract,
    Event,
    Output,
    Policy,
    Proposal,
    Resume,
    Sampling,
    SessionState,
    TokenLogprob,
    Verdict,
)
from sdcp.protocol.problems import BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import CommitRecord
from sdcp.protocol.rules import (
    PURPOSE_EXTRA_TOKEN,
    GreedyRule,
    RandomSource,
    SecureRandom,
    SeededRandom,
    get_rule,
)
from sdcp.protocol.sampling import draw_token, target_distribution
from sdcp.protocol.shaping import TargetLogits

__all__ = [
    "PendingCommit",
    "Replay",
    "RoundTicket",
    "ServingState",
    "SessionStats",
    "VerifierSession",
    "Wait",
]


class ServingState(enum.IntEnum):
    """The session-state ``state`` member: the action the session is in (docs/interpretations.md)."""

    ACTIVE = Action.CONTINUE
    SELF_DECODING = Action.SELF_DECODE
    FINISHED = Action.FINISH
    FAILED = Action.FAIL


class Replay(NamedTuple):
    """A verdict for this round exists: it is returned unchanged (SDCP 6.3 Idempotency)."""

    verdict: Verdict


class Wait(NamedTuple):
    """An identical request for this round is being verified: wait for its verdict."""

    round: int


@dataclass(frozen=True)
class RoundTicket:
    """A round admitted for verification. ``proposal`` is None for a self-decoded round and for the
    round that ends a cancelled session (``cancels``)."""

    round: int
    proposal: Proposal | None
    sampling: Sampling | None
    rng: RandomSource
    cancels: bool = False


@dataclass(frozen=True)
class PendingCommit:
    """What a decided round will commit, once the commit-log append succeeded."""

    ticket: RoundTicket
    record: CommitRecord
    verdict: Verdict
    event: Event | None
    control: SpeculationControl = field(repr=False)
    # One per emitted token when the session-open asked for log-probabilities.
    logprobs: tuple[TokenLogprob, ...] = ()


def _identity(proposal: Proposal) -> tuple[object, ...]:
    # The status member is a load report that may change between retries of the same proposal;
    # everything that decides the round is compared (docs/interpretations.md).
    return (
        proposal.session,
        proposal.epoch,
        proposal.round,
        proposal.drafter,
        proposal.base,
        proposal.base_digest,
        proposal.tokens,
        proposal.q_rows,
        proposal.draft_kv,
    )


@dataclass
class SessionStats:
    """What a session's rounds did so far: for status lines, metrics and benchmarks."""

    rounds: int = 0
    self_decoded: int = 0
    # The target passes whose rows the self-decoded rounds took: fewer than the rounds where a pass
    # scored a guess that was right (the engine counts them, `self_decoding_passes`).
    self_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    escalations: int = 0
    escalated: dict[str, int] = field(default_factory=dict)
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)

    def record(self, pending: PendingCommit) -> None:
        proposal = pending.ticket.proposal
        if proposal is None:
            self.self_decoded += 1
            return
        self.rounds += 1
        proposed = len(proposal.tokens)
        accepted = pending.verdict.accepted
        self.proposed += proposed
        self.accepted += accepted
        action = pending.verdict.action
        if action not in (Action.CONTINUE, Action.FINISH):
            self.escalations += 1
            self.escalated[action.name.lower()] = self.escalated.get(action.name.lower(), 0) + 1
        grow = proposed - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for position in range(proposed):
            self.proposed_by_position[position] += 1
            if position < accepted:
                self.accepted_by_position[position] += 1

    def self_decoding_passes(self, passes: int) -> None:
        self.self_passes += passes

    def to_obj(self) -> dict[str, object]:
        return {
            "rounds": self.rounds,
            "self_decoded": self.self_decoded,
            "self_passes": self.self_passes,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "escalations": self.escalations,
            "escalated": dict(self.escalated),
            "accepted_by_position": list(self.accepted_by_position),
            "proposed_by_position": list(self.proposed_by_position),
        }


class VerifierSession:
    """One session at the verifier: committed prefix, digest chain, verdicts, control."""

    def __init__(
        self,
        *,
        session: bytes,
        epoch: int,
        contract: Contract,
        prompt: Sequence[int],
        resume: Resume | None = None,
        committed_tokens: Sequence[int] = (),
        m_init: int | None = None,
        logprobs: int | None = None,
        min_new: int = 0,
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.rule = get_rule(contract.rule)
        # Extensions of session-open (docs/interpretations.md): None asks for no log-probabilities.
        self.top_logprobs = logprobs
        self.min_new = min_new
        self.token_logprobs: list[TokenLogprob] = []
        self.session = session
        self.epoch = epoch
        self.contract = contract
        self.prompt = tuple(prompt)
        # The logits every rule and self-decoding compute p from: min_new, the output's language
        # (structured output) and the sampling profile's penalties and logit_bias.
        self.target_logits = TargetLogits(
            prompt=self.prompt, stop=contract.stop, min_new=min_new, constraint=constraint
        )
        self.tokens: list[int] = []
        self.digest = prefix_digest(contract.digest, self.prompt)
        self.round = 0
        self.drafter: str | None = None
        self.control = SpeculationControl(contract, m_init if m_init is not None else contract.m_max)
        self._verdicts: dict[int, Verdict] = {}
        self._in_flight: RoundTicket | None = None
        # Rounds decided after the one in flight, each committed by `apply` in turn.
        self._queued: deque[RoundTicket] = deque()
        self._policies: list[Policy] = []
        self.fenced = False
        self.stats = SessionStats()
        if resume is not None:
            self._resume(resume, committed_tokens)
        if self._reached_max_new():
            self.control.finish()

    def _resume(self, resume: Resume, committed_tokens: Sequence[int]) -> None:
        # SDCP 6.9: the new verifier continues from the last commit record the router read; the
        # committed tokens must reproduce its length and digest.
        tokens = tuple(committed_tokens)
        if len(tokens) != resume.committed:
            raise BadMessage(f"resume says {resume.committed} committed tokens, the object holds {len(tokens)}")
        digest = extend_digest(self.digest, tokens)
        if digest != resume.digest:
            raise BadMessage("resume digest does not match the committed tokens")
        # The constraint's state and the penalties' counts follow the committed output: a new
        # verifier resumes them there.
        try:
            self.target_logits.commit(tokens)
        except ValueError as exc:
            raise BadMessage(f"the committed tokens are outside the constraint's language: {exc}") from exc
        self.tokens = list(tokens)
        # Tokens committed before the failover were decided elsewhere: their log-probabilities are unknown here.
        self.token_logprobs = [TokenLogprob() for _ in tokens]
        self.digest = digest
        self.round = resume.round
        if tokens and tokens[-1] in self.contract.stop:
            self.control.finish()

    # -- state ---------------------------------------------------------------------------------

    @property
    def committed(self) -> int:
        return len(self.tokens)

    @property
    def constraint(self) -> TokenConstraint | None:
        """The output's language, part of the target distribution (structured output)."""
        return self.target_logits.constraint

    @property
    def serving_state(self) -> ServingState:
        if self.control.ended is not None:
            return ServingState.FAILED if self.control.ended == Action.FAIL else ServingState.FINISHED
        return ServingState.SELF_DECODING if self.control.self_decoding else ServingState.ACTIVE

    @property
    def ended(self) -> bool:
        return self.control.ended is not None

    @property
    def self_decoding(self) -> bool:
        return self.control.self_decoding and not self.fenced

    @property
    def verifying(self) -> bool:
        return self._in_flight is not None

    def state(self) -> SessionState:
        return SessionState(
            session=self.session,
            epoch=self.epoch,
            round=self.round,
            committed=self.committed,
            digest=self.digest,
            state=int(self.serving_state),
        )

    def sampling_for(self, round_number: int) -> Sampling | None:
        """SDCP 6.6: the latest policy whose from_round <= round applies; else the contract's."""
        applicable = [p for p in self._policies if p.from_round <= round_number]
        return applicable[-1].sampling if applicable else self.contract.sampling

    # -- router-facing operations --------------------------------------------------------------

    def assign(self, assignment: Assignment) -> None:
        """PUT sessions/{id}/drafter: the latest assignment names the only drafter allowed."""
        self._require_serving(assignment.epoch)
        if assignment.contract.digest != self.contract.digest:
            raise ProtocolError(ProblemType.BAD_CONTRACT, "the assignment carries another contract")
        self._require_open()
        if self._in_flight is not None:
            # The round in flight carries the speculation state it started from; an assignment now
            # would be overwritten when it commits. The router tries again.
            raise ProtocolError(ProblemType.STALE_BASE, "a round is being committed", state=self.state())
        if self.control.self_decoding:
            # The period ends with an event that asks for a drafter (SDCP 6.5.2); state 3 says so.
            raise ProtocolError(ProblemType.STALE_BASE, "the verifier decodes the session itself", state=self.state())
        self.drafter = assignment.drafter
        self.control.assign_drafter(assignment.m_init)

    def apply_policy(self, policy: Policy) -> None:
        """SDCP 6.6: a new sampling profile for rounds from ``from_round`` on."""
        self._require_serving(self.epoch)
        self._require_open()
        if policy.from_round <= self.round:
            raise ProtocolError(
                ProblemType.STALE_BASE,
                f"from_round {policy.from_round} is not after the current round {self.round}",
                state=self.state(),
            )
        self._policies.append(policy)
        self._policies.sort(key=lambda p: p.from_round)

    def self_decode_instead(self, epoch: int, verifier_load: int) -> None:
        """The router found no drafter expected to beat the verifier alone: a self-decoding period
        starts now, ending as any other (SDCP 6.5.2) with an event that asks for a drafter again.
        The drafter named last stops on its next proposal (sdcp-stale-base with state 3)."""
        self._require_serving(epoch)
        self._require_open()
        if self._in_flight is not None and not self.control.self_decoding:
            raise ProtocolError(ProblemType.STALE_BASE, "a round is being committed", state=self.state())
        self.control.start_self_decode(verifier_load)

    def stop_serving(self) -> None:
        """SDCP 6.3: the commit-log append was fenced; discard the round, stop serving the session."""
        self.fenced = True
        self._in_flight = None
        self._queued.clear()

    # -- rounds --------------------------------------------------------------------------------

    def begin_round(self, proposal: Proposal, peer: str | None) -> Replay | Wait | RoundTicket:
        """Admit a proposal for verification, in the order of checks of SDCP 6.3."""
        # SDCP 6.3 Authorization: only the drafter named in the latest assignment.
        if self.drafter is None or peer != self.drafter or proposal.drafter != self.drafter:
            raise ProtocolError(ProblemType.NOT_ASSIGNED, f"{peer or 'the client'} is not the assigned drafter")
        self._require_serving(proposal.epoch)
        # SDCP 6.3 Idempotency: an existing verdict is returned unchanged; an identical request in
        # flight is waited for.
        existing = self._verdicts.get(proposal.round)
        if existing is not None:
            return Replay(existing)
        in_flight = self._in_flight
        if (
            in_flight is not None
            and in_flight.proposal is not None
            and in_flight.round == proposal.round
            and _identity(in_flight.proposal) == _identity(proposal)
        ):
            return Wait(proposal.round)
        self._require_open()
        if in_flight is not None or self.control.self_decoding:
            raise ProtocolError(
                ProblemType.STALE_BASE, "another round of this session is being committed", state=self.state()
            )
        # SDCP 6.3 Base check.
        if proposal.base != self.committed or proposal.base_digest != self.digest:
            raise ProtocolError(
                ProblemType.STALE_BASE,
                f"proposal extends {proposal.base} tokens; {self.committed} are committed",
                state=self.state(),
            )
        if proposal.round != self.round + 1:
            raise ProtocolError(
                ProblemType.STALE_BASE,
                f"proposal is for round {proposal.round}; the next round is {self.round + 1}",
                state=self.state(),
            )
        self.control.check_length(len(proposal.tokens))
        if self.rule.needs_q and proposal.q_rows is None:
            raise ProtocolError(ProblemType.BAD_PROPOSAL, "the acceptance rule needs q_rows")
        ticket = self._ticket(proposal.round, proposal)
        self._in_flight = ticket
        return ticket

    def begin_self_decode(self) -> RoundTicket:
        """A self-decoded round: one token from the target, a round of its own (SDCP 6.5.2)."""
        self._require_serving(self.epoch)
        self._require_open()
        if not self.control.self_decoding or self._in_flight is not None:
            raise ValueError("self-decoding is not in progress or a round is already in flight")
        ticket = self._ticket(self.round + 1, None)
        self._in_flight = ticket
        return ticket

    def interrupt_self_decode(self) -> Event:
        """Self-decoding cannot go on (a failed pass): the period ends as at self_max, and the event
        asks the router for a drafter again (SDCP 6.5.2)."""
        in_flight = self._in_flight
        if in_flight is not None and in_flight.proposal is None and not in_flight.cancels:
            # Its own round only: a cancel's round, begun while the period's last pass was on its
            # way, must still commit (its release checks that it is the round in flight).
            self._in_flight = None
            self._queued.clear()
        self.control.self_decoding = False
        return Event(
            session=self.session, epoch=self.epoch, kind=Action.SWITCH, committed=self.committed, digest=self.digest
        )

    def cancel(self, epoch: int) -> PendingCommit:
        """End the session at the request of its front end (extension, docs/interpretations.md):
        a round that commits nothing and ends the session with fail, so that the commit log records
        the end and the router, told by the event, never resumes it. No round may be in flight."""
        self._require_serving(epoch)
        self._require_open()
        if self._in_flight is not None:
            raise ValueError(f"round {self._in_flight.round} is in flight")
        ticket = self._ticket(self.round + 1, None, cancels=True)
        self._in_flight = ticket
        control = copy.copy(self.control)
        control.self_decoding = False
        action, m_cap = control.fail()
        return self._pending(ticket, control, (), 0, action, m_cap, 0)

    def abandon(self, ticket: RoundTicket) -> None:
        """The round could not be verified (e.g. sdcp-q-unavailable): nothing is committed."""
        if self._in_flight is ticket:
            self._in_flight = None
            self._queued.clear()

    def decide(
        self,
        ticket: RoundTicket,
        logits: np.ndarray,
        q_rows: np.ndarray | None,
        verifier_load: int,
        *,
        worth: int | None = None,
    ) -> PendingCommit:
        """Apply the acceptance rule (SDCP 6.3 Acceptance, 6.4) and speculation control (6.5);
        ``worth``: the longest next proposal the verifier's pass costs make worth scoring."""
        proposal = self._require_ticket(ticket)
        if proposal is None:
            raise ValueError("a self-decoded round is decided by decide_self_decoded")
        tokens = proposal.tokens
        try:
            rows = self._target_rows(logits, ticket.sampling, tokens)
        except DeadEnd:
            return self._dead_end(ticket, verifier_load)
        # SDCP 6.3: a rule that needs draft rows checks every one (rules.check_draft_rows) before it
        # draws its first random value.
        acceptance = self.rule.accept(rows, q_rows, tokens, ticket.rng)
        proposed_emitted = (*tokens[: acceptance.accepted], acceptance.extra_token)
        control = copy.copy(self.control)
        emitted, finished = self._truncate(proposed_emitted)
        if finished:
            action, m_cap = control.finish()
        else:
            action, m_cap = control.after_round(acceptance.accepted, len(tokens), verifier_load, worth)
        pending = self._pending(ticket, control, emitted, acceptance.accepted, action, m_cap, verifier_load)
        return self._with_logprobs(pending, logits)

    def decide_self_decoded(
        self, rows: np.ndarray | Sequence[np.ndarray], fed: Sequence[int], verifier_load: int
    ) -> list[PendingCommit]:
        """Several self-decoded rounds at once, each token still a round of its own (SDCP 6.5.2):
        ``rows[0]`` is the target's row after the committed tokens and ``rows[i + 1]`` the row after
        ``fed[i]``, as a pass scores a guess and a greedy run feeds its tokens after it (an array of
        rows, or rows one by one: a run's are not copied into one array). The rounds
        stop after the first whose token is not the one fed after it (the rows after it follow
        another token), after a round that ends the period or the session, or at the last row.
        Nothing is committed until `apply` takes each of them, in order; `abandon` of the first
        drops them all."""
        first = self.begin_self_decode()
        try:
            return self._decide_self_decoded(first, rows, fed, verifier_load)
        except BaseException:
            self.abandon(first)
            raise

    def _decide_self_decoded(
        self, first: RoundTicket, rows: np.ndarray | Sequence[np.ndarray], fed: Sequence[int], verifier_load: int
    ) -> list[PendingCommit]:
        raw_rows = rows.reshape(-1, rows.shape[-1]) if isinstance(rows, np.ndarray) else rows
        # The rounds after the first are shaped after the tokens decided before them.
        shaping = self.target_logits.fork() if len(raw_rows) > 1 else self.target_logits
        control, committed, digest = self.control, self.committed, self.digest
        decided: list[PendingCommit] = []
        ticket = first
        for index, raw in enumerate(raw_rows):
            pending = self._self_decoded_round(ticket, raw[None], shaping, control, verifier_load, committed, digest)
            decided.append(pending)
            emitted = pending.record.emitted
            goes_on = pending.verdict.action == Action.SELF_DECODE and index < len(fed) and emitted == (fed[index],)
            if not goes_on or index == len(raw_rows) - 1:
                break
            shaping.commit(emitted)
            control, committed, digest = pending.control, pending.record.committed, pending.record.digest
            ticket = self._ticket(ticket.round + 1, None)
        self._queued = deque(pending.ticket for pending in decided[1:])
        return decided

    def _self_decoded_round(
        self,
        ticket: RoundTicket,
        raw: np.ndarray,
        shaping: TargetLogits,
        control_before: SpeculationControl,
        verifier_load: int,
        committed: int,
        digest: bytes,
    ) -> PendingCommit:
        """The round ``ticket`` that self-decodes one token from ``raw`` (its one row): argmax under
        rule 1, a draw from p under rule 2, after the state ``shaping``, ``control_before``,
        ``committed`` and ``digest``."""
        try:
            row = shaping.rows(raw, (), ticket.sampling)[0]
        except DeadEnd:
            return self._dead_end(ticket, verifier_load, control_before, committed, digest)
        if isinstance(self.rule, GreedyRule):
            token = int(row.argmax())
        else:
            p = target_distribution(row, ticket.sampling)
            # The self-decoded token is the additional token at position 1 of its round.
            token = draw_token(p, ticket.rng.uniform(1, PURPOSE_EXTRA_TOKEN))
        control = copy.copy(control_before)
        emitted, finished = self._truncate((token,), committed)
        if finished:
            action, m_cap = control.finish()
        else:
            action, m_cap = control.after_self_decode_token(verifier_load), control.m_cap
        pending = self._pending(ticket, control, emitted, 0, action, m_cap, verifier_load, committed, digest)
        return self._with_logprobs(pending, raw)

    def _dead_end(
        self,
        ticket: RoundTicket,
        verifier_load: int,
        control_before: SpeculationControl | None = None,
        committed: int | None = None,
        digest: bytes | None = None,
    ) -> PendingCommit:
        """The constraint allows no token where the round decides one (a language that no output
        continues from here: docs/interpretations.md): the round commits nothing and ends the
        session with fail, as a cancel does, rather than leave it to fail again at every round."""
        control = copy.copy(control_before if control_before is not None else self.control)
        control.self_decoding = False
        action, m_cap = control.fail()
        return self._pending(ticket, control, (), 0, action, m_cap, verifier_load, committed, digest)

    def apply(self, pending: PendingCommit) -> Verdict:
        """The commit record is durable: commit the tokens and record the verdict together."""
        self._require_ticket(pending.ticket)
        # Every emitted token was drawn from rows the constraint restricted: it is allowed.
        self.target_logits.commit(pending.record.emitted)
        self.tokens.extend(pending.record.emitted)
        self.token_logprobs.extend(pending.logprobs)
        self.digest = pending.record.digest
        self.round = pending.record.round
        self.control = pending.control
        self._verdicts[pending.record.round] = pending.verdict
        # The next of the rounds decided together (decide_self_decoded), if any, is in flight now.
        self._in_flight = self._queued.popleft() if self._queued else None
        self.stats.record(pending)
        return pending.verdict

    # -- output --------------------------------------------------------------------------------

    def has_output(self, start: int) -> bool:
        """Whether ``output(start)`` answers now with tokens, the final output or an error (cheaper
        than asking it: a reader of many sessions checks each at every commit of one)."""
        return self.fenced or self.ended or len(self.tokens) > start

    def output(self, start: int) -> Output:
        """SDCP 6.7: tokens committed at output indices ``start`` and later, with the epoch."""
        self._require_serving(self.epoch)
        tokens = tuple(self.tokens[start:])
        final = self.ended and start + len(tokens) >= self.committed
        return Output(
            session=self.session,
            epoch=self.epoch,
            from_=start,
            tokens=tokens,
            final=final,
            finish=self.control.ended if final else None,
            logprobs=tuple(self.token_logprobs[start:]) if self.top_logprobs is not None else None,
        )

    # -- internals -----------------------------------------------------------------------------

    def _ticket(self, round_number: int, proposal: Proposal | None, *, cancels: bool = False) -> RoundTicket:
        sampling = self.sampling_for(round_number)
        rng: RandomSource
        if sampling is not None and sampling.seed is not None:
            rng = SeededRandom(sampling.seed, self.session, round_number)
        else:
            rng = SecureRandom()
        return RoundTicket(round_number, proposal, sampling, rng, cancels)

    def _target_rows(self, logits: np.ndarray, sampling: Sampling | None, proposed: tuple[int, ...]) -> np.ndarray:
        logits = self.target_logits.rows(logits, proposed, sampling)
        if isinstance(self.rule, GreedyRule):
            # argmax p equals argmax of the shaped logits under every sampling profile (temperature
            # is monotone; min-p, top-k and top-p keep the most probable token), so rule 1 skips the softmax.
            return np.asarray(logits)
        return target_distribution(logits, sampling)

    def _with_logprobs(self, pending: PendingCommit, logits: np.ndarray) -> PendingCommit:
        if self.top_logprobs is None:
            return pending
        emitted = pending.record.emitted
        return dataclasses.replace(pending, logprobs=token_logprobs(logits, emitted, self.top_logprobs))

    def _truncate(self, emitted: tuple[int, ...], committed: int | None = None) -> tuple[tuple[int, ...], bool]:
        # SDCP 6.3 Acceptance: truncate after the first stop token and at max_new.
        room = self.contract.max_new - (self.committed if committed is None else committed)
        stop = self.contract.stop
        for index, token in enumerate(emitted):
            if token in stop:
                emitted = emitted[: index + 1]
                return emitted[:room], True
        return emitted[:room], len(emitted) >= room

    def _reached_max_new(self) -> bool:
        return self.committed >= self.contract.max_new and not self.ended

    def _pending(
        self,
        ticket: RoundTicket,
        control: SpeculationControl,
        emitted: tuple[int, ...],
        accepted: int,
        action: Action,
        m_cap: int,
        verifier_load: int,
        committed_before: int | None = None,
        digest_before: bytes | None = None,
    ) -> PendingCommit:
        """The round after ``committed_before`` tokens of digest ``digest_before`` (the session's own
        where not given)."""
        committed = (self.committed if committed_before is None else committed_before) + len(emitted)
        digest = extend_digest(self.digest if digest_before is None else digest_before, emitted)
        record = CommitRecord(self.epoch, ticket.round, emitted, committed, digest)
        # Every member is the session's own state or was decided from it just now; the load is
        # the caller's, the one member the verdict is not built unjudged without checking.
        if not 0 <= verifier_load <= LOAD_MAX:
            raise ValueError(f"a verifier's load is a percentage, not {verifier_load}")
        verdict = Verdict.computed(
            session=self.session,
            epoch=self.epoch,
            round=ticket.round,
            accepted=accepted,
            emitted=emitted,
            committed=committed,
            digest=digest,
            action=action,
            m_cap=m_cap,
            low=control.low,
            load=verifier_load,
        )
        event = None
        if action in (Action.SWITCH, Action.FINISH, Action.FAIL):
            event = Event.computed(
                session=self.session, epoch=self.epoch, kind=action, committed=committed, digest=digest
            )
        return PendingCommit(ticket, record, verdict, event, control)

    def _require_ticket(self, ticket: RoundTicket) -> Proposal | None:
        if self._in_flight is not ticket:
            raise ValueError(f"round {ticket.round} is not the round in flight")
        return ticket.proposal

    def _require_serving(self, epoch: int) -> None:
        # SDCP 6.3 Fencing; a fenced session has a newer epoch elsewhere (SDCP 6.9).
        if epoch != self.epoch:
            raise ProtocolError(ProblemType.STALE_EPOCH, f"epoch {epoch} is not the session epoch {self.epoch}")
        if self.fenced:
            raise ProtocolError(ProblemType.STALE_EPOCH, f"epoch {self.epoch} was fenced by a newer epoch")

    def _require_open(self) -> None:
        if self.control.ended is not None:
            raise ProtocolError(ProblemType.SESSION_CLOSED, f"session ended with {self.control.ended.name.lower()}")
