"""Structured output: a session's constraint compiled by llguidance, as the verifier applies it to the
target distribution and as drafters and the verifier's lookahead read the tokens it forces
(docs/interpretations.md, "Structured output").

A constraint is a kind and a text (``sdcp.protocol.messages.Constraint``):

- ``json_schema``: the JSON texts that validate against the schema, written as llguidance's JSON
  compiler writes them with ``whitespace_flexible`` off: no whitespace outside strings, object members
  in the schema's order;
- ``regex``: the texts the regular expression matches in full (Rust ``regex`` syntax);
- ``choice``: a JSON array of strings, the texts equal to one of them;
- ``lark``: a grammar in llguidance's Lark syntax.

Which tokens may come next is llguidance's token mask over the target's tokenizer, except for the
contract's stop tokens: they are allowed exactly where the output so far is a complete text of the
language, and the tokenizer's own end tokens only as stop tokens. llguidance drops the GIL while it
computes a mask, so the scorer's thread and the event loop can use two matchers at once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from sdcp.protocol.messages import Constraint

__all__ = [
    "ConstraintError",
    "GrammarConstraint",
    "check",
    "check_start",
    "compile_constraint",
    "gbnf_to_lark",
    "grammar_tokenizer",
]


class ConstraintError(ValueError):
    """A constraint that names no language this verifier can apply."""


def compile_constraint(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; a text its kind cannot read raises ConstraintError
    (a grammar that does not compile raises it from ``GrammarConstraint`` or ``check``)."""
    kind, text = constraint.kind, constraint.text
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise ConstraintError("a JSON schema is an object or a boolean")
        if schema is False:
            raise ConstraintError("the JSON schema false allows no value")
        # Part of the json_schema language (docs/interpretations.md): whitespace outside strings
        # would let a small model spend its max_new on spaces, and every verifier must allow the
        # same texts. The schema true is the schema {} (llguidance applies its options to objects only).
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                "{}" if schema is True else text, defaults={"whitespace_flexible": False}
            )
        except ValueError as exc:
            # llguidance's reading of the schema (nested deeper than it reads, say): the text's fault.
            raise ConstraintError(f"the JSON schema cannot be read: {exc}") from exc
        return str(grammar)
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    if kind == "choice":
        try:
            choices = json.loads(text)
        except ValueError as exc:
            raise ConstraintError(f"the choices are not JSON: {exc}") from exc
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ConstraintError("the choices are a non-empty JSON array of strings")
        # Lark string literals read JSON's escapes.
        return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
    if kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(text))
    raise ConstraintError(f"no language of kind {kind!r}")


