"""results.json, results.md and the PNG plots of a benchmark run."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a server
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
import numpy as np  # noqa: E402

from sdcp.bench.runner import EXACT_SYSTEMS, BenchData, Measurement  # noqa: E402
from sdcp.bench.systems import RunResult  # noqa: E402
from sdcp.bench.workloads import CHAT_WORKLOADS, CORE_WORKLOADS, HISTORY_WORKLOADS, STRUCTURED_WORKLOAD  # noqa: E402

__all__ = ["GOALS", "summarise", "token_roles", "write_report"]

E2E = "sdcp_e2e"
DEFAULT = "sdcp_default"
HF_TARGET = "hf_target"
TARGET_ONLY = "sdcp_target_only"
LLAMACPP_TARGET = "llamacpp_target"
# Every system's speed is also given relative to these, per workload: plain greedy decoding in
# transformers and in llama.cpp, what a CPU user would otherwise run.
ANCHORS = (HF_TARGET, LLAMACPP_TARGET)
# name: (ratio or metric, comparison, threshold), from issues 7 and 14.
GOALS: dict[str, tuple[str, str, float]] = {
    "default >= 1.8x transformers greedy on copy/edit prompts": ("default_copyedit_vs_target", ">=", 1.8),
    "default >= 1.3x transformers greedy on open prompts": ("default_open_vs_target", ">=", 1.3),
    "default >= 1.0x transformers greedy on every workload": ("default_min_vs_target", ">=", 1.0),
    "default within 10% of the n-gram-only cluster on every workload": ("default_min_vs_ngram_only", ">=", 0.9),
    "repetitive >= 3.0x target-only": ("repetitive_vs_target", ">=", 3.0),
    "repetitive >= 1.0x transformers prompt lookup": ("repetitive_vs_hf_prompt_lookup", ">=", 1.0),
    "non-repetitive >= 0.95x target-only": ("nonrepetitive_vs_target", ">=", 0.95),
    "non-model time per round p50 <= 3 ms": ("overhead_ms_p50", "<=", 3.0),
    "e2e >= 0.9x in-process": ("e2e_vs_inprocess", ">=", 0.9),
    "16 sessions >= 4x one session": ("concurrency16_vs_1", ">=", 4.0),
    # Issue 27: against plain llama.cpp on the same GGUF, what a CPU user runs instead.
    "target-only >= 0.95x plain llama.cpp": ("target_only_vs_llamacpp", ">=", 0.95),
    "default >= 1.6x plain llama.cpp on copy/edit prompts": ("default_copyedit_vs_llamacpp", ">=", 1.6),
    "default >= 1.05x plain llama.cpp on open prompts": ("default_open_vs_llamacpp", ">=", 1.05),
    "default >= 1.0x plain llama.cpp on every workload": ("default_min_vs_llamacpp", ">=", 1.0),
    "default time to first token p50 <= 1.3x plain llama.cpp's": ("default_first_token_vs_llamacpp", "<=", 1.3),
}


def _rate(measurements: list[Measurement]) -> float | None:
    """Tokens per second over the runs; None when the system did not run them."""
    seconds = sum(m.result.seconds for m in measurements)
    return sum(len(m.result.tokens) for m in measurements) / seconds if seconds > 0 else None


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _outputs_by_run(data: BenchData) -> dict[tuple[str, int, int], dict[str, list[int]]]:
    """Every system's tokens per (workload, prompt, repeat)."""
    by_run: dict[tuple[str, int, int], dict[str, list[int]]] = defaultdict(dict)
    for m in data.measurements:
        by_run[(m.workload, m.prompt, m.repeat)][m.system] = m.result.tokens
    return by_run


