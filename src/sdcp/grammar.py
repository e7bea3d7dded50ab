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

A constraint is a request's input, and a peer's: before llguidance reads it, every role checks it
against ``LIMITS`` (``check_bounds``: rules, nesting, alternatives, references, repetition counts),
and llguidance runs under ``LIMITS.parser_limits()`` (its fuel and state caps, which bound compile
time and memory). Both are explicit and the same at the gateway, the verifier and the drafters, so
what a front end accepts every verifier applies. The bounds are what llguidance 1.9 reads without
exhausting a thread's stack: a chain of 2,500 Lark rules, or of 1,000 JSON-schema references, took
a process down (segmentation fault) on an 8 MB stack (docs/security.md, "Grammars").
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from sdcp.protocol.messages import Constraint

__all__ = [
    "LIMITS",
    "ConstraintError",
    "GrammarLimits",
    "GrammarConstraint",
    "check",
    "check_bounds",
    "check_start",
    "compile_constraint",
    "gbnf_to_lark",
    "grammar_tokenizer",
]


class ConstraintError(ValueError):
    """A constraint that names no language this verifier can apply."""


@dataclass(frozen=True)
class GrammarLimits:
    """What a constraint may hold before llguidance reads it (``check_bounds``), and llguidance's own
    limits (``parser_limits``). llguidance 1.9 compiles by recursion: a chain of Lark rules costs it
    about 3 KB of stack a link, a chain of JSON-schema references about 8 KB (measured: 320 rules
    and 96 references compile on a 1 MB thread stack, 400 and 127 crash it). The defaults compile
    on a thread stack of 1 MB (glibc's default is 8 MB)."""

    # Lark rules and terminals; a JSON schema's $ref members; a grammar's, regex's or schema's
    # nesting; alternatives ("|", choices, enum values) in all; the largest {n,m} repetition count.
    max_rules: int = 256
    max_refs: int = 64
    max_depth: int = 64
    max_alternatives: int = 1024
    max_repetition: int = 4096
    # llguidance (LLParserLimits): lexer fuel at compile time (about 50k a millisecond: 20 ms) and
    # per mask, Earley items per mask, lexer states (1-2 KB each: at most about 100 MB), symbols.
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 50_000
    max_grammar_size: int = 100_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_alternatives,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            # An error names the limit, never the grammar's text or the parser's state.
            verbose_errors=False,
        )


LIMITS = GrammarLimits()

# Lark's literals and comments, which may hold any character: removed before counting structure.
_LARK_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imsux]*|//[^\n]*')
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?\s*:", re.MULTILINE)
_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_REGEX_ESCAPE = re.compile(r"\\.")
_OPENERS, _CLOSERS = "([{", ")]}"


def check_bounds(constraint: Constraint, limits: GrammarLimits = LIMITS) -> None:
    """Raise ConstraintError where ``constraint`` exceeds ``limits``: checked on its text alone,
    before any grammar library reads it, so that no input reaches llguidance that could exhaust a
    thread's stack or its time and memory."""
    kind, text = constraint.kind, constraint.text
    if kind == "lark":
        structure = _LARK_LITERAL.sub(" ", text)
        rules = len(_LARK_RULE.findall(structure))
        _bound("rule count", rules, limits.max_rules)
        _bound("nesting depth", _depth(structure), limits.max_depth)
        _bound("alternatives", rules + structure.count("|"), limits.max_alternatives)
        _bound_repetitions(structure, limits)
    elif kind == "regex":
        structure = _REGEX_ESCAPE.sub("", text)
        _bound("nesting depth", _depth(structure.replace("{", "").replace("}", "")), limits.max_depth)
        _bound("alternatives", 1 + structure.count("|"), limits.max_alternatives)
        _bound_repetitions(structure, limits)
    elif kind in ("json_schema", "choice"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConstraintError(f"the {kind} text is not JSON: {exc}") from exc
        if kind == "choice":
            _bound("alternatives", len(value) if isinstance(value, list) else 0, limits.max_alternatives)
            return
        depth, refs, alternatives = 0, 0, 0
        for level, node in _json_nodes(value):
            depth = max(depth, level)
            _bound("nesting depth", depth, limits.max_depth)
            if isinstance(node, dict):
                refs += "$ref" in node
                for member in ("enum", "anyOf", "oneOf"):
                    if isinstance(node.get(member), list):
                        alternatives += len(node[member])
                for member in ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"):
                    count = node.get(member)
                    if isinstance(count, int) and not isinstance(count, bool):
                        _bound(member, count, limits.max_repetition)
                if isinstance(node.get("pattern"), str):
                    check_bounds(Constraint(kind="regex", text=node["pattern"]), limits)
        _bound("$ref count", refs, limits.max_refs)
        _bound("alternatives", alternatives, limits.max_alternatives)


def _bound(what: str, count: int, limit: int) -> None:
    if count > limit:
        raise ConstraintError(f"the constraint exceeds a limit of this server: {what} {count}, at most {limit}")


def _depth(structure: str) -> int:
    depth = deepest = 0
    for char in structure:
        if char in _OPENERS:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSERS:
            depth = max(0, depth - 1)
    return deepest


def _bound_repetitions(structure: str, limits: GrammarLimits) -> None:
    for low, high in _REPETITION.findall(structure):
        _bound("repetition count", max(int(low), int(high or 0)), limits.max_repetition)


def _json_nodes(value: object) -> Iterator[tuple[int, object]]:
    """Every value in a JSON document with its nesting level, without recursion."""
    pending: list[tuple[int, object]] = [(0, value)]
    while pending:
        level, node = pending.pop()
        yield level, node
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        pending.extend((level + 1, child) for child in children)


def compile_constraint(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; a text its kind cannot read raises ConstraintError
    (a grammar that does not compile raises it from ``GrammarConstraint`` or ``check``); one past
    ``LIMITS`` raises it before llguidance reads it."""
    check_bounds(constraint)
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
    message = llguidance.LLMatcher.validate_grammar(
        compile_constraint(constraint), tokenizer, limits=LIMITS.parser_limits()
    )
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
        self._matcher = llguidance.LLMatcher(
            tokenizer, compile_constraint(constraint), log_level=0, limits=LIMITS.parser_limits()
        )
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
            if not self._matcher.consume_token(token):
                # llguidance gave up on an allowed token (a limit of its parser): the token is
                # committed, and the matcher, in error for good, allows nothing after it, so the
                # session's next round ends it (a dead end), never a thread that dies here.
                return

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
