"""The ``agent`` workload (issue #37): what an agent sends an OpenAI endpoint, against llama-server on
the same GGUF and threads.

The requests (``prompts/agent.json``): a long system prompt describing twelve tools, then short user
turns, each a request of its own after that system prompt; then conversations whose every turn
repeats the one before with its answer (each system's own answer). Every request is a streamed chat
completion, greedy, ``max_tokens`` tokens, sent to each system in turn (the order rotates from one
request to the next), one request at a time.

Systems: ``sdcp`` (the default `sdcp up` cluster, through its gateway), ``sdcp_no_prefix_cache``
(the same with ``[verifier] prefix_cache_bytes = 0``) and ``llama_server`` (one slot, llama.cpp's
prompt cache on, as llama-server starts). Figures per system: time to first token (from sending the
request to the first chunk with text) and turn time, p50 and p99, over the later requests (all but
the first, which finds every cache cold); for sdcp, the verifier's prefix cache hit rate and bytes
held. sdcp's outputs with and without the prefix cache must be the same text (rule 1).

Then, on ``sdcp``: its verifier is restarted (its own prefix cache empty; what it computed before is
in the cluster's shared MLC tier) and asked one more turn, whose first token is compared with the
cold first turn's; and CONCURRENT conversations (each of the short turns, the workload's follow-ups
after it) run at once beside a busy core, then one at a time on the quiet machine: every request
must succeed and every answer be the same.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdcp.bench.llama_server import LlamaServer, llama_server_binary, start_bench_llama_server
from sdcp.bench.streamed import (
    BENCH_MODEL,
    TURN_TIMEOUT_S,
    Turn,
    metric_samples,
    percentile,
    start_default_cluster,
    stream_chat,
)
from sdcp.bench.workloads import DEFAULT_PROMPTS_DIR, BenchInputError
from sdcp.cluster import LocalCluster
from sdcp.models.weights.fetch import fetch_smollm2

__all__ = [
    "AgentConfig",
    "AgentWorkload",
    "SystemRun",
    "agent_markdown",
    "agent_requests",
    "chat_messages",
    "load_agent_workload",
    "results_of",
    "run_agent_bench",
]

AGENT_FILE = "agent.json"
SDCP = "sdcp"
SDCP_NO_CACHE = "sdcp_no_prefix_cache"
LLAMA_SERVER = "llama_server"
CONCURRENT = 16


@dataclass(frozen=True)
class AgentWorkload:
    system: str
    turns: tuple[str, ...]
    conversations: tuple[tuple[str, ...], ...]
    # Later turns of the concurrent conversations, after one of ``turns`` each.
    followups: tuple[str, ...] = ()


def load_agent_workload(prompts_dir: Path = DEFAULT_PROMPTS_DIR) -> AgentWorkload:
    path = prompts_dir / AGENT_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        workload = AgentWorkload(
            str(data["system"]),
            tuple(str(turn) for turn in data["turns"]),
            tuple(tuple(str(turn) for turn in conversation) for conversation in data["conversations"]),
            tuple(str(turn) for turn in data.get("followups", ())),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchInputError(f"{path}: not an agent workload ({exc})") from exc
    if not workload.system or not (workload.turns or workload.conversations):
        raise BenchInputError(f"{path}: an agent workload needs a system prompt and turns")
    return workload


@dataclass(frozen=True)
class AgentRequest:
    """One request: its label, and the user turns of its conversation so far (the last is new)."""

    label: str
    conversation: int | None
    user_turns: tuple[str, ...]


def agent_requests(workload: AgentWorkload, *, turns: int | None = None) -> Iterator[AgentRequest]:
    """The requests in order: the short turns (at most ``turns``), then each conversation turn by turn."""
    for number, turn in enumerate(workload.turns[:turns], start=1):
        yield AgentRequest(f"turn {number}", None, (turn,))
    for index, conversation in enumerate(workload.conversations):
        for length in range(1, len(conversation) + 1):
            yield AgentRequest(f"conversation {index + 1} turn {length}", index, conversation[:length])


def chat_messages(system: str, user_turns: tuple[str, ...], answers: list[str]) -> list[dict[str, str]]:
    """The system prompt, then each user turn followed by the system's own answer to it, if any."""
    messages = [{"role": "system", "content": system}]
    for number, turn in enumerate(user_turns):
        messages.append({"role": "user", "content": turn})
        if number < len(answers) and number < len(user_turns) - 1:
            messages.append({"role": "assistant", "content": answers[number]})
    return messages


