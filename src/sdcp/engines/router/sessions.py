"""A session as the router holds it: the plan (``sdcp.protocol.router.RouterSession``) and what the
router keeps beside it to decide and to replay the commit log."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sdcp.protocol.messages import session_path_id
from sdcp.protocol.records import LogReplayer
from sdcp.protocol.router import RouterSession

__all__ = ["SELF_DECODING", "TrackedSession"]

# Who served a session, in the router's session description: a drafter's URI, or this for the
# verifier decoding alone at the router's request.
SELF_DECODING = "self-decoding"


@dataclass
class TrackedSession:
    plan: RouterSession
    prompt: tuple[int, ...]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: bool = False
    # The verifier decodes the session alone at this router's request, until its event.
    self_decoding: bool = False
    # A drafter whose acceptance was unmeasured when it was assigned to this session.
    exploring: str | None = None
    decided_at: float = 0.0
    served: list[str] = field(default_factory=list)
    opened_at: float = field(default_factory=time.time)
    # The verifier of epoch 1 (opened without a fence): only its signed records count in epoch 1.
    first_verifier: str = ""
    # The verifier a failover's fence named, until the session is open there: a retry goes there
    # again, or spends that epoch (signed commit records, docs/reliability.md).
    failover_to: str | None = None
    # The commit log as far as it has been read, and the committed-token object of its prefix:
    # each read asks only for the records appended since (no whole-log read per assignment).
    replayer: LogReplayer | None = None
    tokens_uri: str | None = None

    def __post_init__(self) -> None:
        if not self.first_verifier and self.plan.epoch == 1:
            self.first_verifier = self.plan.verifier

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
