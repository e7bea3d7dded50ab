"""The agent workload's inputs, requests and report (sdcp.bench.agent), and llama-server's binary
given by path (sdcp.bench.llama_server); the runs themselves are `sdcp bench --workloads agent`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdcp.bench.agent import (
    LLAMA_SERVER,
    SDCP,
    SDCP_NO_CACHE,
    AgentConfig,
    SystemRun,
    agent_markdown,
    agent_requests,
    chat_messages,
    load_agent_workload,
    results_of,
)
from sdcp.bench.llama_server import llama_server_binary
from sdcp.bench.streamed import Turn
from sdcp.bench.workloads import BenchInputError
from sdcp.home import sdcp_home
from sdcp.models.registry import load_tokenizer
from sdcp.models.weights.fetch import fetch_smollm2


def test_the_shipped_workload_is_an_agents_long_prefix_and_short_turns() -> None:
    workload = load_agent_workload()
    fetch_smollm2(sdcp_home())
    system_tokens = len(load_tokenizer("smollm2")(workload.system)["input_ids"])
    assert system_tokens > 2000 and workload.system.count('"type": "function"') == 12
    assert len(workload.turns) == 11 and all(len(turn) < 120 for turn in workload.turns)
    assert [len(conversation) for conversation in workload.conversations] == [4, 4]
    assert workload.followups


def test_requests_repeat_the_conversation_with_the_systems_own_answers() -> None:
    workload = load_agent_workload()
    requests = list(agent_requests(workload, turns=2))
    assert [r.label for r in requests[:3]] == ["turn 1", "turn 2", "conversation 1 turn 1"]
    third = requests[4]
    assert third.conversation == 0 and len(third.user_turns) == 3
    messages = chat_messages(workload.system, third.user_turns, ["first answer", "second answer"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[2]["content"] == "first answer" and messages[-1]["content"] == third.user_turns[-1]


def run_of(name: str, first_token_ms: list[float], texts: list[str]) -> SystemRun:
    run = SystemRun(name, "http://127.0.0.1:1/v1", "smollm2")
    run.turns = [
        Turn(f"turn {n}", ms, ms / 100, text) for n, (ms, text) in enumerate(zip(first_token_ms, texts, strict=True))
    ]
    return run


def test_the_report_compares_later_turns_and_outputs(tmp_path: Path) -> None:
    runs = [
        run_of(SDCP, [9000, 300, 330, 360], ["a", "b", "c", "d"]),
        run_of(SDCP_NO_CACHE, [9000, 9000, 9900, 10800], ["a", "b", "c", "d"]),
        run_of(LLAMA_SERVER, [5000, 200, 220, 240], ["a", "x", "y", "z"]),
    ]
    runs[0].prefix_cache = {"prefix_cache_queries_total": 1000, "prefix_cache_hits_total": 900}
    results = results_of(AgentConfig(out=tmp_path), runs)
    # The first request of each system finds every cache cold: it is left out of the figures.
    assert results["systems"][SDCP]["first_token_ms_p50"] == 330
    assert results["systems"][SDCP]["cold_first_token_ms"] == 9000
    assert results["ratios"]["first_token_p50_sdcp_over_llama_server"] == pytest.approx(1.5)
    assert results["ratios"]["first_token_p50_cache_off_over_on"] == pytest.approx(30)
    assert results["identical_with_and_without_prefix_cache"] is True
    assert results["systems"][SDCP]["prefix_hit_rate"] == pytest.approx(0.9)
    runs[1].turns[2].text = "other"
    assert results_of(AgentConfig(out=tmp_path), runs)["identical_with_and_without_prefix_cache"] is False
    assert "| sdcp | 330 |" in agent_markdown(results)
    json.dumps(results)


def test_a_llama_server_given_by_path_must_be_an_executable(tmp_path: Path) -> None:
    with pytest.raises(BenchInputError, match="not an executable"):
        llama_server_binary(tmp_path / "missing", print)
    plain = tmp_path / "llama-server"
    plain.write_text("not a program")
    with pytest.raises(BenchInputError, match="not an executable"):
        llama_server_binary(plain, print)
    plain.chmod(0o755)
    assert llama_server_binary(plain, print) == plain
