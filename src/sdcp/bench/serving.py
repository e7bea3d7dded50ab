"""The ``serving`` workload (issue #38): what a chat user sends an OpenAI endpoint, against
llama-server on the same GGUF and threads.

Systems: ``sdcp`` (the default `sdcp up` cluster: one process on the CPU), ``sdcp_processes`` (`sdcp
up --processes`, a process each) and ``llama_server``. Short everyday questions
(``prompts/serving.txt``, held out: nothing is tuned on them), each a streamed greedy chat
completion of ``max_tokens`` tokens, at 1, 4 and 16 streams at once (``STREAMS``): at a level of N
streams, N clients each send ``PER_STREAM[N]`` questions one after another. Each level has questions
of its own, the same for every system, so that no system answers from a prompt it cached at an
earlier level (llama-server's slots keep whole prompts; asked again, it evaluates one token). The
systems take turns level by level, the order rotating, so that none always runs on a warmer or
cooler machine; at one stream they take turns question by question (``level_turns``), so that the
machine's drift over a level's minute (a tenth and more here) does not fall on one system's
questions. llama-server runs with 16 slots (``--parallel 16``), as a user serving up to 16 streams
starts it. With ``repeats``, the whole workload runs again on clusters and a llama-server started
afresh (the same questions asked of servers that never saw them), the order rotated once more; each
figure is the median over the runs, and each ratio the median of the runs' own ratios (a machine
whose speed drifts by a quarter within an hour moved one run's ratios by as much as what was left to
gain: docs/performance.md, session 32).

Before its levels each server started for a run answers one warm-up request, not measured in them
(a question of no level): what a server does once after it starts (the first prefill's cold caches,
the router's first measurement of a drafter) is not what its users meet while it runs. Its first
token's time is reported apart, as the cold first request.

Figures per system and level: a cluster's first-token latency by part (sdcp.latency: mean ms over the
level, from its roles' metrics), time to first token p50 and p99 (from sending the request to the
first chunk with text), aggregate tokens/s (completion tokens over the level's wall time) and tokens/s
per stream after its first token. Rule 1 (issue #38, item 6): per question, whether the default
cluster's one-stream text equals llama-server's, and where not, the token where they part and
llama-server's margin there (its top logprob over the runner-up's, from a non-streamed request with
``top_logprobs``).
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdcp.bench.llama_server import LlamaServer, llama_server_binary, start_bench_llama_server
from sdcp.bench.streamed import (
    BENCH_MODEL,
    TURN_TIMEOUT_S,
    Turn,
    chat_request,
    first_token_parts,
    part_means_ms,
    percentile,
    start_default_cluster,
    stream_chat,
)
from sdcp.bench.workloads import DEFAULT_PROMPTS_DIR, BenchInputError, parse_prompts, rotated
from sdcp.cluster import LocalCluster
from sdcp.models.weights.fetch import fetch_smollm2
from sdcp.threads import usable_cores

__all__ = [
    "LLAMA_SERVER",
    "SDCP",
    "STREAMS",
    "ServingConfig",
    "LevelTurn",
    "joined",
    "level_questions",
    "level_turns",
    "Parting",
    "parting",
    "run_serving_bench",
    "serving_figures",
    "serving_markdown",
]

SERVING_FILE = "serving.txt"
SDCP = "sdcp"
SDCP_PROCESSES = "sdcp_processes"
LLAMA_SERVER = "llama_server"
STREAMS = (1, 4, 16)
# Questions each stream asks one after another, by level: a level takes 8 to 32 questions.
PER_STREAM = {1: 8, 4: 4, 16: 2}
_DEFAULT_PER_STREAM = 2
_SLOTS = 16
_SLOT_CONTEXT = 1024
# The warm-up request each server answers before a run's levels (module doc).
WARM_UP_QUESTION = "Hello! Who are you, in two sentences?"
WARM_UP_TOKENS = 32


@dataclass(frozen=True)
class ServingConfig:
    out: Path
    max_tokens: int = 96
    per_stream: int | None = None
    streams: tuple[int, ...] = STREAMS
    llama_server: Path | None = None
    systems: tuple[str, ...] = (SDCP, SDCP_PROCESSES, LLAMA_SERVER)
    repeats: int = 1


@dataclass
class Level:
    streams: int
    seconds: float
    turns: list[Turn] = field(default_factory=list)
    # The cluster's first-token latency parts over the level, mean ms by part (sdcp.latency).
    first_token_parts_ms: dict[str, float] = field(default_factory=dict)


def load_questions(prompts_dir: Path = DEFAULT_PROMPTS_DIR) -> tuple[str, ...]:
    path = prompts_dir / SERVING_FILE
    try:
        questions = parse_prompts(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchInputError(f"{path}: {exc.strerror or exc}") from exc
    if not questions:
        raise BenchInputError(f"{path} holds no question")
    return questions


def level_questions(
    questions: tuple[str, ...], streams: tuple[int, ...], per_stream: int | None = None
) -> list[tuple[str, ...]]:
    """The questions of each level, none asked at two levels."""
    taken, sets = 0, []
    for count in streams:
        wanted = count * (per_stream or PER_STREAM.get(count, _DEFAULT_PER_STREAM))
        if taken + wanted > len(questions):
            raise BenchInputError(
                f"serving workload: {len(questions)} questions, the levels {list(streams)} need {taken + wanted}"
            )
        sets.append(questions[taken : taken + wanted])
        taken += wanted
    return sets


@dataclass(frozen=True)
class LevelTurn:
    """A part of a level one system runs at once: its questions, the first the level's ``first``-th."""

    system: str
    first: int
    questions: tuple[str, ...]


