"""The benchmark machinery on the tiny model: results.json keys and a real output comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdcp.bench.report import markdown, summarise
from sdcp.bench.runner import BenchConfig, BenchData, ConcurrencyLevel, Measurement
from sdcp.bench.systems import RunResult
from sdcp.bench.workloads import (
    BenchInputError,
    Prompt,
    Workload,
    load_history_workloads,
    load_structured_workload,
    load_workloads,
    parse_prompts,
    rotated,
    tokenize_prompt,
    warm_up_prompts,
)
from sdcp.cli import app
from sdcp.models.registry import load_model
from sdcp.models.weights.paths import TINY_NAME

REQUIRED_RATIOS = (
    "repetitive_vs_target",
    "repetitive_vs_hf_prompt_lookup",
    "nonrepetitive_vs_target",
    "e2e_vs_inprocess",
    "concurrency16_vs_1",
)


def _write_prompts(directory: Path) -> Path:
    directory.mkdir()
    (directory / "repetitive.txt").write_text("# comment\nabc abc abc abc\n---\nunused\n", encoding="utf-8")
    (directory / "nonrepetitive.txt").write_text("tell me a story\n", encoding="utf-8")
    (directory / "mixed.txt").write_text("xyz xyz then something new\n", encoding="utf-8")
    (directory / "copyedit.txt").write_text("fix the speling of this text\n", encoding="utf-8")
    (directory / "open.txt").write_text("why is the sky blue\n", encoding="utf-8")
    # Bounded: the tiny random model's answer ends within max_new.
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    (directory / "structured.txt").write_text(f"{schema}\nis it ok, as JSON\n", encoding="utf-8")
    return directory


@pytest.mark.timeout(240)
def test_bench_command_on_tiny_model_writes_results(tmp_path: Path) -> None:
    prompts = _write_prompts(tmp_path / "prompts")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--quick",
            "--model",
            "tiny",
            "--out",
            str(out),
            "--prompts",
            str(prompts),
            "--per-workload",
            "1",
            "--max-new",
            "12",
            "--repeats",
            "1",
            "--concurrency",
            "1,16",
            "--no-redis",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "results.json").read_text(encoding="utf-8"))
    for key in REQUIRED_RATIOS:
        assert isinstance(summary["ratios"][key], float), key
    assert summary["overhead_ms_p50"] is not None and summary["overhead_ms_p99"] >= summary["overhead_ms_p50"]
    assert summary["identical_outputs"] is True and summary["mismatches"] == []
    # The structured workload: the engines and both clusters (the default one through the gateway,
    # the schema as response_format) against the masked target alone, the same tokens.
    for key in ("structured_vs_target_only", "structured_e2e_vs_target_only", "structured_inprocess_vs_target_only"):
        assert isinstance(summary["ratios"][key], float), key
    for system in ("sdcp_inprocess", "sdcp_e2e", "sdcp_default"):
        assert summary["systems"][system]["structured"]["tokens"] > 0, system
    assert summary["systems"]["hf_target"]["structured"]["tokens"] == 0
    assert {"hf_target", "hf_prompt_lookup", "sdcp_target_only", "sdcp_inprocess", "sdcp_e2e"} <= set(
        summary["systems"]
    )
    assert [level["sessions"] for level in summary["concurrency"]] == [1, 16]
    assert summary["concurrency"][1]["verifier_batch_mean"] >= 1.0
    assert "| sdcp_e2e |" in (out / "results.md").read_text(encoding="utf-8")
    # What a user runs: the default cluster through the gateway, on every workload.
    workloads = ["repetitive", "nonrepetitive", "mixed", "copyedit", "open"]
    assert summary["systems"]["sdcp_default"]["open"]["tokens_per_s"] > 0
    assert sorted(summary["default_vs_target"]) == sorted(workloads)
    assert all(isinstance(summary["default_vs_target"][w], float) for w in workloads)
    assert all(isinstance(summary["default_vs_ngram_only"][w], float) for w in workloads)
    # SDCP's target alone runs the chat prompts too: the reference of exactness there.
    assert summary["systems"]["sdcp_target_only"]["open"]["tokens_per_s"] > 0
    assert summary["systems"]["sdcp_inprocess"]["open"]["tokens_per_s"] is None  # chat: CHAT_SYSTEMS only
    assert summary["backend"] == "torch"  # the tiny model is no GGUF
    # The gateway's streamed answer is timed to its first text.
    assert summary["systems"]["sdcp_default"]["open"]["first_token_ms_p50"] > 0
    rows = summary["default_per_prompt"]
    assert [(row["workload"], row["prompt"]) for row in rows] == [(w, 0) for w in [*workloads, "structured"]]
    assert all(row["served"] for row in rows)
    assert set(summary["noisy_neighbour"]) == {"idle_tokens_per_s", "busy_tokens_per_s", "busy_vs_idle"}
    assert summary["noisy_neighbour"]["busy_tokens_per_s"] > 0
    # The tiny model has no GGUF: the llama.cpp anchors are left out, transformers' stays.
    assert "llamacpp_target" not in summary["systems"] and summary["same_as_llamacpp"] == {}
    assert list(summary["relative_speed"]) == ["hf_target"]
    assert isinstance(summary["relative_speed"]["hf_target"]["sdcp_default"]["open"], float)
    assert summary["systems"]["sdcp_e2e"]["repetitive"]["first_token_ms_p50"] > 0
    assert summary["systems"]["hf_target"]["repetitive"]["first_token_ms_p50"] is None
    assert (out / "throughput.png").stat().st_size > 0
    assert (out / "acceptance_concurrency.png").stat().st_size > 0
    assert (out / "relative_speed.png").stat().st_size > 0


def _data(
    tokens_by_system: dict[str, list[int]], seconds: dict[str, float] | None = None, backend: str = "torch"
) -> BenchData:
    measurements = [
        Measurement(
            system,
            workload,
            0,
            0,
            RunResult(tokens=list(tokens), seconds=(seconds or {}).get(system, 1.0), overhead_ms=[1.0]),
        )
        for system, tokens in tokens_by_system.items()
        for workload in ("repetitive", "nonrepetitive", "mixed")
    ]
    return BenchData(
        config=BenchConfig(out=Path("unused")),
        workloads=[Workload(name, ("p",)) for name in ("repetitive", "nonrepetitive", "mixed")],
        measurements=measurements,
        concurrency=[ConcurrencyLevel(1, 10, 1.0), ConcurrencyLevel(16, 50, 1.0)],
        systems=list(tokens_by_system),
        seconds=1.0,
        backend=backend,
    )


def test_the_order_of_the_systems_rotates_from_prompt_to_prompt() -> None:
    """No system always runs right after the same other one, even in a single repeat: the runner
    rotates the order by one at each prompt (and each repeat's first prompt by one more), so each
    goes first as often as the others."""
    systems = ["target", "default", "e2e"]
    assert [rotated(systems, turn)[0] for turn in range(6)] == ["target", "default", "e2e"] * 2
    assert rotated(systems, 1) == ["default", "e2e", "target"]
    assert rotated(systems, -1) == ["e2e", "target", "default"]
    assert rotated(["alone"], 5) == ["alone"]


def test_identical_outputs_is_false_when_one_token_differs() -> None:
    same = [5, 6, 7]
    systems = {
        "hf_target": same,
        "hf_prompt_lookup": same,
        "sdcp_target_only": same,
        "sdcp_inprocess": same,
        "sdcp_e2e": [5, 9, 7],
    }
    summary = summarise(_data(systems))
    assert summary["identical_outputs"] is False
    assert {m["system"] for m in summary["mismatches"]} == {"sdcp_e2e"}
    assert summary["mismatches"][0]["first_difference"] == 1
    assert summary["ratios"]["concurrency16_vs_1"] == 5.0


def test_identical_outputs_needs_a_comparison() -> None:
    summary = summarise(_data({"hf_target": [1, 2], "hf_prompt_lookup": [1, 3]}))
    assert summary["identical_outputs"] is False


@pytest.mark.parametrize(("backend", "transformers_is_exact"), [("torch", True), ("llamacpp", False)])
def test_exactness_is_against_the_backends_own_greedy_decoding(backend: str, transformers_is_exact: bool) -> None:
    # On llama.cpp SDCP's target is the GGUF's computation, not transformers' fp32 one.
    systems = {"hf_target": [5, 6, 1], "sdcp_target_only": [5, 6, 7], "sdcp_e2e": [5, 6, 7], "sdcp_default": [5, 6, 7]}
    summary = summarise(_data(systems, backend=backend))
    assert summary["backend"] == backend
    assert summary["identical_outputs"] is not transformers_is_exact
    assert {m["system"] for m in summary["mismatches"]} == ({"hf_target"} if transformers_is_exact else set())


def test_speeds_and_outputs_are_also_given_against_llamacpp_target() -> None:
    systems = {
        "hf_target": [5, 6, 7, 8],
        "sdcp_target_only": [5, 6, 7, 8],
        "llamacpp_target": [5, 6, 7, 8],
        "sdcp_e2e": [5, 6, 9, 8],
    }
    summary = summarise(_data(systems, seconds={"hf_target": 2.0, "llamacpp_target": 0.5}))
    relative = summary["relative_speed"]
    assert relative["llamacpp_target"]["hf_target"]["mixed"] == 0.25
    assert relative["llamacpp_target"]["sdcp_e2e"]["all"] == 0.5
    assert relative["hf_target"]["llamacpp_target"]["repetitive"] == 4.0
    same = summary["same_as_llamacpp"]
    assert same["hf_target"] == {"prompts": 3, "identical_prompts": 3, "mismatches": []}
    assert same["sdcp_e2e"]["identical_prompts"] == 0 and same["sdcp_e2e"]["prompts"] == 3
    assert {m["first_difference"] for m in same["sdcp_e2e"]["mismatches"]} == {2}
    # A difference from llama.cpp is reported, not a failure of the exact systems.
    assert summary["identical_outputs"] is False and {m["system"] for m in summary["mismatches"]} == {"sdcp_e2e"}
    report = markdown(summary)
    assert "Speed relative to `llamacpp_target`" in report
    assert "| sdcp_e2e | 0 of 3 | mixed[0]: 2, nonrepetitive[0]: 2, repetitive[0]: 2 |" in report


def test_prompt_files_parse_and_bad_inputs_are_typed_errors(tmp_path: Path) -> None:
    assert parse_prompts("# c\none\n---\n\n---\ntwo\nlines\n") == ("one", "two\nlines")
    assert [w.name for w in load_workloads(_write_prompts(tmp_path / "p"), per_workload=1)] == [
        "repetitive",
        "nonrepetitive",
        "mixed",
        "copyedit",
        "open",
    ]
    with pytest.raises(BenchInputError, match="missing"):
        load_workloads(tmp_path / "absent")
    with pytest.raises(BenchInputError, match="at least 1"):
        load_workloads(tmp_path / "p", per_workload=0)


def test_the_warm_up_asks_no_measured_prompt() -> None:
    """A cluster learns what it answers: a measured prompt in the warm-up would be measured with the
    first tokens of its answer already in the lookahead's history."""
    tokenizer = load_model(TINY_NAME).tokenizer
    workload = load_structured_workload()
    assert workload is not None
    structured = [
        Prompt(text, tuple(tokenize_prompt(tokenizer, text)), constraint=workload.constraint_at(index))
        for index, text in enumerate(workload.prompts)
    ]
    warm, structured_warm = warm_up_prompts(tokenizer, structured)
    shipped = {p for w in [*load_workloads(), *load_history_workloads(), workload] for p in w.prompts}
    assert warm.text not in shipped
    assert warm.tokens and warm.constraint is None
    assert structured_warm is not None and structured_warm.text == warm.text
    assert structured_warm.constraint == structured[0].constraint is not None
    assert warm_up_prompts(tokenizer, []) == (warm, None)


def test_the_shipped_prompt_set_has_eight_prompts_per_chat_workload() -> None:
    workloads = {w.name: w.prompts for w in load_workloads()}
    assert len(workloads["copyedit"]) >= 8 and len(workloads["open"]) >= 8


@pytest.mark.parametrize(
    ("workload", "options", "named"),
    [
        ("agent", ["--repeats", "2"], "--repeats"),
        ("agent", ["--concurrency", "4"], "--concurrency"),
        ("serving", ["--quick", "--model", "tiny"], "--quick, --model"),
        ("serving", ["--prompts", "."], "--prompts"),
    ],
)
def test_options_a_workload_does_not_read_are_refused_in_one_line(
    tmp_path: Path, workload: str, options: list[str], named: str
) -> None:
    """The agent and serving workloads run the bundled model on questions of their own: an option
    they would ignore is a one-line error before anything starts, not a run that ignored it."""
    result = CliRunner().invoke(app, ["bench", "--workloads", workload, "--out", str(tmp_path / "out"), *options])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"sdcp: {named} does not apply to --workloads {workload}"]
    assert not (tmp_path / "out").exists()
