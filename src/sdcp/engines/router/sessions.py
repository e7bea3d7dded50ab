"""A session as the router holds it: the plan (``sdcp.protocol.router.RouterSession``), its phase
(``sdcp.protocol.router_life``: every change of phase goes through the table, with the facts that go
with it) and what the router keeps beside it to decide and to replay the commit log; its durable
facts as one CBOR map (``durable``, ``from_durable``), which any router can load from the shared tier
(``store``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from sdcp.protocol.drafter import session_class
from sdcp.protocol.messages import Sampling, SessionOpen, session_path_id
from sdcp.protocol.problems import BadMessage
from sdcp.protocol.records import LogReplayer
from sdcp.protocol.router import RouterSession
from sdcp.protocol.router_life import RouterEvent, RouterPhase, next_phase

__all__ = ["SELF_DECODING", "TrackedSession"]

# The form of the durable facts; a router refuses a form it does not know.
DURABLE_VERSION = 1

# Who served a session, in the router's session description: a drafter's URI, or this for the
# verifier decoding alone at the router's request.
SELF_DECODING = "self-decoding"


@dataclass
class TrackedSession:
    plan: RouterSession
    prompt: tuple[int, ...]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    phase: RouterPhase = RouterPhase.WAITING
    # A drafter whose acceptance was unmeasured when it was assigned to this session.
    exploring: str | None = None
    decided_at: float = 0.0
    served: list[str] = field(default_factory=list)
    opened_at: float = field(default_factory=time.time)
    # The verifier of epoch 1 (opened without a fence): only its signed records count in epoch 1.
    first_verifier: str = ""
    # While MOVING, the verifier the failover's fence named, until the session is open there: a retry
    # goes there again, or spends that epoch (signed commit records, docs/reliability.md).
    failover_to: str | None = None
    # The commit log as far as it has been read, and the committed-token object of its prefix:
    # each read asks only for the records appended since (no whole-log read per assignment).
    replayer: LogReplayer | None = None
    tokens_uri: str | None = None
    # The version of the durable facts in the shared tier this router last read or wrote (its ETag
    # and bytes): a write on another version fails (another router changed the session since).
    etag: str | None = None
    saved: bytes | None = None
    # The router that wrote the facts last read (None: none read, this router opened the session).
    router: str | None = None

    def __post_init__(self) -> None:
        if not self.first_verifier and self.plan.epoch == 1:
            self.first_verifier = self.plan.verifier

    @property
    def ended(self) -> bool:
        return self.phase is RouterPhase.ENDED

    @property
    def self_decoding(self) -> bool:
        return self.phase is RouterPhase.SELF_DECODING

    @property
    def moving(self) -> bool:
        return self.phase is RouterPhase.MOVING

    def advance(self, event: RouterEvent) -> RouterPhase:
        """The session's phase after ``event`` (IllegalTransition where it cannot happen)."""
        self.phase = next_phase(self.phase, event)
        return self.phase

    def assigned(self, drafter: str, *, exploring: bool, now: float) -> None:
        """A drafter took the session's assignment (SDCP 6.1)."""
        if self.advance(RouterEvent.ASSIGNED) is RouterPhase.DRAFTING:
            self.plan.drafter = drafter
            self.exploring = drafter if exploring else None
            self.decided_at = now
            self.serve(drafter)

    def decoding_alone(self, *, now: float | None) -> None:
        """The verifier decodes the session alone: at this router's request (``now``: when it was
        decided), or in a period of its own ladder (None)."""
        if self.advance(RouterEvent.SELF_DECODING) is RouterPhase.SELF_DECODING and now is not None:
            self.plan.drafter = None
            self.exploring = None
            self.decided_at = now
            self.serve(SELF_DECODING)

    def unserved(self) -> None:
        """No drafter is live or permitted: the session waits for one."""
        if self.advance(RouterEvent.UNSERVED) is RouterPhase.WAITING:
            self.plan.drafter = None

    def fenced(self, verifier: str) -> None:
        """A failover's fence naming ``verifier`` is in the log (SDCP 6.9)."""
        if self.advance(RouterEvent.FENCED) is RouterPhase.MOVING:
            self.failover_to = verifier

    def reopened(self, moved: RouterSession) -> None:
        """The session is open at the verifier the fence named, as ``moved`` plans it."""
        if self.advance(RouterEvent.REOPENED) is RouterPhase.WAITING:
            self.plan = moved
            self.failover_to = None

    def end(self) -> bool:
        """The session ended; False where it had already."""
        if self.ended:
            return False
        self.advance(RouterEvent.ENDED)
        self.plan.drafter = None
        self.failover_to = None
        return True

    @property
    def session(self) -> bytes:
        return self.plan.session

    @property
    def verifier(self) -> str:
        return self.plan.verifier

    @property
    def drafter(self) -> str | None:
        return self.plan.drafter

    @property
    def session_class(self) -> str:
        """Which of a drafter's acceptance measurements the session's choices weigh."""
        return session_class(self.plan.constraint)

    @property
    def request(self) -> str | None:
        return self.plan.request

    def serve(self, who: str) -> None:
        if not self.served or self.served[-1] != who:
            self.served.append(who)

    @property
    def path_id(self) -> str:
        return session_path_id(self.plan.session)

    def describe(self) -> dict[str, object]:
        described: dict[str, object] = {
            "session": self.plan.session,
            "epoch": self.plan.epoch,
            "verifier": self.plan.verifier,
            "ended": self.ended,
        }
        if self.plan.drafter is not None:
            described["drafter"] = self.plan.drafter
        if self.served:
            described["served"] = list(self.served)
        return described

    def take_over(self, stored: TrackedSession) -> None:
        """Another router changed the session: its facts, as ``stored`` holds them, replace ours."""
        self.plan = stored.plan
        self.first_verifier = stored.first_verifier
        self.failover_to = stored.failover_to
        if not self.ended:
            self.phase = stored.phase
        self.etag, self.saved, self.router = stored.etag, stored.saved, stored.router
        self.exploring = None

    def durable(self, router: str) -> dict[str, object]:
        """The facts another router needs to take the session over (docs/reliability.md): the
        session-open as the current verifier got it (contract, prompt, epoch, commit log, front end,
        request id, resume), where it runs and who drafts, the sampling profile (SDCP 6.6), the
        verifier of epoch 1 and a failover's named verifier (signed records), and ``router``, the
        router that wrote them."""
        plan = self.plan
        state: dict[str, object] = {
            "v": DURABLE_VERSION,
            "router": router,
            "open": plan.open_message().to_obj(),
            "verifier": plan.verifier,
            "first_verifier": self.first_verifier,
            "opened_ms": int(self.opened_at * 1000),
            # The phase as version 1 holds it: self_decoding, and failover_to while MOVING.
            "self_decoding": self.self_decoding,
        }
        if plan.drafter is not None:
            state["drafter"] = plan.drafter
        if plan.sampling is not None:
            state["sampling"] = plan.sampling.to_obj()
        if self.failover_to is not None:
            state["failover_to"] = self.failover_to
        return state

    @classmethod
    def from_durable(cls, obj: object) -> TrackedSession:
        """A session from its durable facts; BadMessage for anything a router did not write."""
        if not isinstance(obj, dict) or obj.get("v") != DURABLE_VERSION:
            raise BadMessage(f"not a router session's state of version {DURABLE_VERSION}")
        opened = SessionOpen.from_obj(obj.get("open"))
        if not isinstance(opened.prompt, tuple):
            raise BadMessage("a router session's prompt is its tokens")
        verifier, first_verifier = obj.get("verifier"), obj.get("first_verifier")
        drafter, failover_to = obj.get("drafter"), obj.get("failover_to")
        if not isinstance(verifier, str) or not isinstance(first_verifier, str):
            raise BadMessage("a router session's state names its verifier and the one of epoch 1")
        if not (drafter is None or isinstance(drafter, str)) or not (
            failover_to is None or isinstance(failover_to, str)
        ):
            raise BadMessage("a router session's instances are text URIs")
        opened_ms, self_decoding = obj.get("opened_ms"), obj.get("self_decoding")
        if not isinstance(opened_ms, int) or isinstance(opened_ms, bool) or not isinstance(self_decoding, bool):
            raise BadMessage("a router session's state carries opened_ms and self_decoding")
        sampling = obj.get("sampling")
        # The plan's members that session-open carries, from it; the rest from the state.
        carried = {
            f.name: getattr(opened, f.name) for f in dataclasses.fields(RouterSession) if hasattr(opened, f.name)
        }
        plan = RouterSession(
            **carried,
            verifier=verifier,
            drafter=drafter,
            sampling=None if sampling is None else Sampling.from_obj(sampling),
        )
        router = obj.get("router")
        return cls(
            plan,
            opened.prompt,
            router=router if isinstance(router, str) else None,
            phase=_stored_phase(self_decoding=self_decoding, failover_to=failover_to, drafter=drafter),
            opened_at=opened_ms / 1000,
            first_verifier=first_verifier,
            failover_to=failover_to,
        )


def _stored_phase(*, self_decoding: bool, failover_to: str | None, drafter: str | None) -> RouterPhase:
    """The phase of a session whose facts another router wrote: a move under way comes first."""
    if failover_to is not None:
        return RouterPhase.MOVING
    if self_decoding:
        return RouterPhase.SELF_DECODING
    return RouterPhase.DRAFTING if drafter is not None else RouterPhase.WAITING
