"""The benchmark's structured workload (#30): JSON schema prompts, decoded with the grammar on by SDCP's
target alone (the masked target, the baseline) and by its engines in process and its clusters (the
default one through the gateway, the schema as response_format), whose outputs must be the same; the
report gives their speedup over that baseline."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from sdcp.bench.cluster import gateway_request
from sdcp.bench.inprocess import InProcessSDCPSystem
from sdcp.bench.report import markdown, summarise
from sdcp.bench.runner import STRUCTURED_SYSTEMS, BenchConfig, BenchData, ConcurrencyLevel, Measurement
from sdcp.bench.systems import RunResult, TargetOnlySDCPSystem
from sdcp.bench.workloads import STRUCTURED_WORKLOAD, BenchInputError, Prompt, Workload, load_structured_workload
from sdcp.cli import app
from sdcp.frontend.openai_api import parse_generation
from sdcp.frontend.text import load_text_codec
from sdcp.grammar import check
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import end_of_text_tokens, load_model
from sdcp.models.weights.paths import TINY_NAME
from sdcp.protocol.messages import Constraint

# Bounded: the tiny random model's answer ends within max_new.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["alpha", "beta"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "size", "ok"],
    "additionalProperties": False,
}


def test_the_shipped_structured_prompts_carry_schemas_the_grammar_engine_compiles() -> None:
    workload = load_structured_workload()
    assert workload is not None and workload.name == STRUCTURED_WORKLOAD
    assert len(workload.prompts) >= 8 and len(workload.schemas) == len(workload.prompts)
    for index, prompt in enumerate(workload.prompts):
        constraint = workload.constraint_at(index)
        assert constraint is not None and constraint.kind == "json_schema"
        check(constraint)
        assert not prompt.startswith("{")
    limited = load_structured_workload(per_workload=2)
    assert limited is not None and limited.prompts == workload.prompts[:2]


def test_a_structured_prompt_without_a_schema_line_is_a_typed_error(tmp_path: Path) -> None:
    assert load_structured_workload(tmp_path) is None
    (tmp_path / "structured.txt").write_text("Give me JSON.\n", encoding="utf-8")
    with pytest.raises(BenchInputError, match="no JSON schema"):
        load_structured_workload(tmp_path)
    (tmp_path / "structured.txt").write_text('{"type": "object"}\n', encoding="utf-8")
    with pytest.raises(BenchInputError, match="no text"):
        load_structured_workload(tmp_path)


async def test_the_engines_decode_structured_output_as_the_masked_target_alone() -> None:
    loaded = load_model(TINY_NAME)
    target = TargetModel(loaded.model, loaded.tokenizer, name=loaded.name)
    stop = end_of_text_tokens(loaded.tokenizer)
    constraint = Workload(STRUCTURED_WORKLOAD, ("p",), schemas=(json.dumps(SCHEMA),)).constraint_at(0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    baseline = TargetOnlySDCPSystem(target, stop).generate(prompt, 96, constraint)
    assert baseline.tokens[-1] in stop
    jsonschema.validate(json.loads(load_text_codec(TINY_NAME).decode(baseline.tokens[:-1])), SCHEMA)
    system = InProcessSDCPSystem(target, stop)
    await system.start()
    try:
        result = await system.generate(prompt, 96, constraint=constraint)
    finally:
        await system.aclose()
    # Rule 1: the masked target's greedy decoding, whoever drafted.
    assert result.tokens == baseline.tokens
    # The grammar's forced tokens (keys, punctuation) come several to a target pass (a batch the
    # verifier ran for the session; one token a pass for the baseline).
    assert len(result.batch_sizes) < len(result.tokens)


def test_the_report_gives_the_structured_speedup_over_the_masked_target_alone() -> None:
    def run(tokens: int, seconds: float) -> RunResult:
        return RunResult(tokens=list(range(tokens)), seconds=seconds, overhead_ms=[1.0])

    measurements = [
        Measurement("sdcp_target_only", STRUCTURED_WORKLOAD, 0, 0, run(30, 3.0)),
        Measurement("sdcp_inprocess", STRUCTURED_WORKLOAD, 0, 0, run(30, 1.5)),
        Measurement("sdcp_e2e", STRUCTURED_WORKLOAD, 0, 0, run(30, 2.0)),
        Measurement("sdcp_default", STRUCTURED_WORKLOAD, 0, 0, run(30, 1.0)),
        *(Measurement(system, "open", 0, 0, run(10, 1.0)) for system in STRUCTURED_SYSTEMS),
    ]
    data = BenchData(
        config=BenchConfig(out=Path("unused")),
        workloads=[Workload("open", ("p",)), Workload(STRUCTURED_WORKLOAD, ("q",), schemas=("{}",))],
        measurements=measurements,
        concurrency=[ConcurrencyLevel(1, 10, 1.0)],
        systems=list(STRUCTURED_SYSTEMS),
        seconds=1.0,
    )
    summary = summarise(data)
    # What a user runs (the default cluster through the gateway) gives the figure; the others too.
    assert summary["ratios"]["structured_vs_target_only"] == 3.0
    assert summary["ratios"]["structured_e2e_vs_target_only"] == 1.5
    assert summary["ratios"]["structured_inprocess_vs_target_only"] == 2.0
    # Outputs are compared with the masked target's, prompt by prompt: the same tokens here.
    assert summary["identical_outputs"] is True
    # Like the history workloads, it stays out of "all" and of the goals' "every workload".
    assert summary["systems"]["sdcp_inprocess"]["all"]["tokens"] == 10
    assert list(summary["default_vs_target"]) == ["open"]
    assert "| structured_vs_target_only | 3.0 |" in markdown(summary)


@pytest.mark.parametrize(
    ("constraint", "member"),
    [
        (Constraint(kind="choice", text='["yes", "no"]'), {"guided_choice": ["yes", "no"]}),
        (Constraint(kind="regex", text="[0-9]{3}"), {"guided_regex": "[0-9]{3}"}),
        (Constraint(kind="lark", text='start: "a" | "b"'), {"guided_grammar": 'start: "a" | "b"'}),
    ],
)
def test_the_gateway_request_names_other_constraints_by_vllms_members(
    constraint: Constraint, member: dict[str, object]
) -> None:
    request = gateway_request("smollm2", Prompt("p", (1,), constraint=constraint), 16, chat=False)
    assert request == {"model": "smollm2", "max_tokens": 16, "temperature": 0, "stream": True, "prompt": "p", **member}


def test_the_gateway_takes_each_structured_prompt_as_its_schema_under_rule_1() -> None:
    """The default cluster is sent each prompt's schema as a user sends it (response_format); the
    gateway makes it the session's constraint, the one the masked target alone decodes under."""
    workload = load_structured_workload()
    assert workload is not None
    codec = load_text_codec("smollm2")
    for index, text in enumerate(workload.prompts):
        constraint = workload.constraint_at(index)
        assert constraint is not None
        request = gateway_request("smollm2", Prompt(text, (1,), constraint=constraint), 128, chat=True)
        assert request["response_format"]["type"] == "json_schema"
        assert request["messages"] == [{"role": "user", "content": text}]
        generation = parse_generation(request, codec, served=("smollm2",), chat=True)
        assert generation.rule == 1 and generation.sampling is None and generation.ignored == ()
        assert generation.constraint is not None and generation.constraint.kind == "json_schema"
        assert json.loads(generation.constraint.text) == json.loads(constraint.text)
    plain = gateway_request("smollm2", Prompt("p", (1,)), 16, chat=True)
    assert not {"response_format", "guided_choice", "guided_regex", "guided_grammar"} & plain.keys()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--workloads", "structured,nonesuch"], "no workload nonesuch"),
        (["--systems", "sdcp_default,nonesuch"], "no system nonesuch"),
        (["--systems", "sdcp_default"], "sdcp_target_only must run"),
        (["--workloads", ","], "name at least one workload"),
    ],
)
def test_a_bench_selection_naming_no_workload_or_system_or_without_the_reference_is_refused(
    tmp_path: Path, options: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["bench", "--model", "tiny", "--out", str(tmp_path / "out"), *options])
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(240)
def test_the_structured_workload_alone_on_the_default_cluster_against_the_masked_target(tmp_path: Path) -> None:
    """`sdcp bench --workloads structured --systems sdcp_target_only,sdcp_default`: the gateway's
    outputs are the masked target's, token for token, and results.json gives the speedup; nothing
    else runs (no other system, no concurrency sweep, no noisy neighbour)."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name in ("repetitive", "nonrepetitive", "mixed", "copyedit", "open"):
        (prompts / f"{name}.txt").write_text("unused\n", encoding="utf-8")
    (prompts / "structured.txt").write_text(
        f"{json.dumps(SCHEMA)}\ndescribe a thing as JSON\n---\n{json.dumps(SCHEMA)}\nand another\n", encoding="utf-8"
    )
    out = tmp_path / "out"
    options = ["--prompts", str(prompts), "--max-new", "96", "--repeats", "1", "--no-redis"]
    selection = ["--workloads", "structured", "--systems", "sdcp_target_only,sdcp_default"]
    result = CliRunner().invoke(app, ["bench", "--model", "tiny", "--out", str(out), *options, *selection])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(summary["systems"]) == ["sdcp_target_only", "sdcp_default"]
    assert summary["prompts"] == {STRUCTURED_WORKLOAD: 2}
    assert summary["identical_outputs"] is True and summary["mismatches"] == []
    assert isinstance(summary["ratios"]["structured_vs_target_only"], float)
    assert summary["ratios"]["structured_e2e_vs_target_only"] is None
    assert summary["concurrency"] == [] and summary["noisy_neighbour"] == {}
    # Each prompt ran to the end of its JSON (the tiny target is fast enough that the router
    # self-decodes it: who served is the policy's choice, the output is the same either way).
    assert summary["systems"]["sdcp_default"][STRUCTURED_WORKLOAD]["tokens"] > 8
    rows = summary["default_per_prompt"]
    assert [(row["workload"], row["prompt"]) for row in rows] == [(STRUCTURED_WORKLOAD, 0), (STRUCTURED_WORKLOAD, 1)]
    assert all(row["served"] for row in rows)
