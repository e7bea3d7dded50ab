"""A session as the drafter holds it while it drafts for it, and where its rounds' rows live."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import Q_ROWS_KIND
from sdcp.grammar import GrammarConstraint
from sdcp.protocol.drafter import DrafterSession
from sdcp.protocol.messages import Assignment

__all__ = ["InconsistentPrefix", "SessionRun", "q_rows_uri"]


class InconsistentPrefix(RuntimeError):
    """The committed tokens available to the drafter do not reproduce the committed digest."""


def q_rows_uri(mlc: MLC, assignment: Assignment, round_number: int) -> str:
    """Where the rows of one round's proposal live: unique per session, epoch and round."""
    name = f"{assignment.session.hex()}-e{assignment.epoch}-r{round_number}"
    return build_uri(mlc.authority, assignment.contract.scope, Q_ROWS_KIND, name)


@dataclass
class SessionRun:
    """One assigned session: its protocol state and what the drafter knows of its tokens."""

    assignment: Assignment
    state: DrafterSession
    prompt: tuple[int, ...] = ()
    output: list[int] = field(default_factory=list)
    output_digest: bytes = b""
    opened: bool = False
    task: asyncio.Task[None] | None = None
    # When the last verdict arrived (perf_counter), until the next proposal leaves.
    verdict_at: float | None = None
    # A constrained session's grammar where this drafter reads its tokenizer (else None): at the
    # empty output, and a copy advanced over ``guided``, the output tokens it has consumed.
    grammar: GrammarConstraint | None = None
    guide: GrammarConstraint | None = None
    guided: list[int] = field(default_factory=list)

    @property
    def session(self) -> bytes:
        return self.assignment.session

    @property
    def committed_prefix(self) -> list[int]:
        """What ``sdcp.models`` calls the committed prefix: prompt followed by committed output."""
        return [*self.prompt, *self.output]