def level_turns(systems: list[str], questions: tuple[str, ...], streams: int, first_system: int) -> list[LevelTurn]:
    """The order in which ``systems`` run a level, ``first_system`` first: each the whole level in
    turn, but at one stream question by question, the order rotating at each, so that each system's
    answers and the other's interleave within seconds."""

    if streams > 1:
        return [LevelTurn(system, 0, questions) for system in rotated(systems, first_system)]
    return [
        LevelTurn(system, index, (question,))
        for index, question in enumerate(questions)
        for system in rotated(systems, first_system + index)
    ]


def joined(streams: int, parts: list[Level]) -> Level:
    """One level of a system's ``parts`` (its turns of it): their turns, and the time they took."""
    return Level(streams, sum(part.seconds for part in parts), [turn for part in parts for turn in part.turns])


def run_level(url: str, questions: tuple[str, ...], streams: int, max_tokens: int, *, first: int = 0) -> Level:
    """``streams`` clients at once, each asking every ``streams``-th question in turn; ``first``: the
    level's index of the first question (its turn's label)."""

    turns: list[Turn | None] = [None] * len(questions)

    def client(offset: int) -> None:
        for index in range(offset, len(questions), streams):
            turn = stream_chat(url, BENCH_MODEL, [{"role": "user", "content": questions[index]}], max_tokens)
            turn.label = f"question {first + index + 1}"
            turns[index] = turn

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        list(pool.map(client, range(streams)))
    seconds = time.perf_counter() - started
    return Level(streams, seconds, [turn for turn in turns if turn is not None])


def serving_figures(level: Level) -> dict[str, Any]:
    first = [turn.first_token_ms for turn in level.turns if turn.first_token_ms is not None]
    tokens = sum(turn.completion_tokens or 0 for turn in level.turns)
    after_first = [
        (turn.completion_tokens - 1) / (turn.seconds - turn.first_token_ms / 1000)
        for turn in level.turns
        if turn.completion_tokens and turn.completion_tokens > 1 and turn.first_token_ms is not None
    ]
    return {
        "streams": level.streams,
        "requests": len(level.turns),
        "first_token_ms_p50": statistics.median(first) if first else None,
        "first_token_ms_p99": percentile(first, 0.99),
        "aggregate_tokens_per_s": tokens / level.seconds if level.seconds > 0 else None,
        "stream_tokens_per_s_p50": statistics.median(after_first) if after_first else None,
        "completion_tokens": tokens,
        "seconds": level.seconds,
        "first_token_parts_ms": level.first_token_parts_ms,
    }