def _compare(
    by_run: dict[tuple[str, int, int], dict[str, list[int]]], reference: str, systems: list[str]
) -> tuple[int, list[dict[str, Any]]]:
    """How many runs of ``systems`` were compared with ``reference``'s run of the same prompt and
    repeat, and where each differing one first differed."""
    mismatches = []
    compared = 0
    for (workload, prompt, repeat), outputs in sorted(by_run.items()):
        expected = outputs.get(reference)
        for system in systems:
            if system == reference or system not in outputs or expected is None:
                continue
            compared += 1
            tokens = outputs[system]
            if tokens != expected:
                first = next(
                    (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
                    min(len(tokens), len(expected)),
                )
                mismatches.append(
                    {
                        "system": system,
                        "workload": workload,
                        "prompt": prompt,
                        "repeat": repeat,
                        "first_difference": first,
                        "length": len(tokens),
                        "reference_length": len(expected),
                    }
                )
    return compared, mismatches


def _identical(data: BenchData) -> tuple[bool, list[dict[str, Any]]]:
    """Compare the exact systems' tokens with SDCP's target-only decoding (its backend's greedy
    decoding), prompt by prompt, repeat by repeat; transformers' too where that backend is torch."""
    exact = [system for system in EXACT_SYSTEMS if system != HF_TARGET or data.backend == "torch"]
    compared, mismatches = _compare(_outputs_by_run(data), TARGET_ONLY, exact)
    return compared > 0 and not mismatches, mismatches


def _same_as_llamacpp(data: BenchData) -> dict[str, Any]:
    """Per system: of the prompts it shares with ``llamacpp_target``, how many it decoded to the same
    tokens in every repeat, and where the others first differed. Not a failure: llama.cpp computes
    with the GGUF's quantised weights, SDCP and transformers with their fp32 dequantisation."""
    if LLAMACPP_TARGET not in data.systems:
        return {}
    by_run = _outputs_by_run(data)
    same: dict[str, Any] = {}
    for system in data.systems:
        if system == LLAMACPP_TARGET:
            continue
        _, mismatches = _compare(by_run, LLAMACPP_TARGET, [system])
        shared = {(w, p) for (w, p, _), outputs in by_run.items() if {system, LLAMACPP_TARGET} <= outputs.keys()}
        differing = {(m["workload"], m["prompt"]) for m in mismatches}
        same[system] = {
            "prompts": len(shared),
            "identical_prompts": len(shared - differing),
            "mismatches": mismatches,
        }
    return same


def summarise(data: BenchData) -> dict[str, Any]:
    repeats = sorted({m.repeat for m in data.measurements})
    workloads = [w.name for w in data.workloads]
    # The goals' "every workload" is the workloads they were set on, not those of issues 28 and 30.
    measured = [w for w in workloads if w not in HISTORY_WORKLOADS and w != STRUCTURED_WORKLOAD]
    history = [w for w in workloads if w in HISTORY_WORKLOADS]
    # "all" is the protocol workloads, which every system runs; the chat workloads stand alone.
    rates: dict[str, dict[str, list[float | None]]] = {s: {w: [] for w in [*workloads, "all"]} for s in data.systems}
    for system in data.systems:
        for repeat in repeats:
            runs = [m for m in data.measurements if m.system == system and m.repeat == repeat]
            for workload in workloads:
                rates[system][workload].append(_rate([m for m in runs if m.workload == workload]))
            rates[system]["all"].append(_rate([m for m in runs if m.workload in CORE_WORKLOADS]))

    def ratio(workload: str, num: str, den: str) -> float | None:
        # None where either system or the workload did not run (a run limited to some of them).
        if num not in rates or den not in rates or workload not in rates[num]:
            return None
        values = [a / b for a, b in zip(rates[num][workload], rates[den][workload], strict=True) if a and b]
        return _median(values)

    default_vs_target = {w: ratio(w, DEFAULT, "hf_target") for w in measured}
    relative_speed = {
        anchor: {
            system: {w: ratio(w, system, anchor) for w in [*workloads, "all"]}
            for system in data.systems
            if system != anchor
        }
        for anchor in ANCHORS
        if anchor in data.systems
    }
    default_vs_ngram_only = {w: ratio(w, DEFAULT, E2E) for w in measured}

    ratios: dict[str, float | None] = {
        "repetitive_vs_target": ratio("repetitive", E2E, "hf_target"),
        "repetitive_vs_hf_prompt_lookup": ratio("repetitive", E2E, "hf_prompt_lookup"),
        "nonrepetitive_vs_target": ratio("nonrepetitive", E2E, "hf_target"),
        "mixed_vs_target": ratio("mixed", E2E, "hf_target"),
        "e2e_vs_target": ratio("all", E2E, "hf_target"),
        "e2e_vs_hf_prompt_lookup": ratio("all", E2E, "hf_prompt_lookup"),
        "e2e_vs_inprocess": ratio("all", E2E, "sdcp_inprocess"),
        "inprocess_vs_target": ratio("all", "sdcp_inprocess", "hf_target"),
        "backend_vs_target": ratio("all", "sdcp_target_only", "hf_target"),
        "repetitive_vs_backend": ratio("repetitive", E2E, "sdcp_target_only"),
        "nonrepetitive_vs_backend": ratio("nonrepetitive", E2E, "sdcp_target_only"),
        "e2e_vs_backend": ratio("all", E2E, "sdcp_target_only"),
    }
    if "sdcp_e2e_redis" in data.systems:
        ratios["e2e_redis_vs_e2e"] = ratio("all", "sdcp_e2e_redis", E2E)
    # Issue 30: structured output's speedup over target-only decoding with the grammar on, for what
    # a user runs (the default cluster through the gateway), the n-gram-only cluster and the engines.
    if STRUCTURED_WORKLOAD in workloads:
        ratios["structured_vs_target_only"] = ratio(STRUCTURED_WORKLOAD, DEFAULT, TARGET_ONLY)
        ratios["structured_e2e_vs_target_only"] = ratio(STRUCTURED_WORKLOAD, E2E, TARGET_ONLY)
        ratios["structured_inprocess_vs_target_only"] = ratio(STRUCTURED_WORKLOAD, "sdcp_inprocess", TARGET_ONLY)
    ratios["default_copyedit_vs_target"] = default_vs_target.get("copyedit")
    ratios["default_open_vs_target"] = default_vs_target.get("open")
    ratios["default_min_vs_target"] = _lowest(default_vs_target)
    ratios["default_min_vs_ngram_only"] = _lowest(default_vs_ngram_only)
    concurrency = []
    single = next((level for level in data.concurrency if level.sessions == 1), None)
    for level in data.concurrency:
        rate = level.tokens / level.seconds if level.seconds > 0 else 0.0
        concurrency.append(
            {
                "sessions": level.sessions,
                "tokens": level.tokens,
                "tokens_per_s": round(rate, 2),
                "itl_ms_p50": _percentile(level.inter_token_ms, 50),
                "itl_ms_p99": _percentile(level.inter_token_ms, 99),
                "verifier_batch_mean": round(statistics.fmean(level.batch_sizes), 2) if level.batch_sizes else None,
            }
        )
    top = max(data.concurrency, key=lambda level: level.sessions, default=None)
    if single is not None and top is not None and single.tokens and top is not single:
        ratios[f"concurrency{top.sessions}_vs_1"] = round(
            (top.tokens / top.seconds) / (single.tokens / single.seconds), 3
        )
    ratios.setdefault("concurrency16_vs_1", None)
    default_vs_llamacpp = {w: ratio(w, DEFAULT, LLAMACPP_TARGET) for w in workloads if w in CHAT_WORKLOADS}
    ratios["target_only_vs_llamacpp"] = ratio("all", TARGET_ONLY, LLAMACPP_TARGET)
    ratios["default_copyedit_vs_llamacpp"] = default_vs_llamacpp.get("copyedit")
    ratios["default_open_vs_llamacpp"] = default_vs_llamacpp.get("open")
    ratios["default_min_vs_llamacpp"] = _lowest(default_vs_llamacpp) if default_vs_llamacpp else None
    per_system: dict[str, Any] = {}
    for system in data.systems:
        runs = [m for m in data.measurements if m.system == system]
        per_workload = {}
        for workload in [*workloads, "all"]:
            # "all": every workload but the history ones, as before they came.
            chosen = [m for m in runs if (m.workload == workload if workload != "all" else m.workload in measured)]
            per_workload[workload] = _system_workload(chosen, rates[system][workload])
        per_system[system] = per_workload
    ratios["default_first_token_vs_llamacpp"] = _first_token_ratio(data, DEFAULT, LLAMACPP_TARGET)
    e2e_overhead = [ms for m in data.measurements if m.system == E2E for ms in m.result.overhead_ms]
    inprocess_overhead = [ms for m in data.measurements if m.system == "sdcp_inprocess" for ms in m.result.overhead_ms]
    identical, mismatches = _identical(data)
    summary: dict[str, Any] = {
        "model": data.config.model,
        "backend": data.backend,
        "quick": data.config.quick,
        "repeats": len(repeats),
        "max_new": data.config.effective_max_new,
        "prompts": {w.name: len(w.prompts) for w in data.workloads},
        "seconds": round(data.seconds, 1),
        "systems": per_system,
        "ratios": ratios,
        "overhead_ms_p50": _percentile(e2e_overhead, 50),
        "overhead_ms_p99": _percentile(e2e_overhead, 99),
        "overhead_inprocess_ms_p50": _percentile(inprocess_overhead, 50),
        "overhead_inprocess_ms_p99": _percentile(inprocess_overhead, 99),
        "concurrency": concurrency,
        "default_vs_target": default_vs_target,
        "default_vs_ngram_only": default_vs_ngram_only,
        "default_per_prompt": _per_prompt(data, DEFAULT),
        "relative_speed": relative_speed,
        "noisy_neighbour": data.neighbour,
        "identical_outputs": identical,
        "mismatches": mismatches,
        "same_as_llamacpp": _same_as_llamacpp(data),
        "history": {
            "workloads": history,
            "prompts": {w.name: len(w.prompts) for w in data.workloads if w.name in history},
            "default_vs_target": {w: ratio(w, DEFAULT, HF_TARGET) for w in history},
            "default_vs_llamacpp": {w: ratio(w, DEFAULT, LLAMACPP_TARGET) for w in history},
            "default_vs_ngram_only": {w: ratio(w, DEFAULT, E2E) for w in history},
            "acceptance_by_request": _acceptance_by_request(data, history),
        },
    }
    summary["goals"] = _goals(summary)
    return summary


def _first_token_ratio(data: BenchData, system: str, anchor: str) -> float | None:
    """``system``'s time to first token p50 over the chat prompts, relative to ``anchor``'s."""

    def p50(name: str) -> float | None:
        times = [
            m.result.first_token_ms
            for m in data.measurements
            if m.system == name and m.workload in CHAT_WORKLOADS and m.result.first_token_ms is not None
        ]
        return _percentile(times, 50)

    ours, theirs = p50(system), p50(anchor)
    return round(ours / theirs, 3) if ours is not None and theirs else None


def _lowest(ratios: dict[str, float | None]) -> float | None:
    """The lowest ratio, or None when any workload has none (a goal over every workload)."""
    values = list(ratios.values())
    return None if not values or any(v is None for v in values) else min(v for v in values if v is not None)


def _per_prompt(data: BenchData, system: str) -> list[dict[str, Any]]:
    """Per prompt of ``system``: who drafted (over every repeat, in order), acceptance, speed."""
    rows = []
    for workload in data.workloads:
        for index in range(len(workload.prompts)):
            runs = [
                m for m in data.measurements if m.system == system and m.workload == workload.name and m.prompt == index
            ]
            if not runs:
                continue
            served = list(dict.fromkeys(who for m in runs for who in m.result.served))
            accepted = sum(m.result.accepted for m in runs)
            proposed = sum(m.result.proposed for m in runs)
            rounds = sum(m.result.rounds for m in runs)
            self_decoded = sum(m.result.self_decoded for m in runs)
            rows.append(
                {
                    "workload": workload.name,
                    "prompt": index,
                    "served": served,
                    "acceptance": round(accepted / proposed, 3) if proposed else None,
                    "self_decoded_share": round(self_decoded / (rounds + self_decoded), 3)
                    if rounds + self_decoded
                    else None,
                    "tokens_per_s": _median([m.result.tokens_per_s for m in runs]),
                }
            )
    return rows


def _acceptance_by_request(data: BenchData, workloads: list[str]) -> dict[str, dict[str, list[float | None]]]:
    """Per history workload and SDCP system: each request's acceptance (accepted / proposed), in
    the order they were sent (first repeat), to see whether the earlier answers help the later ones."""
    table: dict[str, dict[str, list[float | None]]] = {}
    for workload in workloads:
        runs = sorted(
            (m for m in data.measurements if m.workload == workload and m.repeat == 0), key=lambda m: m.prompt
        )
        by_system: dict[str, list[float | None]] = {}
        for m in runs:
            if m.result.rounds + m.result.self_decoded:
                by_system.setdefault(m.system, []).append(
                    round(m.result.accepted / m.result.proposed, 3) if m.result.proposed else None
                )
        table[workload] = by_system
    return table


def token_roles(result: RunResult) -> dict[str, int]:
    """Who produced a run's committed tokens: ``drafters`` (accepted draft tokens), and the verifier
    by ``self_decoding`` (a token per self-decoded round) or as each proposal round's ``verifier_extra``
    token (the correction of the first rejected draft token, or the one after a fully accepted draft).

    From the session's stats: a round that reaches max_new or a stop token commits fewer than it
    accepted, so the accepted drafts are capped at the tokens committed (at most one round, the
    last, is cut), then the self-decoded ones, and the verifier's extra tokens are the rest.
    """
    tokens = len(result.tokens)
    drafters = min(result.accepted, tokens)
    self_decoding = min(result.self_decoded, tokens - drafters)
    return {"drafters": drafters, "self_decoding": self_decoding, "verifier_extra": tokens - drafters - self_decoding}


def _system_workload(runs: list[Measurement], rates: list[float | None]) -> dict[str, Any]:
    tokens = sum(len(m.result.tokens) for m in runs)
    rounds = sum(m.result.rounds for m in runs)
    self_decoded = sum(m.result.self_decoded for m in runs)
    # A proposal round takes one pass; self-decoded rounds take fewer where guesses were right.
    passes = rounds + sum(m.result.self_passes for m in runs)
    accepted = sum(m.result.accepted for m in runs)
    by_position_accepted = _sum_lists([m.result.accepted_by_position for m in runs])
    by_position_proposed = _sum_lists([m.result.proposed_by_position for m in runs])
    measured = [rate for rate in rates if rate is not None]
    first_token_ms = [m.result.first_token_ms for m in runs if m.result.first_token_ms is not None]
    entry: dict[str, Any] = {
        "tokens_per_s": _median(measured),
        "tokens_per_s_by_repeat": [round(rate, 3) for rate in measured],
        "tokens": tokens,
        "first_token_ms_p50": _percentile(first_token_ms, 50),
        "itl_ms_p50": _percentile([gap for m in runs for gap in m.result.inter_token_ms], 50),
    }
    if rounds + self_decoded:
        entry.update(
            {
                "mean_accepted_length": round(accepted / rounds, 3) if rounds else 0.0,
                "tokens_per_target_pass": round(tokens / passes, 3) if passes else None,
                "rounds_per_100_tokens": round(100 * (rounds + self_decoded) / tokens, 2) if tokens else None,
                "self_decoded_share": round(self_decoded / (rounds + self_decoded), 3),
                "acceptance_by_position": [
                    round(a / p, 3) if p else None
                    for a, p in zip(by_position_accepted, by_position_proposed, strict=True)
                ],
                "proposed_by_position": by_position_proposed,
            }
        )
        roles = {
            role: sum(token_roles(m.result)[role] for m in runs)
            for role in ("drafters", "self_decoding", "verifier_extra")
        }
        entry["tokens_by_role"] = roles
        entry["token_share_by_role"] = {
            role: round(count / tokens, 3) if tokens else None for role, count in roles.items()
        }
    return entry


def _sum_lists(lists: list[list[int]]) -> list[int]:
    total: list[int] = []
    for values in lists:
        total.extend([0] * (len(values) - len(total)))
        for i, value in enumerate(values):
            total[i] += value
    return total


def _goals(summary: dict[str, Any]) -> dict[str, Any]:
    goals = {}
    for name, (key, comparison, threshold) in GOALS.items():
        value = summary["ratios"].get(key) if key in summary["ratios"] else summary.get(key)
        met = None if value is None else (value >= threshold if comparison == ">=" else value <= threshold)
        goals[name] = {"metric": key, "value": value, "target": f"{comparison} {threshold}", "met": met}
    return goals


def write_report(data: BenchData, command: str) -> dict[str, Any]:
    summary = summarise(data)
    summary["command"] = command
    out = data.config.out
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(summary), encoding="utf-8")
    _plot(summary, out)
    return summary


