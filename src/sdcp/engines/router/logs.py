"""A session's commit log as the router reads it (SDCP 6.9): each record replayed once, from the
first one not read before, and the committed prefix written to the MLC for assignments and
failovers."""

from __future__ import annotations

import logging

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import TOKENS_KIND
from sdcp.engines.router.observe import RouterMetrics
from sdcp.engines.router.sessions import TrackedSession
from sdcp.protocol.records import LogReplay, LogReplayer, RecordAuthority, encode_token_list, session_terms

__all__ = ["SessionLogs"]

log = logging.getLogger("sdcp.router")


class SessionLogs:
    """Reads sessions' commit logs for the router ``uri``; ``record_check`` checks each record's
    signature before it is replayed (None: unsigned logs)."""

    def __init__(self, *, uri: str, mlc: MLC, record_check: RecordAuthority | None, metrics: RouterMetrics) -> None:
        self.uri = uri
        self._mlc = mlc
        self._record_check = record_check
        self._metrics = metrics

    async def committed_prefix(self, tracked: TrackedSession) -> tuple[LogReplay, str]:
        """The committed state from the commit log, and its tokens written to the MLC. The log is
        read from the first record not read before, and each record replayed once."""
        plan = tracked.plan
        replay = (await self.read(tracked)).replay
        # The committed prefix of a given length never changes, so the name can say only its length.
        uri = build_uri(
            self._mlc.authority, plan.contract.scope, TOKENS_KIND, f"{plan.session.hex()}-{len(replay.tokens)}"
        )
        if uri != tracked.tokens_uri:
            await self._mlc.put(uri, encode_token_list(replay.tokens))
            tracked.tokens_uri = uri
        return replay, uri

    async def read(self, tracked: TrackedSession) -> LogReplayer:
        """The session's replayer, fed the records appended to its log since the last read."""
        plan = tracked.plan
        replayer = tracked.replayer
        if replayer is None:
            replayer = tracked.replayer = LogReplayer(
                plan.contract.digest,
                tracked.prompt,
                authority=self._record_check,
                first_verifier=tracked.first_verifier,
                session=plan.session,
                terms=session_terms(constraint=plan.constraint, min_new=plan.min_new),
            )
        snapshot = await self._mlc.commit_log(plan.commit_log).read_from(replayer.fed)
        try:
            # SDCP 1.3, 6.9: a record that is not its epoch's verifier's signed record is a fault:
            # it is never replayed, and its epoch counts no later record (the router has fenced
            # it, or fences it at the failover); the output up to the last good record stands.
            faults = replayer.feed(snapshot.records)
        except Exception:
            tracked.replayer = None  # a corrupt log is read again from its start next time
            raise
        for fault in faults:
            self._metrics.untrusted_record()
            log.warning("%s: session %s: a commit record left out: %s", self.uri, plan.session.hex(), fault)
        return replayer
