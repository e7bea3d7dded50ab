"""The serving workload's questions, figures, rule-1 comparison and report (sdcp.bench.serving); the
runs themselves are `sdcp bench --workloads serving`."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdcp.bench.serving import (
    Level,
    LevelTurn,
    ServingConfig,
    joined,
    level_questions,
    level_turns,
    load_questions,
    parting,
    serving_figures,
    serving_markdown,
    serving_results,
)
from sdcp.bench.streamed import Turn
from sdcp.bench.workloads import BenchInputError


def _entry(token: str, top: float, runner_up: float) -> dict[str, object]:
    return {"token": token, "top_logprobs": [{"logprob": runner_up}, {"logprob": top}]}


def test_the_shipped_questions_are_short_and_held_out() -> None:
    questions = load_questions()
    assert len(questions) >= 16 and all(len(question) < 100 for question in questions)
    others = (Path(__file__).parents[2] / "src/sdcp/bench/prompts").glob("*.txt")
    for other in others:
        if other.name != "serving.txt":
            assert not set(questions) & set(other.read_text(encoding="utf-8").split("\n")), other.name


def test_a_missing_question_file_is_a_bench_input_error(tmp_path: Path) -> None:
    with pytest.raises(BenchInputError, match="serving.txt"):
        load_questions(tmp_path)


def test_each_level_asks_questions_of_its_own() -> None:
    questions = load_questions()
    sets = level_questions(questions, (1, 4, 16))
    assert [len(asked) for asked in sets] == [8, 16, 32]
    assert len({question for asked in sets for question in asked}) == 56
    assert [len(asked) for asked in level_questions(questions, (2, 3), per_stream=5)] == [10, 15]
    with pytest.raises(BenchInputError, match="need 64"):
        level_questions(questions, (16, 16), per_stream=2)


def test_at_one_stream_the_systems_take_turns_question_by_question() -> None:
    """The drift of the machine over a level must not fall on one system's questions: at one stream
    the systems alternate at every question, the order rotating; with more streams each runs the
    whole level in turn."""
    systems, questions = ["sdcp", "llama_server"], ("q1", "q2", "q3")
    assert level_turns(systems, questions, 1, 0) == [
        LevelTurn("sdcp", 0, ("q1",)),
        LevelTurn("llama_server", 0, ("q1",)),
        LevelTurn("llama_server", 1, ("q2",)),
        LevelTurn("sdcp", 1, ("q2",)),
        LevelTurn("sdcp", 2, ("q3",)),
        LevelTurn("llama_server", 2, ("q3",)),
    ]
    assert level_turns(systems, questions, 4, 1) == [
        LevelTurn("llama_server", 0, questions),
        LevelTurn("sdcp", 0, questions),
    ]
    # A system's turns make its level: every answer, in the level's order, and their time.
    parts = [
        Level(1, seconds, [Turn(f"question {n}", 20.0, seconds, "text", 10, 96)]) for n, seconds in ((1, 1.0), (2, 3.0))
    ]
    level = joined(1, parts)
    assert level.seconds == 4.0 and [turn.label for turn in level.turns] == ["question 1", "question 2"]
    assert serving_figures(level)["aggregate_tokens_per_s"] == 2 * 96 / 4.0


def test_parting_names_the_reference_token_and_its_margin() -> None:
    reference = [_entry("The", -0.1, -3.0), _entry(" lib", -0.70, -0.72), _entry("rary", -0.01, -6.0)]
    assert parting("The library", reference) is None
    # A text that ends early follows the reference as far as it goes.
    assert parting("The lib", reference) is None
    where = parting("The libr", reference)
    assert where is not None and where.token == 2 and where.expected == "rary"
    where = parting("The book", reference)
    assert where is not None and where.token == 1 and where.expected == " lib"
    assert where.margin == pytest.approx(0.02)


def test_figures_and_report_put_the_systems_side_by_side(tmp_path: Path) -> None:
    def level(streams: int, first_ms: float, seconds: float) -> Level:
        turns = [Turn(f"question {n}", first_ms, 1.0, "text", 10, 96) for n in range(1, 5)]
        return Level(streams, seconds, turns)

    figures = serving_figures(level(4, 20.0, 2.0))
    assert figures["first_token_ms_p50"] == 20.0 and figures["aggregate_tokens_per_s"] == 4 * 96 / 2.0
    assert figures["stream_tokens_per_s_p50"] == pytest.approx(95 / 0.98)
    levels = {"sdcp": [level(1, 30.0, 4.0)], "llama_server": [level(1, 15.0, 2.0)]}
    agreement = [{"question": "q", "same": False, "parting": {"token": 3, "expected": " lib", "margin": 0.03}}]
    results = serving_results(ServingConfig(tmp_path), [levels], agreement)
    assert results["ratios"] == {
        "sdcp": {"1": {"first_token_p50_over_llama_server": 2.0, "tokens_per_s_over_llama_server": 0.5}}
    }
    text = serving_markdown(results)
    assert "| sdcp | 1 | 30 | 30 | 96.0 |" in text and "equal to llama-server's greedy output: 0 of 1" in text
    assert "parts at token 3 (llama-server: ' lib', margin 0.030)" in text


def test_runs_again_are_reported_as_medians_with_each_runs_ratio(tmp_path: Path) -> None:
    """With repeats, each figure is the median over the runs and each ratio the median of the
    runs' own ratios, which the report shows beside it."""

    def level(streams: int, seconds: float) -> Level:
        return Level(streams, seconds, [Turn(f"question {n}", 20.0, 1.0, "text", 10, 96) for n in range(1, 5)])

    runs = [{"sdcp": [level(1, seconds)], "llama_server": [level(1, 2.0)]} for seconds in (4.0, 2.5, 2.0)]
    cold = {"sdcp": [240.0, 180.0, 200.0], "llama_server": [120.0, 110.0, 130.0]}
    results = serving_results(ServingConfig(tmp_path, repeats=3), runs, [], cold)
    assert results["repeats"] == 3 and results["cold_first_token_ms"] == cold
    ours = results["systems"]["sdcp"]
    assert ours["levels"][0]["aggregate_tokens_per_s"] == 4 * 96 / 2.5 and ours["levels"][0]["streams"] == 1
    assert [run[0]["aggregate_tokens_per_s"] for run in ours["runs"]] == [96.0, 4 * 96 / 2.5, 192.0]
    assert results["ratios"]["sdcp"]["1"]["tokens_per_s_over_llama_server"] == pytest.approx(0.8)
    assert results["ratios_by_run"]["sdcp"]["1"]["tokens_per_s_over_llama_server"] == pytest.approx([0.5, 0.8, 1.0])
    text = serving_markdown(results)
    assert "the median of 3 runs" in text
    assert "tokens per s over llama server 0.80 (runs 0.50, 0.80, 1.00)" in text
    # Each server's warm-up, not in the levels, is the cold first request.
    assert "first token ms: sdcp 200 (runs 240, 180, 200); llama_server 120 (runs 120, 110, 130)" in text
