"""Grammars are bounded before they reach llguidance (issue #36): a fuzz of generated constraints,
deep, wide, long chains and big repetition counts, each accepted within ``LIMITS`` or refused with a
ConstraintError, and never a crashed process (they run in a child process on a 1 MB thread stack)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.grammar_cases import cases

from sdcp.grammar import LIMITS, ConstraintError, check_bounds
from sdcp.protocol.messages import Constraint

ROOT = Path(__file__).resolve().parent.parent


def test_generated_grammars_end_in_a_refusal_or_a_grammar_never_in_a_crash() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.grammar_cases", str(1 << 20)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"the checking process died ({done.returncode}): {done.stderr[-2000:]}"
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(list(cases())) > 40
    for result in results:
        # A size past the bound is refused, by the bound or by llguidance; one within is read (or
        # refused by llguidance for what it is, never by a crash).
        if result["size"] > result["limit"]:
            assert result["outcome"].startswith("refused"), result
    assert any(r["outcome"] == "accepted" for r in results)


def test_the_issues_two_grammars_are_refused_before_llguidance_reads_them() -> None:
    """The 36 KB grammar of 2,000 alternatives that killed the scorer thread, and the 47 KB chain
    of 3,000 rules that crashed the gateway and each verifier (failed before: the first compiled,
    the second was a segmentation fault)."""
    wide = "start: " + " | ".join(f'"alternative{i:05d}"' for i in range(2000))
    chain = "\n".join(["start: rule0", *(f"rule{i}: rule{i + 1}" for i in range(2999)), 'rule2999: "x"'])
    assert len(wide) > 36_000 and len(chain) > 47_000
    for text, what in ((wide, "alternatives"), (chain, "rule count")):
        try:
            check_bounds(Constraint(kind="lark", text=text))
        except ConstraintError as exc:
            assert what in str(exc)
        else:
            raise AssertionError(f"{what}: not refused")


def test_literals_and_comments_do_not_count_as_structure() -> None:
    text = 'start: "(((|||" /[(|]{9999}/ // ((((((|\n'
    check_bounds(Constraint(kind="lark", text=text))
    check_bounds(Constraint(kind="regex", text=r"\(\(\(\|a{3}"))
    assert LIMITS.parser_limits().max_items_in_row == LIMITS.max_alternatives