def gbnf_to_lark(text: str) -> str:
    """A grammar in Lark syntax from one in Lark or in GBNF (llama.cpp's, which vLLM's
    ``guided_grammar`` also takes): llguidance's conversion, which leaves Lark as it is."""
    try:
        return str(any_to_lark(text))
    except GbnfToLarkError as exc:
        raise ConstraintError(f"the grammar is neither Lark nor GBNF: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the converter (Python) raises Exception, IndexError, RecursionError on text it cannot read
        raise ConstraintError(f"the grammar is neither Lark nor GBNF: {exc!r}") from exc


def check(constraint: Constraint, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """Raise ConstraintError unless ``constraint`` compiles (against ``tokenizer`` where given): what a
    front end checks before it opens a session."""
    message = llguidance.LLMatcher.validate_grammar(compile_constraint(constraint), tokenizer)
    if message:
        raise ConstraintError(message)


def check_start(
    constraint: Constraint, tokenizer: llguidance.LLTokenizer, stop: Sequence[int], vocab_size: int
) -> None:
    """Raise ConstraintError where no output of the language can start over ``tokenizer`` with
    these stop tokens: no token is allowed at its first position (an unsatisfiable schema such as
    ``{"$ref": "#"}``, a regular expression of an empty class, a grammar without a finite
    derivation, stop tokens that take every token an output starts with). A verifier would have no
    token to decide: what a front end refuses before it opens a session."""
    if not GrammarConstraint(tokenizer, constraint, stop, vocab_size).allowed(())[0].any():
        raise ConstraintError("no output of the language can start: no token is allowed at its first position")


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(definition: str, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer, from its definition (a Hugging Face ``tokenizer.json``), with
    ``vocab_size`` ids (a model's output layer may be wider than its tokenizer). Building one takes
    about half a second for a vocabulary of 49k: it is kept."""
    return llguidance.LLTokenizer(definition, n_vocab=vocab_size)


class GrammarConstraint:
    """A session's constraint at the verifier (``sdcp.protocol.constraint.TokenConstraint``): a
    matcher at the committed output, advanced speculatively over a proposal and rolled back."""

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, constraint: Constraint, stop: Sequence[int], vocab_size: int
    ) -> None:
        if not stop:
            # A complete output ends with a stop token: without one it could never end.
            raise ConstraintError("a constrained session needs the contract's stop tokens")
        self.constraint = constraint
        self.vocab_size = vocab_size
        self._stop = frozenset(stop)
        self._stop_ids = np.array(sorted(t for t in self._stop if t < vocab_size), dtype=np.int64)
        # The tokenizer's end tokens are not text: they end an output only as the contract's stop tokens.
        self._not_text = np.array(sorted({*tokenizer.eos_tokens, *self._stop} & set(range(vocab_size))), dtype=np.int64)
        self._matcher = llguidance.LLMatcher(tokenizer, compile_constraint(constraint), log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(self._matcher.get_error())
        self._ended = False

    def fork(self) -> GrammarConstraint:
        """An independent copy at the same committed output (a greedy run's, on the scorer's thread)."""
        copy = object.__new__(GrammarConstraint)
        copy.__dict__.update(self.__dict__)
        copy._matcher = self._matcher.deep_copy()
        return copy

    def allowed(self, tokens: Sequence[int]) -> np.ndarray:
        """``TokenConstraint.allowed``: the matcher consumes the allowed leading ``tokens`` for the
        masks after them, then rolls them back."""
        rows = [self._mask()]
        consumed = 0
        try:
            for token in tokens:
                if not rows[-1][token] or token in self._stop:
                    # After a disallowed token nothing is defined; after a stop token the output ends.
                    break
                try:
                    self._consume(token)
                except ValueError:
                    # llguidance gave up (a limit of its parser): nothing may follow the token, and
                    # the matcher, in error for good, allows nothing from now on.
                    rows.append(np.zeros(self.vocab_size, dtype=bool))
                    break
                consumed += 1
                rows.append(self._mask())
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        return np.stack(rows)

    def commit(self, tokens: Sequence[int]) -> None:
        """``TokenConstraint.commit``: ValueError for a token not allowed where it stands (the matcher
        is then unusable: the session is refused or ends)."""
        for token in tokens:
            if self._ended:
                raise ValueError(f"token {token} follows a stop token")
            if token in self._stop:
                if not self._matcher.is_accepting():
                    raise ValueError(f"stop token {token} ends an incomplete output")
                self._ended = True
                continue
            if not 0 <= token < self.vocab_size or not self._mask()[token]:
                raise ValueError(f"token {token} is not allowed after the output before it")
            self._consume(token)

    def forced(self, after: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens the language forces after the committed output and ``after``: a
        stop token where the output is complete and one stop token is all that may follow, else the
        tokens of the text every continuation starts with (llguidance's fast-forward tokens), as far
        as each is allowed in turn. Empty where ``after`` leaves the language, or where llguidance
        gives up on it (a limit of ``LLParserLimits`` reached: the matcher is then in error, and the
        masks after the committed output allow nothing, which ends the session)."""
        if limit <= 0 or self._ended:
            return ()
        consumed = 0
        try:
            for token in after:
                if token in self._stop or not self._mask()[token]:
                    return ()
                self._consume(token)
                consumed += 1
            if self._matcher.is_stopped():
                return (int(self._stop_ids[0]),) if len(self._stop_ids) == 1 else ()
            candidates = self._matcher.compute_ff_tokens()[:limit]
            return tuple(candidates[: self._matcher.validate_tokens(candidates)])
        except ValueError:
            return ()
        finally:
            if consumed:
                self._matcher.rollback(consumed)

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.zeros(self.vocab_size, dtype=bool)
        unpacked = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        mask[: unpacked.size] = unpacked
        mask[self._not_text] = False
        mask[self._stop_ids] = self._matcher.is_accepting()
        return mask

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ValueError(f"token {token}: {self._matcher.get_error()}")
