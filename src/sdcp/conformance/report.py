"""Check results: each cites the draft's section and carries its evidence."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["CheckFailed", "Report", "Result"]


class CheckFailed(AssertionError):
    """A check's expectation did not hold; the message is the evidence."""


@dataclass(frozen=True)
class Result:
    name: str
    section: str
    passed: bool
    evidence: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  [SDCP {self.section}] {self.name}: {self.evidence}"


@dataclass
class Report:
    """The results of one run, printed as they come when `echo` is given."""

    echo: Callable[[str], None] | None = None
    results: list[Result] = field(default_factory=list)

    @contextmanager
    def check(self, name: str, section: str) -> Iterator[list[str]]:
        """A check: the body appends evidence and raises `CheckFailed` (or any error) to fail."""
        evidence: list[str] = []
        try:
            yield evidence
        except CheckFailed as exc:
            self._add(Result(name, section, False, "; ".join([*evidence, str(exc)])))
        except Exception as exc:  # noqa: BLE001 - a broken exchange fails the check, with its reason
            self._add(Result(name, section, False, "; ".join([*evidence, f"{type(exc).__name__}: {exc}"])))
        else:
            self._add(Result(name, section, True, "; ".join(evidence) or "as required"))

    def _add(self, result: Result) -> None:
        self.results.append(result)
        if self.echo is not None:
            self.echo(result.line())

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(result.passed for result in self.results)

    def failed(self) -> list[str]:
        return [result.name for result in self.results if not result.passed]


def expect(condition: bool, evidence: str) -> None:
    """Fail the running check with `evidence` unless `condition` holds."""
    if not condition:
        raise CheckFailed(evidence)
