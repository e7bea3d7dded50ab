"""A drafter's knowledge of a session's committed output brought to the verifier's (SDCP 4.2, 6.2,
6.7): from the router's committed-token object where it matches, else read from the verifier's
output resource; and resynchronised after sdcp-stale-base."""

from __future__ import annotations

import logging

from sdcp.cache import MLC, CacheError
from sdcp.engines.drafter.runs import InconsistentPrefix, SessionRun
from sdcp.engines.ports import VerifierLink
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.messages import Action, Output
from sdcp.protocol.problems import BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import decode_token_list

__all__ = ["PrefixCatchUp"]

log = logging.getLogger("sdcp.drafter")


class PrefixCatchUp:
    """Catches the drafter ``uri``'s sessions up with their committed output."""

    def __init__(self, *, uri: str, mlc: MLC, link: VerifierLink) -> None:
        self.uri = uri
        self._mlc = mlc
        self._link = link

    async def adopt_committed_object(self, run: SessionRun, uri: str) -> None:
        assignment = run.assignment
        try:
            tokens = decode_token_list(await self._mlc.get(uri), "committed_tokens")
        except (CacheError, BadMessage) as exc:
            log.warning("%s: committed tokens %s unusable, asking the verifier: %s", self.uri, uri, exc)
            return
        if len(tokens) == assignment.committed and extend_digest(run.output_digest, tokens) == assignment.digest:
            run.output = list(tokens)
            run.output_digest = assignment.digest
        else:
            log.warning("%s: committed tokens %s do not match the assignment, asking the verifier", self.uri, uri)

    async def catch_up(self, run: SessionRun, committed: int, digest: bytes) -> None:
        """Make the known output the first ``committed`` tokens with digest d[committed] (SDCP 4.2).

        Missing tokens come from the verifier's output resource; when the known tokens turn out
        to be on another prefix, the whole output is read again from index 0.
        """
        d0 = prefix_digest(run.assignment.contract.digest, run.prompt)
        if committed <= len(run.output):
            if extend_digest(d0, run.output[:committed]) == digest:
                del run.output[committed:]
                run.output_digest = digest
                return
        else:
            missing = await self._read_output(run, len(run.output), committed)
            if extend_digest(run.output_digest, missing) == digest:
                run.output.extend(missing)
                run.output_digest = digest
                return
        tokens = await self._read_output(run, 0, committed)
        if extend_digest(d0, tokens) != digest:
            raise InconsistentPrefix(f"the verifier's {committed} committed tokens do not give the committed digest")
        run.output = list(tokens)
        run.output_digest = digest

    async def resync_from_output(self, run: SessionRun) -> None:
        """sdcp-stale-base without the session-state (another implementation's verifier need not
        send our member): the output tells the committed prefix, and the round is found by trying
        the next one (docs/interpretations.md, "we send session_state; we accept its absence")."""
        state = run.state
        try:
            output = await self._output_at(run, len(run.output))
        except ProtocolError as exc:
            if exc.problem is not ProblemType.STALE_EPOCH:
                raise
            state.stopped_by = ProblemType.STALE_EPOCH
            return
        if output.tokens:
            run.output.extend(output.tokens)
            run.output_digest = extend_digest(run.output_digest, output.tokens)
            state.learn_prefix(len(run.output), run.output_digest)
        elif output.final:
            state.stopped_by = output.finish if output.finish is not None else Action.FAIL
        elif not state.try_later_round():
            state.stopped_by = ProblemType.STALE_BASE

    async def _output_at(self, run: SessionRun, start: int) -> Output:
        """GET sessions/{id}/output?from=start (SDCP 6.7), checked to answer this session, index and
        epoch (another epoch is sdcp-stale-epoch: the session moved, SDCP 6.9)."""
        output = await self._link.output(run.state.verifier, run.session, start)
        if output.session != run.session or output.from_ != start:
            raise BadMessage("the verifier's output answers another session or index")
        if output.epoch != run.state.epoch:
            raise ProtocolError(ProblemType.STALE_EPOCH, f"the verifier serves epoch {output.epoch}")
        return output

    async def _read_output(self, run: SessionRun, start: int, end: int) -> list[int]:
        """Output tokens start..end-1 from GET sessions/{id}/output (SDCP 6.7)."""
        tokens: list[int] = []
        while start + len(tokens) < end:
            output = await self._output_at(run, start + len(tokens))
            if not output.tokens:
                raise InconsistentPrefix(f"the verifier has no output at index {start + len(tokens)} of {end}")
            tokens.extend(output.tokens)
        return tokens[: end - start]
