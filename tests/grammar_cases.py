"""Generated constraints for the grammar fuzz test (tests/test_grammar_bounds.py): each shape at
sizes around and far past ``sdcp.grammar.LIMITS``. Run as a program, it checks every case with
``sdcp.grammar.check`` on a thread of a 1 MB stack and prints one JSON line per case: a grammar
library that crashes takes this process down, never the test's."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator

from sdcp.grammar import LIMITS, ConstraintError, check
from sdcp.protocol.messages import MAX_CONSTRAINT_TEXT, Constraint


def _lark_chain(n: int) -> str:
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n - 1)), f'r{n - 1}: "x"'])


def _lark_alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"word{i}"' for i in range(n))


def _lark_parens(n: int) -> str:
    return "start: " + "(" * n + '"x"' + ")" * n


def _lark_repetition(n: int) -> str:
    return f'start: "a"{{{n}}}'


def _regex_parens(n: int) -> str:
    return "(" * n + "a" + ")" * n


def _regex_alternatives(n: int) -> str:
    return "|".join(f"w{i}" for i in range(n))


def _regex_repetition(n: int) -> str:
    return f"a{{{n},{n}}}"


def _schema_ref_chain(n: int) -> str:
    defs: dict[str, object] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n - 1)
    }
    defs[f"d{n - 1}"] = {"type": "string"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def _schema_nesting(n: int) -> str:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


def _schema_enum(n: int) -> str:
    return json.dumps({"enum": [f"v{i}" for i in range(n)]})


def _schema_items(n: int) -> str:
    return json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": n})


def _choices(n: int) -> str:
    return json.dumps([f"c{i}" for i in range(n)])


# (kind, generator, the limit its size is measured against)
SHAPES: dict[str, tuple[str, Callable[[int], str], int]] = {
    "lark rule chain": ("lark", _lark_chain, LIMITS.max_rules),
    "lark alternatives": ("lark", _lark_alternatives, LIMITS.max_alternatives),
    "lark nesting": ("lark", _lark_parens, LIMITS.max_depth),
    "lark repetition": ("lark", _lark_repetition, LIMITS.max_repetition),
    "regex nesting": ("regex", _regex_parens, LIMITS.max_depth),
    "regex alternatives": ("regex", _regex_alternatives, LIMITS.max_alternatives),
    "regex repetition": ("regex", _regex_repetition, LIMITS.max_repetition),
    "schema $ref chain": ("json_schema", _schema_ref_chain, LIMITS.max_refs),
    "schema nesting": ("json_schema", _schema_nesting, LIMITS.max_depth),
    "schema enum": ("json_schema", _schema_enum, LIMITS.max_alternatives),
    "schema minItems": ("json_schema", _schema_items, LIMITS.max_repetition),
    "choices": ("choice", _choices, LIMITS.max_alternatives),
}
# Sizes as multiples of the limit, past it by one, and far past it (the 2,000 and 3,000).
SCALES = (0.5, 1.0, 1.01, 3.0, 12.0)


def cases() -> Iterator[tuple[str, int, int, Constraint]]:
    for name, (kind, generate, limit) in SHAPES.items():
        for scale in SCALES:
            size = max(1, int(limit * scale)) if scale != 1.01 else limit + 1
            text = generate(size)
            if len(text) <= MAX_CONSTRAINT_TEXT:
                yield name, size, limit, Constraint(kind=kind, text=text)


def _run() -> None:
    for name, size, limit, constraint in cases():
        try:
            check(constraint)
            outcome = "accepted"
        except ConstraintError as exc:
            outcome = f"refused: {exc}"
        print(json.dumps({"shape": name, "size": size, "limit": limit, "outcome": outcome}), flush=True)


if __name__ == "__main__":
    threading.stack_size(int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20)
    worker = threading.Thread(target=_run)
    worker.start()
    worker.join()
