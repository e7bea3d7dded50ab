"""`sdcp generate --max-draft` and `--no-speculation` (docs/services.md, "Per-request speculation"):
options that contradict each other are a one-line error before anything starts."""

from __future__ import annotations

from typer.testing import CliRunner

from sdcp.cli import app


def test_no_speculation_with_a_proposal_bound_is_a_one_line_error() -> None:
    result = CliRunner().invoke(app, ["generate", "Hi", "--no-speculation", "--max-draft", "4"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--no-speculation" in lines[0] and "--max-draft" in lines[0]


def test_a_proposal_bound_above_sdcp_4_1s_64_is_refused() -> None:
    result = CliRunner().invoke(app, ["generate", "Hi", "--max-draft", "65"])
    assert result.exit_code != 0 and "--max-draft" in result.output
