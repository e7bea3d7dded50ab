"""The benchmark's structured workload (#30): JSON schema prompts, decoded with the grammar on by SDCP's
target alone (the masked target, the baseline) and by its engines in process, whose output must be the
same; the report gives the engines' speedup over that baseline."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from sdcp.bench.inprocess import InProcessSDCPSystem
from sdcp.bench.report import markdown, summarise
from sdcp.bench.runner import STRUCTURED_SYSTEMS, BenchConfig, BenchData, ConcurrencyLevel, Measurement
from sdcp.bench.systems import RunResult, TargetOnlySDCPSystem
from sdcp.bench.workloads import STRUCTURED_WORKLOAD, BenchInputError, Workload, load_structured_workload
from sdcp.grammar import check
from sdcp.models.paths import TINY_NAME
from sdcp.models.registry import end_of_text_tokens, load_model
from sdcp.models.target import TargetModel
from sdcp.text import load_text_codec

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
        Measurement("sdcp_target_only", "open", 0, 0, run(10, 1.0)),
        Measurement("sdcp_inprocess", "open", 0, 0, run(10, 1.0)),
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
    assert summary["ratios"]["structured_vs_target_only"] == 2.0
    # Outputs are compared with the masked target's, prompt by prompt: the same tokens here.
    assert summary["identical_outputs"] is True
    # Like the history workloads, it stays out of "all" and of the goals' "every workload".
    assert summary["systems"]["sdcp_inprocess"]["all"]["tokens"] == 10
    assert list(summary["default_vs_target"]) == ["open"]
    assert "| structured_vs_target_only | 2.0 |" in markdown(summary)
