"""Router-side policy: instances with TTLs, selection, assignment and failover plans (SDCP 6.1, 6.9).

The router service keeps one ``InstanceRegistry`` and one ``RouterSession`` per session; this
module decides, the service sends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from sdcp.protocol.drafter import CONSTRAINED, PLAIN, expected_rate
from sdcp.protocol.messages import (
    Assignment,
    Constraint,
    Contract,
    Resume,
    Role,
    Sampling,
    SessionOpen,
    Status,
)
from sdcp.protocol.passcost import PassCurve, drafted_rate, self_decoded_rate
from sdcp.protocol.records import FenceRecord, LogReplay

__all__ = [
    "DEFAULT_VERIFY_S",
    "OPEN_MS_PER_PROMPT_TOKEN",
    "REDECIDE_AFTER_S",
    "SWITCH_MARGIN",
    "DecodingChoice",
    "DrafterCosts",
    "InstanceRegistry",
    "open_deadline_s",
    "InstanceView",
    "RouterSession",
    "choose_decoding",
    "choose_for_session",
    "outpaced",
    "proposal_limit",
    "self_decode_seconds",
    "serves",
    "unreported",
    "verify_seconds",
    "verifier_passes",
    "VerifierPasses",
    "drafter_costs",
    "drafter_permitted",
    "measured_acceptance",
    "prefer_cached_prefix",
    "prefer_idle_and_accepting",
]

# What a session-open's deadline grows by per token the verifier prefills (the prompt, and on a
# failover the committed output): a 2,150-token prompt outlasted a fixed 30 s on a loaded 2-core
# machine (issue #37), and a queue of long prompts must degrade to waiting, not to 503s.
OPEN_MS_PER_PROMPT_TOKEN = 25.0


def open_deadline_s(base_s: float, prefill_tokens: int, per_token_ms: float = OPEN_MS_PER_PROMPT_TOKEN) -> float:
    """How long a session-open of ``prefill_tokens`` tokens may take: ``base_s`` plus
    ``per_token_ms`` a token."""
    return base_s + prefill_tokens * per_token_ms / 1000


@dataclass(frozen=True)
class InstanceView:
    """The last status of an instance and when it expires (seconds, the router's clock).

    ``accept_milli`` is the last acceptance (SDCP 5.2 ``accept_milli``) the instance reported, kept
    while later reports of the same instance omit the optional member; ``status`` has its own.
    """

    status: Status
    expires_at: float
    model: bytes | None = None
    accept_milli: int | None = None

    @property
    def uri(self) -> str:
        return self.status.instance


def prefer_idle_and_accepting(candidates: Sequence[InstanceView]) -> InstanceView:
    """Default selection: low load and queue first, then high recent acceptance, then name.

    A queued session costs about as much as ten points of load; acceptance breaks ties between
    equally loaded drafters (SDCP 6.1 leaves the policy local).
    """

    def cost(view: InstanceView) -> tuple[float, str]:
        status = view.status
        acceptance = (status.accept_milli or 0) / 1000
        return (status.load + 10 * status.queue - 5 * acceptance, view.uri)

    return min(candidates, key=cost)


def prefer_cached_prefix(candidates: Sequence[InstanceView], cached: Callable[[InstanceView], int]) -> InstanceView:
    """The verifier holding the longest prefix of the session's prompt (``cached``: its length in
    tokens) among those with room (load under 100), SGLang's cache-aware routing; where none holds
    any, or none with one has room, `prefer_idle_and_accepting`."""
    with_room = [view for view in candidates if view.status.load < 100]
    lengths = {view.uri: cached(view) for view in with_room}
    longest = max(lengths.values(), default=0)
    if longest == 0:
        return prefer_idle_and_accepting(candidates)
    return prefer_idle_and_accepting([view for view in with_room if lengths[view.uri] == longest])


@dataclass(frozen=True)
class DrafterCosts:
    """The SDCP 6.2 terms the router knows of one drafter, in seconds.

    ``alpha`` is None until the drafter has reported an acceptance measurement; ``draft_s`` is None
    for a drafter that reports no drafting time; ``verify_s`` is the time from proposal to verdict
    that the drafter saw, None before its first verdict.
    """

    uri: str
    alpha: float | None
    draft_s: float | None
    verify_s: float | None = None
    queue: int = 0
    load: int = 0


def drafter_costs(view: InstanceView, session_class: str = PLAIN) -> DrafterCosts:
    """A drafter's cost terms from its last status report (extension members, SDCP 5.2), for a
    session of ``session_class`` (``sdcp.protocol.drafter.session_class``)."""
    status = view.status
    return DrafterCosts(
        uri=view.uri,
        alpha=measured_acceptance(view, session_class),
        draft_s=None if status.draft_us is None else status.draft_us / 1e6,
        verify_s=None if status.verify_us is None else status.verify_us / 1e6,
        queue=status.queue,
        load=status.load,
    )


def measured_acceptance(view: InstanceView, session_class: str = PLAIN) -> float | None:
    """A drafter's per-token acceptance alpha (SDCP 6.2) on sessions of ``session_class``, or None
    while it is unmeasured there.

    A drafter that reports our cost terms is measured by ``alpha_milli`` alone on sessions without
    a constraint, and by ``alpha_constrained_milli`` on constrained ones, each sent once it has
    taken in enough verdicts of that class: a drafter measured on one class only is explored on
    the other. One that reports none of them (a drafter written from the draft) is measured by the
    draft's own status member ``accept_milli`` (SDCP 5.2: the EWMA of a/M, over every session), the
    last one it reported: a/M does not exceed the per-token probability in expectation, so the rate
    it gives is a lower bound (docs/interpretations.md, "Drafters and verifiers without our private
    members").
    """
    status = view.status
    measured = status.alpha_constrained_milli if session_class == CONSTRAINED else status.alpha_milli
    if measured is not None:
        return measured / 1000
    if (
        status.draft_us is not None
        or status.verify_us is not None
        or status.alpha_milli is not None
        or status.alpha_constrained_milli is not None
    ):
        return None  # one of ours: its measurement on this class is on the way
    accept_milli = status.accept_milli if status.accept_milli is not None else view.accept_milli
    return None if accept_milli is None else accept_milli / 1000


@dataclass(frozen=True)
class DecodingChoice:
    """Who drafts for a session next: a drafter, or nobody (``drafter`` None), in which case the
    verifier decodes the session itself. ``rate`` is the expected tokens per second of the session,
    or of the verifier's time where it reports its pass costs (`drafter_rate`); an exploring choice
    is a drafter whose acceptance is not measured yet, and its rate the bound at alpha = 1."""

    drafter: str | None
    rate: float
    exploring: bool = False


@dataclass(frozen=True)
class VerifierPasses:
    """What a verifier reports its passes cost (Status ``pass_us``) and how many sessions share
    them (``pass_sessions``): with them a drafter and the verifier decoding alone are ranked by
    tokens per second of the verifier's time (sdcp.protocol.passcost), as the verifier judges
    proposals, instead of by one session's round trips."""

    curve: PassCurve
    sessions: int
    # Status ``pass_apart``: a session's rows after its first cost a pass of their own where other
    # sessions share the pass (passcost.speculation_length).
    apart: bool = False


def verifier_passes(verifier: InstanceView | None) -> VerifierPasses | None:
    """The pass costs a verifier reports, None where it reports none usable (another
    implementation; points not ascending in rows, not starting at one row, or of no cost). A
    cost below an earlier point's is read as that one's: a pass never costs less for more rows,
    and measurements on a busy host are noisy."""
    if verifier is None:
        return None
    status = verifier.status
    points = status.pass_us
    if not points or status.pass_sessions is None or points[0].rows != 1 or any(point.us <= 0 for point in points):
        return None
    costs_ms, highest = [], 0.0
    for point in points:
        highest = max(highest, point.us / 1000)
        costs_ms.append(highest)
    try:
        curve = PassCurve(costs_ms, tuple(point.rows for point in points))
    except ValueError:
        return None
    return VerifierPasses(curve, max(1, status.pass_sessions), apart=bool(status.pass_apart))


def drafter_rate(
    costs: DrafterCosts,
    *,
    verify_s: float,
    m_limit: int,
    alpha: float | None = None,
    passes: VerifierPasses | None = None,
) -> float:
    """Expected tokens per second of a session drafted by ``costs`` (SDCP 6.2 cost model).

    A drafter's time per token grows with the calls queued before its own. Where the verifier
    reports its ``passes``, the rate is per second of the verifier's time: the session's share of
    a pass and what its proposal's rows add to it (passcost.drafted_rate). Otherwise the
    verification time is the one the drafter measured, else the verifier's estimate ``verify_s``.
    """
    draft_s = (costs.draft_s or 0.0) * (1 + costs.queue)
    used_alpha = costs.alpha if alpha is None else alpha
    if used_alpha is None:
        raise ValueError(f"the acceptance of {costs.uri} is not measured")
    if passes is not None:
        return drafted_rate(
            used_alpha, passes.sessions, m_limit, passes.curve, draft_ms=1000 * draft_s, apart=passes.apart
        )
    return expected_rate(used_alpha, draft_s, costs.verify_s or verify_s, m_limit)[1]


def choose_decoding(
    drafters: Sequence[DrafterCosts],
    *,
    self_decode_s: float | None,
    verify_s: float,
    m_limit: int,
    may_explore: Callable[[str], bool] = lambda _uri: True,
    passes: VerifierPasses | None = None,
) -> DecodingChoice | None:
    """The fastest way to decode a session: the drafter with the highest expected rate, or the
    verifier alone (``self_decode_s`` seconds per token; None where self-decoding is not
    available) when no drafter is expected to beat it. Where the verifier reports its ``passes``,
    every rate is per second of the verifier's time (`drafter_rate`), decoding alone included.

    A drafter whose acceptance is unmeasured is explored (``may_explore`` bounds how many sessions
    do so) only if it could beat every measured option at full acceptance; one that cannot, even
    then, is never assigned. Where the verifier cannot decode alone, some drafter is always chosen.
    None means that no drafter is live and the verifier cannot decode alone.
    """
    self_rate = 1.0 / self_decode_s if self_decode_s is not None and self_decode_s > 0 else None
    if self_rate is not None and passes is not None:
        self_rate = self_decoded_rate(passes.sessions, passes.curve)
    measured = [
        DecodingChoice(d.uri, drafter_rate(d, verify_s=verify_s, m_limit=m_limit, passes=passes))
        for d in drafters
        if d.alpha is not None
    ]
    unmeasured = [
        DecodingChoice(
            d.uri, drafter_rate(d, verify_s=verify_s, m_limit=m_limit, alpha=1.0, passes=passes), exploring=True
        )
        for d in drafters
        if d.alpha is None
    ]
    # SDCP 6.1: of equal rates, the drafter with the shorter queue, then the lower load.
    busy = {d.uri: (d.queue, d.load) for d in drafters}

    def fastest(choices: Sequence[DecodingChoice]) -> DecodingChoice | None:
        # max keeps the first of equal rates: the least busy, then the smallest URI, whatever the
        # order of reports.
        ordered = sorted(choices, key=lambda c: (busy.get(c.drafter or "", (0, 0)), c.drafter or ""))
        return max(ordered, key=lambda c: c.rate, default=None)

    best = fastest(measured)
    baseline = max(best.rate if best is not None else 0.0, self_rate or 0.0)
    worth_exploring = [c for c in unmeasured if c.rate > baseline and may_explore(c.drafter or "")]
    if worth_exploring:
        return fastest(worth_exploring)
    if self_rate is not None and (best is None or best.rate <= self_rate):
        return DecodingChoice(None, self_rate)
    if best is not None:
        return best
    # Nothing measured and no self-decoding: a drafter must serve, the most promising one.
    return fastest(unmeasured)


def drafter_permitted(contract: Contract, model: bytes | None) -> bool:
    """SDCP 4.1: an absent drafters list permits any drafter local policy allows."""
    if contract.drafters is None:
        return True
    return model is not None and model in contract.drafters


# A session is moved off its drafter only for an option expected to be this much faster, and at
# most once per this many seconds, so that estimates that differ by noise do not make it flap.
SWITCH_MARGIN = 1.25
REDECIDE_AFTER_S = 2.0
# A verification round at a verifier that reports no timing of its own.
DEFAULT_VERIFY_S = 0.05


def serves(view: InstanceView, contract: Contract) -> bool:
    """Whether a verifier runs the contract's target (SDCP 6.1); one that reports no tokenizer
    digest is judged by its target digest alone."""
    status = view.status
    return status.model == contract.target and status.tokenizer in (None, contract.tokenizer)


def unreported(views: Sequence[InstanceView]) -> list[InstanceView]:
    """Instances whose status lacks our private `model` member (another implementation's): the
    contract's digests cannot be matched here, so they are asked, and refuse with
    sdcp-bad-contract what they do not serve (SDCP 6.1); tried only when no reporting one fits."""
    return [view for view in views if view.status.model is None]


def verify_seconds(verifier: InstanceView | None) -> float:
    """What a verification round costs at this verifier, for drafters that have not timed one: its
    time per self-decoded token, one pass."""
    if verifier is None or not verifier.status.self_us:
        return DEFAULT_VERIFY_S  # none reported, or a zero that no pass can take
    return verifier.status.self_us / 1e6


def self_decode_seconds(contract: Contract, verifier: InstanceView | None) -> float | None:
    """Seconds per token of the verifier decoding alone, where the contract permits that now
    (SDCP 6.5.2: self_load present and not exceeded) and the verifier reports its time."""
    if verifier is None or verifier.status.self_us is None or contract.self_load is None:
        return None
    if contract.self_max == 0 or verifier.status.load > contract.self_load:
        return None
    return verifier.status.self_us / 1e6


def proposal_limit(contract: Contract, m_init: int) -> int:
    """The proposal length the cost model assumes for a session: the router's m_init, within the
    contract's m_max."""
    return max(1, min(contract.m_max, m_init))


def choose_for_session(
    contract: Contract,
    session_class: str,
    drafters: Sequence[InstanceView],
    verifier: InstanceView | None,
    *,
    m_init: int,
    avoid: Sequence[str] = (),
    self_decode: bool = True,
    may_explore: Callable[[str], bool] = lambda _uri: True,
) -> DecodingChoice | None:
    """The expected fastest option for a session among the live ``drafters`` the contract permits
    (those in ``avoid`` only when no other is) and, where permitted (``self_decode``), its
    verifier alone. A drafter is measured, and explored, per class of session: its acceptance on
    constrained sessions is not its average (a guided drafter proposes what the grammar forces)."""
    permitted = [view for view in drafters if drafter_permitted(contract, view.model)] or unreported(drafters)
    pool = [view for view in permitted if view.uri not in avoid] or permitted
    return choose_decoding(
        [drafter_costs(view, session_class) for view in pool],
        self_decode_s=self_decode_seconds(contract, verifier) if self_decode else None,
        verify_s=verify_seconds(verifier),
        m_limit=proposal_limit(contract, m_init),
        may_explore=may_explore,
        passes=verifier_passes(verifier),
    )


def outpaced(
    current: DrafterCosts, best: DecodingChoice, verifier: InstanceView | None, *, contract: Contract, m_init: int
) -> bool:
    """Whether ``best`` is expected to be SWITCH_MARGIN times faster than the measured drafter a
    session has (``current``)."""
    rate = drafter_rate(
        current,
        verify_s=verify_seconds(verifier),
        m_limit=proposal_limit(contract, m_init),
        passes=verifier_passes(verifier),
    )
    return best.rate > SWITCH_MARGIN * rate


class InstanceRegistry:
    """Status reports of every instance, each valid for its ttl_ms (SDCP 6.1)."""

    def __init__(self) -> None:
        self._instances: dict[str, InstanceView] = {}

    def report(self, status: Status, now: float, model: bytes | None = None) -> None:
        accept_milli = status.accept_milli
        previous = self._instances.get(status.instance)
        if accept_milli is None and previous is not None:
            accept_milli = previous.accept_milli  # the member is optional in every report (SDCP 5.2)
        self._instances[status.instance] = InstanceView(status, now + status.ttl_ms / 1000, model, accept_milli)

    def get(self, uri: str) -> InstanceView | None:
        """The last status of ``uri``, live or not yet expired from the registry."""
        return self._instances.get(uri)

    def is_live(self, uri: str, now: float) -> bool:
        view = self._instances.get(uri)
        return view is not None and view.expires_at > now

    def live(self, role: Role, now: float) -> list[InstanceView]:
        return [v for v in self._instances.values() if v.status.role == role and v.expires_at > now]

    def expire(self, now: float) -> list[InstanceView]:
        """Remove and return the instances whose status has expired."""
        gone = [v for v in self._instances.values() if v.expires_at <= now]
        for view in gone:
            del self._instances[view.uri]
        return gone


@dataclass
class RouterSession:
    """What the router knows of one session: where it runs and what to tell whom."""

    session: bytes
    epoch: int
    contract: Contract
    prompt: tuple[int, ...] | str
    commit_log: str
    verifier: str
    drafter: str | None = None
    sampling: Sampling | None = None
    prompt_kv: str | None = None
    resume: Resume | None = None
    # The front end that opened the session (docs/security.md).
    owner: str | None = None
    # What the front end asked of the output (session-open extensions, docs/interpretations.md).
    logprobs: int | None = None
    min_new: int | None = None
    request: str | None = None
    # The output's language (structured output): part of the target distribution, so it goes with
    # the session to every verifier it is opened at, and to its drafters.
    constraint: Constraint | None = None
    # No speculation: the session is decoded by its verifier alone, wherever it runs.
    self_decode_only: bool | None = None
    # The front end's user (tenant): with the owner, whose history the session's drafts draw on.
    tenant: str | None = None
    # How far apart the front end takes the session's self-decoded rounds at most (in ms).
    self_decode_group_ms: int | None = None

    def open_message(self, *, self_decode: bool = False) -> SessionOpen:
        """session-open for the current verifier; carries ``resume`` after a failover, and
        ``self_decode`` where the router asks the verifier to decode alone from the start."""
        return SessionOpen(
            session=self.session,
            epoch=self.epoch,
            contract=self.contract,
            prompt=self.prompt,
            prompt_kv=self.prompt_kv,
            commit_log=self.commit_log,
            resume=self.resume,
            owner=self.owner,
            logprobs=self.logprobs,
            min_new=self.min_new,
            request=self.request,
            constraint=self.constraint,
            self_decode_only=self.self_decode_only,
            tenant=self.tenant,
            self_decode=self_decode or None,
            self_decode_group_ms=self.self_decode_group_ms,
        )

    def assignment(
        self,
        drafter: str,
        *,
        round: int,
        committed: int,
        digest: bytes,
        m_init: int,
        committed_tokens: str | None = None,
    ) -> Assignment:
        """SDCP 6.1: the assignment carries the current round, committed length and digest, and
        the sampling profile if a policy changed it (SDCP 6.6)."""
        return Assignment(
            session=self.session,
            epoch=self.epoch,
            contract=self.contract,
            verifier=self.verifier,
            drafter=drafter,
            prompt=self.prompt,
            round=round,
            sampling=self.sampling,
            committed=committed,
            digest=digest,
            committed_tokens=committed_tokens,
            m_init=m_init,
            owner=self.owner,
            constraint=self.constraint,
            tenant=self.tenant,
        )

    def fence_for_failover(self, verifier: str | None = None) -> FenceRecord:
        """SDCP 6.9: the new epoch is fenced into the commit log before anything else; the fence
        names the verifier that epoch opens at (signed commit records, docs/interpretations.md)."""
        return FenceRecord(self.epoch + 1, verifier)

    def fail_over(
        self, new_verifier: str, replay: LogReplay, committed_tokens: str, target_kv: str | None = None
    ) -> RouterSession:
        """The session at ``new_verifier`` with the next epoch, resuming from the log's last record."""
        resume = Resume(
            round=replay.round,
            committed=len(replay.tokens),
            digest=replay.digest,
            committed_tokens=committed_tokens,
            target_kv=target_kv,
        )
        return replace(self, epoch=self.epoch + 1, verifier=new_verifier, resume=resume)