@dataclass(frozen=True)
class AgentConfig:
    out: Path
    max_tokens: int = 96
    turns: int | None = None
    llama_server: Path | None = None
    systems: tuple[str, ...] = (SDCP, SDCP_NO_CACHE, LLAMA_SERVER)
    concurrent: int = CONCURRENT


@dataclass
class SystemRun:
    name: str
    url: str
    model: str
    turns: list[Turn] = field(default_factory=list)
    answers: dict[int, list[str]] = field(default_factory=dict)
    metrics_url: str | None = None
    prefix_cache: dict[str, float] = field(default_factory=dict)


def run_agent_bench(config: AgentConfig, log: Callable[[str], None]) -> dict[str, Any]:
    """Run every system on the agent workload; write agent.json and agent.md under ``config.out``."""
    workload = load_agent_workload()
    unknown = set(config.systems) - {SDCP, SDCP_NO_CACHE, LLAMA_SERVER}
    if unknown:
        raise BenchInputError(f"agent workload: unknown systems {sorted(unknown)}")
    fetch_smollm2()
    config.out.mkdir(parents=True, exist_ok=True)
    binary = llama_server_binary(config.llama_server, log) if LLAMA_SERVER in config.systems else None
    clusters: list[LocalCluster] = []
    runs: list[SystemRun] = []
    server: LlamaServer | None = None
    extra: dict[str, Any] = {}
    try:
        for name in (SDCP, SDCP_NO_CACHE):
            if name in config.systems:
                log(f"starting {name}")
                settings = {"verifier": {"prefix_cache_bytes": 0}} if name == SDCP_NO_CACHE else None
                started = start_default_cluster(config.out / name, settings)
                clusters.append(started.cluster)
                runs.append(SystemRun(name, started.gateway, BENCH_MODEL, metrics_url=started.verifier_metrics))
        if binary is not None:
            log("starting llama_server")
            server = start_bench_llama_server(binary, config.out, slots=1, context=4096)
            runs.append(SystemRun(LLAMA_SERVER, server.url, BENCH_MODEL))
        for index, request in enumerate(agent_requests(workload, turns=config.turns)):
            order = runs[index % len(runs) :] + runs[: index % len(runs)]
            for run in order:
                answers = run.answers.setdefault(request.conversation, []) if request.conversation is not None else []
                messages = chat_messages(workload.system, request.user_turns, answers)
                turn = stream_chat(run.url, run.model, messages, config.max_tokens)
                turn.label = request.label
                run.turns.append(turn)
                if request.conversation is not None:
                    answers.append(turn.text)
                log(f"{request.label:>24} {run.name:>22}: first token {turn.first_token_ms or 0:8.0f} ms, "
                    f"turn {turn.seconds:6.2f} s")  # fmt: skip
        for run in runs:
            if run.metrics_url is not None:
                run.prefix_cache = _prefix_cache_figures(run.metrics_url)
        if SDCP in config.systems:
            sdcp_run = next(run for run in runs if run.name == SDCP)
            extra["restarted_verifier"] = _restarted_verifier_turn(clusters[0], sdcp_run, workload, config, log)
            extra["concurrent"] = _concurrent_conversations(sdcp_run, workload, config, log)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
        for cluster in clusters:
            cluster.down()
    results = {**results_of(config, runs), **extra}
    (config.out / "agent.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (config.out / "agent.md").write_text(agent_markdown(results), encoding="utf-8")
    return results


def _restarted_verifier_turn(
    cluster: LocalCluster, run: SystemRun, workload: AgentWorkload, config: AgentConfig, log: Callable[[str], None]
) -> dict[str, Any]:
    """The verifier killed and started again (in one process, `sdcp up`'s default on the CPU, with
    every other instance): its first turn finds the prefix in the shared tier."""
    verifier = next(instance for instance in cluster.instances() if instance.role == "verifier")
    log("restarting sdcp's verifier")
    subprocess.run(["kill", "-9", str(verifier.pid)], check=True)  # noqa: S607 - the cluster's own process
    while verifier.alive():
        time.sleep(0.05)
    cluster.restart_stopped()
    # The router hears of the restarted verifier with its next status report.
    turn = _first_served_turn(run, workload, config)
    cold = run.turns[0].first_token_ms if run.turns else None
    log(f"restarted verifier: first token {turn.first_token_ms or 0:.0f} ms (cold: {cold or 0:.0f} ms)")
    figures = _prefix_cache_figures(run.metrics_url) if run.metrics_url else {}
    return {
        "first_token_ms": turn.first_token_ms,
        "cold_first_token_ms": cold,
        "cold_over_restarted": cold / turn.first_token_ms if cold and turn.first_token_ms else None,
        "shared_objects_used": figures.get("prefix_cache_shared_objects_used", 0.0),
    }


def _first_served_turn(run: SystemRun, workload: AgentWorkload, config: AgentConfig) -> Turn:
    messages = chat_messages(workload.system, (workload.turns[-1],), [])
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while True:
        try:
            return stream_chat(run.url, run.model, messages, config.max_tokens)
        except urllib.error.HTTPError as exc:
            # 503 until the router has the restarted verifier's first status report.
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _concurrent_conversations(
    run: SystemRun, workload: AgentWorkload, config: AgentConfig, log: Callable[[str], None]
) -> dict[str, Any]:
    """CONCURRENT conversations at once beside a busy core, then alone on the quiet machine."""
    openers = [workload.turns[index % len(workload.turns)] for index in range(config.concurrent)]

    def converse(opener: str) -> list[Turn]:
        answers: list[str] = []
        turns = []
        user_turns: tuple[str, ...] = ()
        for text in (opener, *workload.followups):
            user_turns = (*user_turns, text)
            turn = stream_chat(
                run.url, run.model, chat_messages(workload.system, user_turns, answers), config.max_tokens
            )
            answers.append(turn.text)
            turns.append(turn)
        return turns

    async def at_once() -> list[list[Turn] | BaseException]:
        return await asyncio.gather(
            *(asyncio.to_thread(converse, opener) for opener in openers), return_exceptions=True
        )

    log(f"{config.concurrent} conversations at once beside a busy core")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # noqa: S603 - our interpreter
    try:
        busy = asyncio.run(at_once())
    finally:
        burner.kill()
        burner.wait()
    failed = [outcome for outcome in busy if isinstance(outcome, BaseException)]
    log(f"the same conversations one at a time ({len(failed)} failed at once)")
    quiet = [converse(opener) for opener in openers]
    same = sum(
        1
        for outcome, alone in zip(busy, quiet, strict=True)
        if not isinstance(outcome, BaseException) and [t.text for t in outcome] == [t.text for t in alone]
    )
    first = [t.first_token_ms for o in busy if not isinstance(o, BaseException) for t in o if t.first_token_ms]
    return {
        "conversations": config.concurrent,
        "requests": config.concurrent * (1 + len(workload.followups)),
        "failed_conversations": len(failed),
        "failures": [repr(error)[:300] for error in failed],
        "identical_to_quiet": same,
        "first_token_ms_p50": statistics.median(first) if first else None,
        "first_token_ms_p99": percentile(first, 0.99),
    }


def _prefix_cache_figures(metrics_url: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for sample in metric_samples(metrics_url):
        name = sample.name.removeprefix("sdcp:")
        if name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_bytes"):
            figures[name] = figures.get(name, 0.0) + sample.value
        if name == "prefix_cache_shared_objects_total" and sample.labels.get("outcome") == "used":
            figures["prefix_cache_shared_objects_used"] = sample.value
    return figures


def results_of(config: AgentConfig, runs: list[SystemRun]) -> dict[str, Any]:
    systems: dict[str, Any] = {}
    for run in runs:
        later = run.turns[1:]
        first = [turn.first_token_ms for turn in later if turn.first_token_ms is not None]
        whole = [1000 * turn.seconds for turn in later]
        figures: dict[str, Any] = {
            "first_token_ms_p50": statistics.median(first) if first else None,
            "first_token_ms_p99": percentile(first, 0.99),
            "turn_ms_p50": statistics.median(whole) if whole else None,
            "turn_ms_p99": percentile(whole, 0.99),
            "cold_first_token_ms": run.turns[0].first_token_ms if run.turns else None,
            "turns": [asdict(turn) for turn in run.turns],
        }
        queries = run.prefix_cache.get("prefix_cache_queries_total")
        if queries:
            figures["prefix_hit_rate"] = run.prefix_cache.get("prefix_cache_hits_total", 0.0) / queries
            figures["prefix_cache_bytes"] = run.prefix_cache.get("prefix_cache_bytes")
        systems[run.name] = figures
    texts = {run.name: [turn.text for turn in run.turns] for run in runs}
    identical = texts[SDCP] == texts[SDCP_NO_CACHE] if SDCP in texts and SDCP_NO_CACHE in texts else None
    return {
        "workload": "agent",
        "max_tokens": config.max_tokens,
        "requests": len(runs[0].turns) if runs else 0,
        "identical_with_and_without_prefix_cache": identical,
        "ratios": _ratios(systems),
        "systems": systems,
    }


def _ratios(systems: dict[str, Any]) -> dict[str, float]:
    def p50(name: str) -> float | None:
        value = systems.get(name, {}).get("first_token_ms_p50")
        return float(value) if value else None

    ratios = {}
    sdcp, llama, off = p50(SDCP), p50(LLAMA_SERVER), p50(SDCP_NO_CACHE)
    if sdcp and llama:
        ratios["first_token_p50_sdcp_over_llama_server"] = sdcp / llama
    if sdcp and off:
        ratios["first_token_p50_cache_off_over_on"] = off / sdcp
    return ratios


def agent_markdown(results: dict[str, Any]) -> str:
    lines = [
        "# agent workload",
        "",
        f"{results['requests']} streamed chat requests per system, greedy, max_tokens {results['max_tokens']}; "
        "figures over the later requests (all but the first).",
        "",
        "| system | first token p50 (ms) | p99 | turn p50 (ms) | p99 | cold first token (ms) | prefix hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, figures in results["systems"].items():
        rate = figures.get("prefix_hit_rate")
        cells = [
            figures["first_token_ms_p50"],
            figures["first_token_ms_p99"],
            figures["turn_ms_p50"],
            figures["turn_ms_p99"],
            figures["cold_first_token_ms"],
        ]
        shown = ["-" if value is None else f"{value:.0f}" for value in cells]
        lines.append(f"| {name} | {' | '.join(shown)} | {'-' if rate is None else f'{100 * rate:.0f} %'} |")
    lines.append("")
    for name, value in results["ratios"].items():
        lines.append(f"- {name.replace('_', ' ')}: {value:.2f}")
    identical = results["identical_with_and_without_prefix_cache"]
    if identical is not None:
        lines.append(f"- sdcp outputs identical with and without the prefix cache: {'yes' if identical else 'NO'}")
    restarted = results.get("restarted_verifier")
    if restarted and restarted.get("first_token_ms"):
        lines.append(
            f"- a restarted verifier's first turn (the prefix from the shared tier): first token "
            f"{restarted['first_token_ms']:.0f} ms against {restarted['cold_first_token_ms']:.0f} ms cold "
            f"({restarted['cold_over_restarted']:.1f}x lower; "
            f"{restarted['shared_objects_used']:.0f} shared objects used)"
        )
    concurrent = results.get("concurrent")
    if concurrent:
        lines.append(
            f"- {concurrent['conversations']} conversations at once beside a busy core ({concurrent['requests']} "
            f"requests): {concurrent['failed_conversations']} failed, "
            f"{concurrent['identical_to_quiet']} identical to a quiet run; "
            f"first token p50 {concurrent['first_token_ms_p50'] or 0:.0f} ms, "
            f"p99 {concurrent['first_token_ms_p99'] or 0:.0f} ms"
        )
    return "\n".join(lines) + "\n"
