"""Guided drafting of a constrained session (structured output: the assignment's ``constraint``),
where this drafter knows the contract's tokenizer (``[drafter] target``'s): where the grammar
forces the next tokens they start the proposal, at full confidence (one-hot rows, so rule 2 stays
exact: each token is drawn from the row it carries), and the backend's draft after them goes on up
to its first token the grammar disallows (docs/interpretations.md, "Structured output")."""

from __future__ import annotations

import asyncio
import functools
import logging

import numpy as np

from sdcp.engines.drafter.runs import SessionRun
from sdcp.grammar import ConstraintError, GrammarConstraint, grammar_tokenizer
from sdcp.models.drafter import Drafter, DraftResult, one_hot_rows
from sdcp.models.errors import ModelError
from sdcp.models.worker import InlineModelThread, ModelThread
from sdcp.protocol.contract import tokenizer_definition_digest
from sdcp.protocol.messages import Assignment
from sdcp.protocol.rules import get_rule

__all__ = ["current_guide", "guided_draft", "session_grammar"]

log = logging.getLogger("sdcp.drafter")


def session_grammar(assignment: Assignment, target: str, vocab_size: int, uri: str) -> GrammarConstraint | None:
    """The session's grammar over the target's tokenizer, if ``target`` (``[drafter] target``)
    names the contract's; else None (drafted unguided: the verifier applies the constraint anyway)."""
    assert assignment.constraint is not None
    contract = assignment.contract
    try:
        definition, digest = _target_tokenizer(target)
        if digest != contract.tokenizer:
            return None
        tokenizer = grammar_tokenizer(definition, vocab_size)
        return GrammarConstraint(tokenizer, assignment.constraint, contract.stop, vocab_size)
    except (ModelError, OSError, ConstraintError) as exc:
        log.warning("%s: session %s drafted without its grammar: %s", uri, assignment.session.hex(), exc)
        return None


def current_guide(run: SessionRun, uri: str) -> GrammarConstraint | None:
    """The session's grammar at its committed output (None when unguided), advanced from the
    tokens it consumed before, or again from the start where a resync changed those."""
    if run.grammar is None:
        return None
    if run.guide is None or run.output[: len(run.guided)] != run.guided:
        run.guide, run.guided = run.grammar.fork(), []
    try:
        run.guide.commit(run.output[len(run.guided) :])
    except ValueError as exc:
        # Not the verifier's language after all: draft unguided rather than guess.
        log.warning("%s: session %s: grammar left: %s", uri, run.session.hex(), exc)
        run.grammar = run.guide = None
        return None
    run.guided = list(run.output)
    return run.guide


async def guided_draft(
    run: SessionRun, guide: GrammarConstraint, m: int, *, drafter: Drafter, worker: ModelThread | InlineModelThread
) -> DraftResult:
    """Up to ``m`` tokens the grammar allows: those it forces, then the backend's draft after them."""
    # Masks take up to a millisecond each: off the event loop.
    forced = await asyncio.to_thread(guide.forced, (), m)
    needs_q = get_rule(run.state.contract.rule).needs_q
    if len(forced) == m or (forced and forced[-1] in run.state.contract.stop):
        return DraftResult(forced, one_hot_rows(forced, drafter.vocab_size) if needs_q else None, 0.0)
    if forced:
        # The backend drafts on after the forced tokens, from the prefix they extend (the verdict's
        # sync brings it back to the committed prefix).
        await worker.run_async(drafter.sync, run.session, [*run.committed_prefix, *forced])
    draft = await worker.run_async(drafter.draft, run.session, m - len(forced), run.state.sampling)
    tokens = (*forced, *draft.tokens)
    allowed = await asyncio.to_thread(guide.allowed, tokens)
    # The tokens up to the first one the grammar disallows (a stop token where the output is
    # complete included); at least one, as a proposal has: the verifier then emits its own.
    keep = len(allowed) - 1
    if keep < len(tokens) and allowed[keep][tokens[keep]]:
        keep += 1
    keep = max(keep, 1)
    rows = None
    if draft.q_rows is not None:
        rows = np.concatenate([one_hot_rows(forced, drafter.vocab_size), draft.q_rows[: keep - len(forced)]])
    return DraftResult(tokens[:keep], rows, draft.seconds)


@functools.lru_cache(maxsize=2)
def _target_tokenizer(name: str) -> tuple[str, bytes]:
    """A target's tokenizer definition (its ``tokenizer.json``, as the verifier's grammar reads it)
    and digest, from the tokenizer alone; kept, as a drafter serves one target."""
    from sdcp.models.registry import load_tokenizer
    from sdcp.models.weights.digests import tokenizer_definition

    definition = tokenizer_definition(load_tokenizer(name))
    return definition, tokenizer_definition_digest(definition)