def markdown(summary: dict[str, Any]) -> str:
    workloads = [w for w in summary["prompts"]] + ["all"]
    lines = [
        f"Model `{summary['model']}`, max_new {summary['max_new']}, greedy, {summary['repeats']} repeats "
        f"(median), prompts per workload {summary['prompts']}; command: `{summary.get('command', '')}`",
        "",
        "| system | " + " | ".join(f"{w} tok/s" for w in workloads) + " | tokens/target pass | rounds/100 tok |",
        "|---|" + "---|" * (len(workloads) + 2),
    ]
    for system, entries in summary["systems"].items():
        cells = [
            f"{entries[w]['tokens_per_s']:.1f}" if entries[w]["tokens_per_s"] is not None else "-" for w in workloads
        ]
        every = entries["all"]
        lines.append(
            f"| {system} | "
            + " | ".join(cells)
            + f" | {every.get('tokens_per_target_pass', '-')} | {every.get('rounds_per_100_tokens', '-')} |"
        )
    lines += _relative_speed_lines(summary, workloads)
    lines += _latency_lines(summary, workloads)
    lines += ["", "| ratio | median |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in summary["ratios"].items()]
    lines += [
        "",
        f"Non-model time per round (e2e): p50 {summary['overhead_ms_p50']} ms, "
        f"p99 {summary['overhead_ms_p99']} ms; in-process: p50 {summary['overhead_inprocess_ms_p50']} ms, "
        f"p99 {summary['overhead_inprocess_ms_p99']} ms.",
        "",
        "| sessions | aggregate tok/s | ITL p50 ms | ITL p99 ms | verifier batch (mean) |",
        "|---|---|---|---|---|",
    ]
    for level in summary["concurrency"]:
        lines.append(
            f"| {level['sessions']} | {level['tokens_per_s']} | {level['itl_ms_p50']} | "
            f"{level['itl_ms_p99']} | {level['verifier_batch_mean']} |"
        )
    lines += ["", "| workload | default vs transformers greedy | default vs n-gram-only cluster |", "|---|---|---|"]
    lines += [
        f"| {w} | {summary['default_vs_target'][w]} | {summary['default_vs_ngram_only'][w]} |"
        for w in summary["default_vs_target"]
    ]
    neighbour = summary.get("noisy_neighbour") or {}
    if neighbour:
        lines += [
            "",
            f"Noisy neighbour (default cluster, open prompts): {neighbour['idle_tokens_per_s']} tok/s alone, "
            f"{neighbour['busy_tokens_per_s']} tok/s with one core kept busy ({neighbour['busy_vs_idle']}x).",
        ]
    lines += [
        "",
        "Default cluster (`sdcp_default`), per prompt over every repeat:",
        "",
        "| workload | prompt | served by | acceptance | self-decoded share | tok/s (median) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['workload']} | {row['prompt']} | {', '.join(row['served']) or '-'} | {row['acceptance']} | "
        f"{row['self_decoded_share']} | {row['tokens_per_s']} |"
        for row in summary["default_per_prompt"]
    ]
    lines += _role_lines(summary)
    lines += _history_lines(summary)
    lines += [
        "",
        f"Outputs of target-only, SDCP in-process and SDCP end to end identical token for token: "
        f"**{summary['identical_outputs']}**",
    ]
    lines += _same_as_llamacpp_lines(summary)
    lines += [
        "",
        "| goal | value | target | met |",
        "|---|---|---|---|",
    ]
    for name, goal in summary["goals"].items():
        lines.append(f"| {name} | {goal['value']} | {goal['target']} | {goal['met']} |")
    return "\n".join(lines) + "\n"


# Positions of acceptance_by_position shown in results.md (results.json has them all).
_SHOWN_POSITIONS = 8


def _role_lines(summary: dict[str, Any]) -> list[str]:
    """Per workload and SDCP system: mean accepted length, acceptance per position, who produced
    the committed tokens."""
    rows = []
    for workload in summary["prompts"]:
        for system, entries in summary["systems"].items():
            entry = entries[workload]
            shares = entry.get("token_share_by_role")
            if not shares or not entry["tokens"]:
                continue
            by_position = entry.get("acceptance_by_position") or []
            positions = " ".join(_cell(a) for a in by_position[:_SHOWN_POSITIONS])
            positions += " ..." if len(by_position) > _SHOWN_POSITIONS else ""
            rows.append(
                f"| {workload} | {system} | {_cell(entry['tokens_per_s'], 1)} | {entry['mean_accepted_length']} | "
                f"{positions or '-'} | {_cell(shares['drafters'], 3)} | {_cell(shares['self_decoding'], 3)} | "
                f"{_cell(shares['verifier_extra'], 3)} |"
            )
    if not rows:
        return []
    return [
        "",
        "Who produced the committed tokens, per workload and SDCP system (the verifier's session stats): "
        "mean accepted length per proposal round, acceptance at draft positions 1, 2, ... (accepted / "
        "proposed), and the share of committed tokens that were accepted drafts (drafters), decoded by "
        "the verifier alone (self-decoding) or the verifier's extra token of each proposal round (its "
        "correction, or the token after a fully accepted draft):",
        "",
        "| workload | system | tok/s | mean accepted length | acceptance by position | drafters | "
        "self-decoding | verifier extra |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _history_lines(summary: dict[str, Any]) -> list[str]:
    history = summary.get("history") or {}
    if not history.get("workloads"):
        return []
    lines = [
        "",
        f"Workloads where history matters (issue 28; requests sent one after another, first repeat only; "
        f"requests {history['prompts']}): the default cluster's speed against transformers greedy, plain "
        "llama.cpp and the n-gram-only cluster, and its acceptance request by request:",
        "",
        "| workload | default vs transformers greedy | default vs llama.cpp | default vs n-gram-only | "
        "default's acceptance per request, in order |",
        "|---|---|---|---|---|",
    ]
    for workload in history["workloads"]:
        order = history["acceptance_by_request"].get(workload, {}).get(DEFAULT, [])
        lines.append(
            f"| {workload} | {_cell(history['default_vs_target'][workload])} | "
            f"{_cell(history['default_vs_llamacpp'][workload])} | "
            f"{_cell(history['default_vs_ngram_only'][workload])} | {' '.join(_cell(a) for a in order) or '-'} |"
        )
    return lines


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _relative_speed_lines(summary: dict[str, Any], workloads: list[str]) -> list[str]:
    lines = []
    for anchor, systems in summary["relative_speed"].items():
        lines += [
            "",
            f"Speed relative to `{anchor}` (median over repeats of the ratio within a repeat):",
            "",
            "| system | " + " | ".join(workloads) + " |",
            "|---|" + "---|" * len(workloads),
        ]
        lines += [
            f"| {system} | " + " | ".join(_cell(ratios[w]) for w in workloads) + " |"
            for system, ratios in systems.items()
        ]
    return lines


def _latency_lines(summary: dict[str, Any], workloads: list[str]) -> list[str]:
    """Time to first token per workload and inter-token time, for the systems that measure them."""
    measured = {
        system: entries
        for system, entries in summary["systems"].items()
        if any(entries[w]["first_token_ms_p50"] is not None for w in workloads)
    }
    if not measured:
        return []
    lines = [
        "",
        "Time to first token, p50 ms per workload (from the call to the first token), and the time "
        "between tokens after it, p50 ms over every run:",
        "",
        "| system | " + " | ".join(f"{w} TTFT" for w in workloads) + " | ITL |",
        "|---|" + "---|" * (len(workloads) + 1),
    ]
    for system, entries in measured.items():
        cells = [_cell(entries[w]["first_token_ms_p50"], 1) for w in workloads]
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {_cell(entries['all']['itl_ms_p50'], 1)} |")
    return lines


def _same_as_llamacpp_lines(summary: dict[str, Any]) -> list[str]:
    same = summary["same_as_llamacpp"]
    if not same:
        return []
    lines = [
        "",
        f"Greedy outputs identical to `{LLAMACPP_TARGET}`'s token for token, in every repeat. llama.cpp "
        "computes with the GGUF's quantised weights, the others with their fp32 dequantisation, and "
        "`llamacpp_prompt_lookup` checks drafts in passes of several tokens, whose rounding differs: "
        "an output parts where two tokens are almost tied.",
        "",
        "| system | identical prompts | first differences (workload[prompt]: token) |",
        "|---|---|---|",
    ]
    for system, entry in same.items():
        firsts = dict.fromkeys(f"{m['workload']}[{m['prompt']}]: {m['first_difference']}" for m in entry["mismatches"])
        lines.append(f"| {system} | {entry['identical_prompts']} of {entry['prompts']} | {', '.join(firsts) or '-'} |")
    return lines


def _plot(summary: dict[str, Any], out: Path) -> None:
    systems = list(summary["systems"])
    workloads = list(summary["prompts"])
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        values = [summary["systems"][system][w]["tokens_per_s"] or 0.0 for w in workloads]
        axes[0].bar(np.arange(len(workloads)) + i * width, values, width, label=system)
    axes[0].set_xticks(np.arange(len(workloads)) + 0.4 - width / 2, workloads)
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("Throughput per system (one session)")
    axes[0].legend(fontsize=7)
    ratio_names = [n for n, v in summary["ratios"].items() if v is not None]
    axes[1].barh(ratio_names, [summary["ratios"][n] for n in ratio_names])
    axes[1].axvline(1.0, color="grey", linewidth=0.8)
    axes[1].set_title("Ratios (median over repeats)")
    figure.tight_layout()
    figure.savefig(out / "throughput.png", dpi=80)
    plt.close(figure)

    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for system in ("sdcp_inprocess", E2E):
        if system not in summary["systems"]:
            continue
        for workload in workloads:
            acceptance = summary["systems"][system][workload].get("acceptance_by_position") or []
            axes[0].plot(
                range(1, len(acceptance) + 1), [a or 0.0 for a in acceptance], marker="o", label=f"{system} {workload}"
            )
    axes[0].set_xlabel("proposed position")
    axes[0].set_ylabel("acceptance")
    axes[0].set_title("Acceptance by position")
    if axes[0].get_legend_handles_labels()[0]:  # none where neither system ran
        axes[0].legend(fontsize=7)
    levels = summary["concurrency"]
    axes[1].plot([lv["sessions"] for lv in levels], [lv["tokens_per_s"] for lv in levels], marker="o", label="tok/s")
    axes[1].set_xlabel("concurrent sessions")
    axes[1].set_ylabel("aggregate tokens/s")
    twin = axes[1].twinx()
    twin.plot([lv["sessions"] for lv in levels], [lv["itl_ms_p50"] or 0 for lv in levels], "g--", label="ITL p50")
    twin.plot([lv["sessions"] for lv in levels], [lv["itl_ms_p99"] or 0 for lv in levels], "r:", label="ITL p99")
    twin.set_ylabel("inter-token latency (ms)")
    twin.legend(fontsize=7, loc="upper left")
    axes[1].set_title("Concurrency sweep (SDCP end to end)")
    figure.tight_layout()
    figure.savefig(out / "acceptance_concurrency.png", dpi=80)
    plt.close(figure)
    _plot_relative_speed(summary, out)


def _plot_relative_speed(summary: dict[str, Any], out: Path) -> None:
    """One panel per anchor that ran: every other system's speed relative to it, per workload."""
    anchors = summary["relative_speed"]
    if not anchors:
        return
    workloads = [*summary["prompts"], "all"]
    # A system keeps its colour in every panel, though each panel leaves out its own anchor.
    colours = {system: f"C{i % 10}" for i, system in enumerate(summary["systems"])}
    figure, axes = plt.subplots(1, len(anchors), figsize=(6 * len(anchors), 4), squeeze=False)
    for axis, (anchor, systems) in zip(axes[0], anchors.items(), strict=True):
        width = 0.8 / len(systems)
        for i, (system, ratios) in enumerate(systems.items()):
            values = [ratios[w] or 0.0 for w in workloads]
            axis.bar(np.arange(len(workloads)) + i * width, values, width, label=system, color=colours[system])
        axis.set_xticks(np.arange(len(workloads)) + 0.4 - width / 2, workloads)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_ylabel(f"speed / {anchor}")
        axis.set_title(f"Relative to {anchor} (median over repeats)")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "relative_speed.png", dpi=80)
    plt.close(figure)