@dataclass(frozen=True)
class Parting:
    """Where one text leaves llama-server's: llama-server's token index and text there, and its margin
    (top logprob minus the runner-up's; a small one is a near tie that arithmetic order decides)."""

    token: int
    expected: str
    margin: float | None


def parting(text: str, reference: list[dict[str, Any]]) -> Parting | None:
    """Where ``text`` stops following ``reference`` (llama-server's logprobs content, token by token);
    None where it follows it to the end of either."""
    offset = 0
    for index, entry in enumerate(reference):
        piece = str(entry.get("token", ""))
        if text[offset : offset + len(piece)] != piece:
            if offset >= len(text):
                return None
            top = sorted((float(alt["logprob"]) for alt in entry.get("top_logprobs") or []), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else None
            return Parting(index, piece, margin)
        offset += len(piece)
    return None


def _reference(url: str, question: str, max_tokens: int) -> list[dict[str, Any]]:
    body = {
        "model": BENCH_MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with urllib.request.urlopen(chat_request(url, body), timeout=TURN_TIMEOUT_S) as response:  # noqa: S310 - loopback
        answer = json.loads(response.read())
    content = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("content") or []
    return list(content)


def run_serving_bench(config: ServingConfig, log: Callable[[str], None]) -> dict[str, Any]:
    """Run every system at every level, ``config.repeats`` times; write serving.json and serving.md
    under ``config.out``."""
    unknown = set(config.systems) - {SDCP, SDCP_PROCESSES, LLAMA_SERVER}
    if unknown:
        raise BenchInputError(f"serving workload: unknown systems {sorted(unknown)}")
    if any(streams < 1 for streams in config.streams):
        raise BenchInputError("serving workload: stream counts must be at least 1")
    if config.repeats < 1:
        raise BenchInputError("serving workload: repeats must be at least 1")
    asked = level_questions(load_questions(), config.streams, config.per_stream)
    fetch_smollm2()
    config.out.mkdir(parents=True, exist_ok=True)
    binary = llama_server_binary(config.llama_server, log) if LLAMA_SERVER in config.systems else None
    runs: list[dict[str, list[Level]]] = []
    agreement: list[dict[str, Any]] = []
    cold: dict[str, list[float]] = {}
    for repeat in range(config.repeats):
        if config.repeats > 1:
            log(f"run {repeat + 1} of {config.repeats}")
        runs.append(_serving_run(config, asked, binary, repeat, log, cold, agreement if repeat == 0 else None))
    results = serving_results(config, runs, agreement, cold)
    (config.out / "serving.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (config.out / "serving.md").write_text(serving_markdown(results), encoding="utf-8")
    return results


def _serving_run(
    config: ServingConfig,
    asked: list[tuple[str, ...]],
    binary: Path | None,
    repeat: int,
    log: Callable[[str], None],
    cold: dict[str, list[float]],
    agreement: list[dict[str, Any]] | None,
) -> dict[str, list[Level]]:
    """One run of every system at every level, on clusters and a llama-server started for it, each
    after its warm-up request (its first token's ms appended to ``cold``); where ``agreement`` is
    given, each one-stream answer of the default cluster is compared with llama-server's greedy
    output into it."""
    clusters: dict[str, LocalCluster] = {}
    server: LlamaServer | None = None
    urls: dict[str, str] = {}
    levels: dict[str, list[Level]] = {}
    try:
        for name in (SDCP, SDCP_PROCESSES):
            if name in config.systems:
                log(f"starting {name}")
                one_process = False if name == SDCP_PROCESSES else None
                started = start_default_cluster(config.out / name, one_process=one_process)
                clusters[name], urls[name] = started.cluster, started.gateway

        if binary is not None:
            log("starting llama_server")
            server = start_bench_llama_server(binary, config.out, slots=_SLOTS, context=_SLOT_CONTEXT)
            urls[LLAMA_SERVER] = server.url
        names = list(urls)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            warm_up = stream_chat(
                urls[name], BENCH_MODEL, [{"role": "user", "content": WARM_UP_QUESTION}], WARM_UP_TOKENS
            )
            if warm_up.first_token_ms is not None:
                cold.setdefault(name, []).append(warm_up.first_token_ms)
            log(f"{name:>14} warm-up: first token {warm_up.first_token_ms or 0:7.0f} ms")
        for number, (streams, questions) in enumerate(zip(config.streams, asked, strict=True)):
            # Each cluster's metrics count its own requests alone: read around the whole level.
            before = {name: first_token_parts(cluster) for name, cluster in clusters.items()}
            parts: dict[str, list[Level]] = {name: [] for name in names}
            for part in level_turns(names, questions, streams, number + repeat):
                parts[part.system].append(
                    run_level(urls[part.system], part.questions, streams, config.max_tokens, first=part.first)
                )
            for name in names:
                level = joined(streams, parts[name])
                cluster = clusters.get(name)
                if cluster is not None:
                    level.first_token_parts_ms = part_means_ms(before[name], first_token_parts(cluster))
                levels.setdefault(name, []).append(level)
                figures = serving_figures(level)
                log(f"{name:>14} {streams:>2} streams: first token p50 {figures['first_token_ms_p50'] or 0:7.0f} ms, "
                    f"{figures['aggregate_tokens_per_s'] or 0:6.1f} tokens/s")  # fmt: skip
        if agreement is not None and SDCP in levels and LLAMA_SERVER in urls:
            first = min(range(len(config.streams)), key=lambda index: config.streams[index])
            for question, turn in zip(asked[first], levels[SDCP][first].turns, strict=True):
                where = parting(turn.text, _reference(urls[LLAMA_SERVER], question, config.max_tokens))
                agreement.append({"question": question, "same": where is None, "parting": where and asdict(where)})
    finally:
        if server is not None:
            server.__exit__(None, None, None)
        for cluster in clusters.values():
            cluster.down()
    return levels


def serving_results(
    config: ServingConfig,
    runs: list[dict[str, list[Level]]],
    agreement: list[dict[str, Any]],
    cold: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """Each system's figures by level, the median over ``runs`` (each run's own beside them where
    there are several), each sdcp system over llama-server, the median of the runs' ratios, and
    each system's cold first request (its warm-up's first token, ms, run by run)."""
    names = list(runs[0])
    # Each system's figures, run by run and level by level.
    figures = {name: [[serving_figures(level) for level in run[name]] for run in runs] for name in names}
    systems: dict[str, dict[str, Any]] = {}
    for name in names:
        by_run = figures[name]
        system: dict[str, Any] = {
            "levels": [_median_figures(list(same_level)) for same_level in zip(*by_run, strict=True)],
            "turns": {level.streams: [asdict(turn) for turn in level.turns] for level in runs[0][name]},
        }
        if len(runs) > 1:
            system["runs"] = by_run
        systems[name] = system
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    by_run_ratios: dict[str, dict[str, dict[str, list[float]]]] = {}
    for ours_name in (SDCP, SDCP_PROCESSES):
        if ours_name not in names or LLAMA_SERVER not in names:
            continue
        for ours_run, theirs_run in zip(figures[ours_name], figures[LLAMA_SERVER], strict=True):
            for ours, theirs in zip(ours_run, theirs_run, strict=True):
                pairs = by_run_ratios.setdefault(ours_name, {}).setdefault(str(ours["streams"]), {})
                if ours["first_token_ms_p50"] and theirs["first_token_ms_p50"]:
                    pairs.setdefault("first_token_p50_over_llama_server", []).append(
                        ours["first_token_ms_p50"] / theirs["first_token_ms_p50"]
                    )
                if ours["aggregate_tokens_per_s"] and theirs["aggregate_tokens_per_s"]:
                    pairs.setdefault("tokens_per_s_over_llama_server", []).append(
                        ours["aggregate_tokens_per_s"] / theirs["aggregate_tokens_per_s"]
                    )
        ratios[ours_name] = {
            streams: {key: statistics.median(values) for key, values in pairs.items()}
            for streams, pairs in by_run_ratios.get(ours_name, {}).items()
        }
    results: dict[str, Any] = {
        "workload": "serving",
        "max_tokens": config.max_tokens,
        "threads": usable_cores(),
        "repeats": len(runs),
        "ratios": ratios,
        "same_as_llama_server": agreement,
        "systems": systems,
        "cold_first_token_ms": cold or {},
    }
    if len(runs) > 1:
        results["ratios_by_run"] = by_run_ratios
    return results


def _median_figures(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's figures over several runs: each number the median of the runs' (the first-token
    parts too, part by part); one run's as they are."""
    if len(figures) == 1:
        return figures[0]
    merged: dict[str, Any] = {}
    for key, value in figures[0].items():
        values = [one[key] for one in figures]
        if key in ("streams", "requests"):
            merged[key] = value
        elif key == "first_token_parts_ms":
            parts = dict.fromkeys(part for one in values for part in one)
            merged[key] = {part: statistics.median(one[part] for one in values if part in one) for part in parts}
        elif isinstance(value, int | float) and all(isinstance(one, int | float) for one in values):
            merged[key] = statistics.median(values)
        else:
            merged[key] = value
    return merged


def serving_markdown(results: dict[str, Any]) -> str:
    lines = [
        "# serving workload",
        "",
        f"Streamed greedy chat, max_tokens {results['max_tokens']}, {results['threads']} threads; "
        "llama-server with 16 slots; each level asks questions of its own"
        + (
            f"; the median of {results['repeats']} runs, each on servers started afresh."
            if results.get("repeats", 1) > 1
            else "."
        ),
        "",
        "| system | streams | first token p50 (ms) | p99 | aggregate tokens/s | per stream tokens/s p50 |",
        "|---|---|---|---|---|---|",
    ]
    for name, system in results["systems"].items():
        for figures in system["levels"]:
            cells = [
                figures["first_token_ms_p50"],
                figures["first_token_ms_p99"],
                figures["aggregate_tokens_per_s"],
                figures["stream_tokens_per_s_p50"],
            ]
            shown = ["-" if value is None else f"{value:.1f}" if index > 1 else f"{value:.0f}"
                     for index, value in enumerate(cells)]  # fmt: skip
            lines.append(f"| {name} | {figures['streams']} | {' | '.join(shown)} |")
    lines.append("")
    by_run = results.get("ratios_by_run", {})
    for system, by_streams in results["ratios"].items():
        for streams, pair in by_streams.items():
            ratios = ", ".join(
                f"{key.replace('_', ' ')} {value:.2f}" + _runs_shown(by_run.get(system, {}).get(streams, {}).get(key))
                for key, value in pair.items()
            )
            lines.append(f"- {system}, {streams} streams: {ratios}")
    cold = results.get("cold_first_token_ms") or {}
    if cold:
        firsts = "; ".join(
            f"{name} {statistics.median(values):.0f}" + _runs_shown(values, "{:.0f}")
            for name, values in cold.items()
            if values
        )
        lines.append(f"- cold first request (each server's warm-up, not in the levels), first token ms: {firsts}")
    for name, system in results["systems"].items():
        for figures in system["levels"]:
            parts = figures.get("first_token_parts_ms")
            if parts:
                by_part = ", ".join(f"{part} {ms:.1f}" for part, ms in parts.items())
                lines.append(f"- {name}, {figures['streams']} streams, first token by part (mean ms): {by_part}")
    agreement = results["same_as_llama_server"]
    if agreement:
        same = sum(1 for entry in agreement if entry["same"])
        lines.append(f"- one-stream outputs equal to llama-server's greedy output: {same} of {len(agreement)}")
        for entry in agreement:
            where = entry["parting"]
            if where:
                margin = "-" if where["margin"] is None else f"{where['margin']:.3f}"
                lines.append(
                    f"  - {entry['question']!r}: parts at token {where['token']} "
                    f"(llama-server: {where['expected']!r}, margin {margin})"
                )
    return "\n".join(lines) + "\n"


def _runs_shown(values: list[float] | None, form: str = "{:.2f}") -> str:
    """Each run's value after a median of several, as " (runs 0.86, 0.92, 0.88)"."""
    if not values or len(values) < 2:
        return ""
    return " (runs " + ", ".join(form.format(value) for value in values) + ")"
