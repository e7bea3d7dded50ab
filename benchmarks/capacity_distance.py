"""Capacity and distance (issue 28 item 6): what offloading the drafting buys when the verifier has a
core of its own, and what distance between drafter and verifier costs.

capacity: a local cluster (``sdcp.bench.cluster.ClusterSystem``: router, verifier, drafter(s) and
gateway, each its own process, HTTP/2 + mTLS on loopback, the default drafters unless
``--cluster-drafters`` says otherwise) with the verifier pinned to one core and every other process
(router, drafters, gateway and this script, every thread of each, ``/proc/PID/task``) to another.
The script pins itself to the verifier's core before ``up``, so that the verifier sizes its
threads to that one core (``threads = usable cores``, sdcp.cluster), and re-pins the others after.
N sessions at once (``--sessions``) are run in two modes, each through ``sdcp.frontend.client``:

- offloaded: drafted by the drafter instances only; the contract permits no self-decoding (no
  ``self_load``; its fallback ladder reduces M, never self-decodes);
- co-located: the verifier decodes alone from the start with its own lookahead (the contract
  permits self-decoding for the whole of max_new and names, in ``drafters``, no model any drafter
  runs, so the router's only choice is the verifier alone).

distance: SDCP's engines in this process (``RouterEngine``, ``VerifierEngine`` and ``DrafterEngine``
with the n-gram drafter, what ``sdcp up`` starts by default, or ``--drafter suffix``), joined by
``sdcp.bench.inprocess.InMemoryVerifierLink`` wrapped so that each proposal and output read sleeps
rtt/2 before and after the call: a simulated round trip. Chosen over the fault tests' delay relay
(tests/faults: iptables REDIRECT in network namespaces) because it needs no root and costs no CPU
(a relay on a 2-core machine takes cycles from the verifier it delays), and the kernel here has no
netem. What it leaves out: HTTP/2, TLS, the processes and the router's choice between drafters and
self-decoding (the router engine is not told how fast the verifier decodes alone, so a session is
always assigned the drafter; the default contract's fallback ladder still self-decodes where drafts
keep failing, as in ``sdcp_inprocess``). Per added round trip
(``--rtt-ms``) and pre-drafting on and off (``[drafter] predraft``), on the same prompts, alternating
with the verifier's target-only decoding (``TargetOnlySDCPSystem`` on the verifier's model thread):
tokens/s, speedup over target-only, share of tokens drafted, the pre-draft hit rate (the drafter's
``sdcp_drafter_predrafts_total``: used / (used + discarded)) and the verdict-to-proposal gap (the
link's time from a verdict's arrival at the drafter to the drafter's next proposal of the session;
rounds after an assignment or a verdict that stops drafting are not counted). The check: at 5 ms
added round trip the speedup keeps >= 80 % of its 0 ms value (pre-drafting on, the default).

Both use the workloads where history matters (src/sdcp/bench/prompts: json_extraction, sql,
code_edit), greedy (rule 1), each run under a contract scope of its own so that no run drafts from
another's history: its first ``--warm`` requests of each workload warm the history (untimed), the
next ``--requests`` are measured, one workload after another.

Run: .venv/bin/python benchmarks/capacity_distance.py --out capacity_distance.json
     (needs `sdcp models fetch` and, for capacity, two cores; --only capacity|distance runs one part)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from sdcp.bench.cluster import ClusterSystem
from sdcp.bench.inprocess import InMemoryRouterLink, InMemoryVerifierLink, InProcessSDCPSystem
from sdcp.bench.systems import RunResult, TargetOnlySDCPSystem
from sdcp.bench.workloads import Prompt, load_history_workloads, tokenize_prompt
from sdcp.frontend.client import build_contract
from sdcp.cluster import DEFAULT_DRAFTERS
from sdcp.config import DrafterConfig
from sdcp.models.backend import LLAMACPP_KV_SLOTS, Target
from sdcp.models.choice import choose_backend
from sdcp.models.registry import end_of_text_tokens, load_drafter, load_target, load_tokenizer
from sdcp.protocol.messages import (
    Action,
    Assignment,
    CancelRequest,
    Contract,
    Output,
    Policy,
    Proposal,
    SelfDecodeRequest,
    SessionOpen,
    SessionState,
    Verdict,
)
from sdcp.protocol.problems import ProtocolError
from sdcp.threads import CoreGovernor, usable_cores

WORKLOADS = ("json_extraction", "sql", "code_edit")
OFFLOADED, COLOCATED = "offloaded", "co-located"
# A model digest that no drafter runs: a contract naming only it leaves the router the verifier alone.
NO_DRAFTER = bytes(32)
# The check of issue 28: at this added round trip the speedup keeps at least this share of 0 ms's.
CHECK_RTT_MS, CHECK_SHARE = 5.0, 0.8
_TTL_MS = 3000


def log(message: str) -> None:
    print(f"[capacity-distance] {message}", file=sys.stderr, flush=True)


# -- prompts and contracts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """Per workload, the requests that warm a run's history and those that are measured."""

    warm: list[Prompt]
    measured: list[Prompt]


def load_requests(model: str, names: Sequence[str], warm: int, measured: int) -> tuple[Requests, list[int]]:
    tokenizer = load_tokenizer(model)
    workloads = {w.name: w for w in load_history_workloads()}
    missing = [name for name in names if name not in workloads]
    if missing:
        raise SystemExit(f"no such history workload: {', '.join(missing)} (known: {', '.join(workloads)})")
    warm_prompts: list[Prompt] = []
    measured_prompts: list[Prompt] = []
    for name in names:
        workload = workloads[name]
        if any(workload.continues):
            raise SystemExit(f"{name} is a multi-turn workload; this script sends single requests")
        prompts = [Prompt(text, tuple(tokenize_prompt(tokenizer, text))) for text in workload.prompts]
        if len(prompts) < warm + measured:
            log(f"{name} has {len(prompts)} requests: {warm} warm and {len(prompts) - warm} measured")
        warm_prompts += prompts[:warm]
        measured_prompts += prompts[warm : warm + measured]
    return Requests(warm_prompts, measured_prompts), end_of_text_tokens(tokenizer)


def scoped(contract: Contract, scope: bytes, **changes: object) -> Contract:
    """The contract under a scope of its own (its runs' histories are shared with no other run)."""
    obj: dict[str, Any] = {**contract.to_obj(), "scope": scope}
    for key, value in changes.items():
        if value is None:
            obj.pop(key, None)
        else:
            obj[key] = value
    return Contract.from_obj(obj)


def mode_contract(mode: str, target: bytes, tokenizer: bytes, max_new: int, stop: Sequence[int]) -> Contract:
    """offloaded: drafters only (no self_load; the ladder reduces M, enough entries for max_new
    tokens of low rounds). co-located: the verifier alone for the whole of max_new."""
    if mode == OFFLOADED:
        base = build_contract(target=target, tokenizer=tokenizer, max_new=max_new, stop=stop)
        reductions = max_new // base.low_rounds + 1
        return scoped(base, os.urandom(16), self_load=None, self_max=None, fallback=[int(Action.REDUCE)] * reductions)
    base = build_contract(
        target=target, tokenizer=tokenizer, max_new=max_new, stop=stop, self_max=max_new, drafters=[NO_DRAFTER]
    )
    return scoped(base, os.urandom(16))


def token_shares(results: Iterable[RunResult]) -> tuple[float, float]:
    """Share of committed tokens that were accepted drafts, and that were self-decoded (each
    session's accepted drafts capped at its tokens, as sdcp.bench.report.token_roles)."""
    tokens = drafted = self_decoded = 0
    for result in results:
        n = len(result.tokens)
        accepted = min(result.accepted, n)
        tokens += n
        drafted += accepted
        self_decoded += min(result.self_decoded, n - accepted)
    return (drafted / tokens, self_decoded / tokens) if tokens else (0.0, 0.0)


# -- capacity: a pinned local cluster ----------------------------------------------------------------


def pin(pid: int, cores: set[int]) -> int:
    """Every thread of ``pid`` onto ``cores``; how many threads were pinned."""
    pinned = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(task), cores)
            pinned += 1
    return pinned


def pin_cluster(system: ClusterSystem, verifier_cores: set[int], other_cores: set[int]) -> dict[str, str]:
    placed = {}
    for instance in system.cluster.instances():
        cores = verifier_cores if instance.role == "verifier" else other_cores
        threads = pin(instance.pid, cores)
        placed[instance.name] = f"cores {sorted(cores)}, {threads} threads"
    pin(os.getpid(), other_cores)
    placed["client (this script)"] = f"cores {sorted(other_cores)}"
    return placed


def verifier_threads(system: ClusterSystem) -> str:
    config = system.cluster.root / "verifier.toml"
    lines = config.read_text(encoding="utf-8").splitlines() if config.is_file() else []
    return next((line.split("=", 1)[1].strip() for line in lines if line.startswith("threads")), "?")


async def cluster_session(system: ClusterSystem, prompt: Prompt, contract: Contract) -> RunResult:
    client = system.client
    assert client is not None
    started = time.perf_counter()
    handle = await client.open(list(prompt.tokens), contract)
    tokens = [token async for chunk in client.stream(handle) for token in chunk.tokens]
    seconds = time.perf_counter() - started
    result = await system.session_result(handle, seconds)
    result.tokens = tokens
    return result


async def concurrent(
    run: Any, prompts: Sequence[Prompt], contract: Contract, sessions: int
) -> tuple[list[RunResult], float]:
    """``sessions`` workers taking the prompts in order: every result, and the wall time."""
    queue = list(prompts)
    results: list[RunResult] = []

    async def worker() -> None:
        while queue:
            results.append(await run(queue.pop(0), contract))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(sessions)))
    return results, time.perf_counter() - started


async def measure_capacity(
    system: ClusterSystem, args: argparse.Namespace, requests: Requests, stop: list[int]
) -> list[dict[str, Any]]:
    await system.connect()
    try:
        assert system.target is not None
        target, tokenizer = system.target["model"], system.target["tokenizer"]
        assert isinstance(target, bytes) and isinstance(tokenizer, bytes)

        async def run(prompt: Prompt, contract: Contract) -> RunResult:
            return await cluster_session(system, prompt, contract)

        # One-off costs (first pass, connections) before anything is timed.
        first = (requests.warm or requests.measured)[0]
        for mode in (OFFLOADED, COLOCATED):
            await run(first, mode_contract(mode, target, tokenizer, 8, stop))
        rows = []
        for level, sessions in enumerate(args.sessions):
            # The modes take turns going first from level to level, so that drift on the host spreads.
            modes = (OFFLOADED, COLOCATED) if level % 2 == 0 else (COLOCATED, OFFLOADED)
            for mode in modes:
                contract = mode_contract(mode, target, tokenizer, args.max_new, stop)
                for prompt in requests.warm:
                    await run(prompt, contract)
                # Whole waves of ``sessions`` requests, the prompts cycled where there are fewer.
                count = math.ceil(len(requests.measured) / sessions) * sessions
                measured = [requests.measured[i % len(requests.measured)] for i in range(count)]
                results, seconds = await concurrent(run, measured, contract, sessions)
                tokens = sum(len(r.tokens) for r in results)
                drafted, self_decoded = token_shares(results)
                row = {
                    "mode": mode,
                    "sessions": sessions,
                    "requests": len(results),
                    "tokens": tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else 0.0,
                    "share_drafted": round(drafted, 3),
                    "share_self_decoded": round(self_decoded, 3),
                }
                rows.append(row)
                log(f"capacity {mode} x{sessions}: {row['tokens_per_s']} tok/s, drafted {row['share_drafted']}")
        return rows
    finally:
        await system.aclose()


def log_tails(system: ClusterSystem, lines: int = 8) -> None:
    for path in sorted((system.cluster.root / "logs").glob("*.log")):
        tail = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        log(f"{path.name}:\n" + "\n".join(tail))


def run_capacity(args: argparse.Namespace, requests: Requests, stop: list[int]) -> dict[str, Any]:
    available = os.sched_getaffinity(0)
    verifier_cores, other_cores = {args.verifier_core}, {args.other_core}
    if not (verifier_cores | other_cores) <= available or verifier_cores == other_cores:
        raise SystemExit(
            f"capacity needs two distinct usable cores (--verifier-core, --other-core); this process may use "
            f"{sorted(available)}"
        )
    with tempfile.TemporaryDirectory(prefix="sdcp-capacity-") as tmp:
        system = ClusterSystem(Path(tmp) / "sdcp-home", args.model, name="capacity", drafters=args.cluster_drafters)
        # Started from the verifier's core, the verifier sizes its threads to it (sdcp.cluster).
        pin(os.getpid(), verifier_cores)
        try:
            log(f"starting a local cluster (drafters {', '.join(args.cluster_drafters)}) under {tmp}")
            system.start()
            placed = pin_cluster(system, verifier_cores, other_cores)
            threads = verifier_threads(system)
            log(f"pinned: {placed}; verifier threads {threads}")
            rows = asyncio.run(measure_capacity(system, args, requests, stop))
        except BaseException:
            log_tails(system)  # the logs go with the temporary directory
            raise
        finally:
            system.stop()
            pin(os.getpid(), available)
    return {"drafters": list(args.cluster_drafters), "placement": placed, "verifier_threads": threads, "rows": rows}


# -- distance: the engines in this process, a simulated round trip -----------------------------------


class DistantLink:
    """A ``VerifierLink`` that is ``rtt_s`` away: each call sleeps half of it before and after.
    Records each session's verdict-to-proposal gaps: from a verdict's arrival to the next proposal."""

    def __init__(self, inner: InMemoryVerifierLink, rtt_s: float) -> None:
        self._inner = inner
        self._half = rtt_s / 2
        self._verdict_at: dict[bytes, float] = {}
        self.gaps_s: list[float] = []

    async def _travel(self) -> None:
        if self._half > 0:
            await asyncio.sleep(self._half)

    def forget(self, session: bytes) -> None:
        """The session was assigned again: its next proposal follows no verdict."""
        self._verdict_at.pop(session, None)

    async def propose(self, verifier: str, proposal: Proposal) -> Verdict:
        last = self._verdict_at.pop(proposal.session, None)
        if last is not None:
            self.gaps_s.append(time.perf_counter() - last)
        await self._travel()
        try:
            verdict = await self._inner.propose(verifier, proposal)
        except ProtocolError:
            await self._travel()
            raise
        await self._travel()
        if verdict.action in (Action.CONTINUE, Action.REDUCE):
            self._verdict_at[proposal.session] = time.perf_counter()
        return verdict

    async def output(self, verifier: str, session: bytes, start: int) -> Output:
        await self._travel()
        output = await self._inner.output(verifier, session, start)
        await self._travel()
        return output


class ForgettingRouterLink:
    """The router's link to the engines; each assignment tells the ``DistantLink`` that the
    session's next proposal follows no verdict."""

    def __init__(self, inner: InMemoryRouterLink, distant: Callable[[], DistantLink]) -> None:
        self._inner = inner
        self._distant = distant

    async def open_session(self, verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        return await self._inner.open_session(verifier, message, timeout=timeout)

    async def inform_verifier(self, verifier: str, assignment: Assignment) -> SessionState:
        return await self._inner.inform_verifier(verifier, assignment)

    async def assign(self, drafter: str, assignment: Assignment) -> None:
        self._distant().forget(assignment.session)
        await self._inner.assign(drafter, assignment)

    async def policy(self, verifier: str, policy: Policy) -> SessionState:
        return await self._inner.policy(verifier, policy)

    async def self_decode(self, verifier: str, request: SelfDecodeRequest) -> SessionState:
        return await self._inner.self_decode(verifier, request)

    async def cancel(self, verifier: str, request: CancelRequest) -> SessionState:
        return await self._inner.cancel(verifier, request)


class DistanceSystem(InProcessSDCPSystem):
    """A verifier engine and one drafter engine ``rtt_s`` apart; ``generate`` decodes one session,
    read from the verifier directly (the client sits beside the verifier). The router engine always
    assigns the drafter (it is not offered the verifier alone)."""

    def __init__(self, target: Target, drafter: str, rtt_s: float, predraft: bool, tag: str) -> None:
        links: list[DistantLink] = []

        def distant(link: InMemoryVerifierLink) -> DistantLink:
            links.append(DistantLink(link, rtt_s))
            return links[-1]

        super().__init__(
            target,
            (),
            drafter=load_drafter(drafter, vocab_size=target.vocab_size),
            drafter_settings=DrafterConfig(model=drafter, predraft=predraft),
            link=distant,
            router_link=lambda inner: ForgettingRouterLink(inner, lambda: links[0]),
            self_decoding=False,
            # As the verifier service: the model's threads sized to the cores others leave free.
            cores=CoreGovernor(usable_cores(), set_threads=target.set_threads),
            authority="distance",
            uris=(f"https://verifier-{tag}.distance", f"https://drafter-{tag}.distance"),
        )
        self.link = links[0]

    def predrafts(self) -> tuple[int, int]:
        """The drafter's pre-drafted rounds: used, discarded."""

        def value(outcome: str) -> int:
            labels = {"instance": self.drafter_uri, "outcome": outcome}
            return int(REGISTRY.get_sample_value("sdcp_drafter_predrafts_total", labels) or 0)

        return value("used"), value("discarded")

    def gap_metric(self) -> dict[str, Any] | None:
        """The drafter's own verdict-to-proposal histogram, where the product has one: its mean and
        the upper bound of the bucket that holds its median (over the whole run, warm-up included)."""
        for family in REGISTRY.collect():
            if "verdict_to_proposal" not in family.name:
                continue
            mine = [s for s in family.samples if s.labels.get("instance") == self.drafter_uri]
            total = next((s.value for s in mine if s.name.endswith("_sum")), None)
            count = next((s.value for s in mine if s.name.endswith("_count")), None)
            if total is None or not count:
                continue
            buckets = sorted(
                (float(s.labels["le"]), s.value) for s in mine if s.name.endswith("_bucket") and "le" in s.labels
            )
            p50 = next((le for le, cumulative in buckets if cumulative >= count / 2), None)
            return {
                "metric": family.name,
                "mean_ms": round(1000 * total / count, 3),
                "p50_at_most_ms": None if p50 is None or math.isinf(p50) else round(1000 * p50, 3),
                "count": int(count),
            }
        return None


@dataclass
class DistanceRun:
    rtt_ms: float
    predraft: bool
    sdcp: list[RunResult] = field(default_factory=list)
    target_only: list[RunResult] = field(default_factory=list)
    used: int = 0
    discarded: int = 0
    gaps_s: list[float] = field(default_factory=list)
    gap_metric: dict[str, Any] | None = None
    mismatches: int = 0

    def row(self) -> dict[str, Any]:
        tokens = sum(len(r.tokens) for r in self.sdcp)
        seconds = sum(r.seconds for r in self.sdcp)
        target_tokens = sum(len(r.tokens) for r in self.target_only)
        target_seconds = sum(r.seconds for r in self.target_only)
        rate = tokens / seconds if seconds > 0 else 0.0
        target_rate = target_tokens / target_seconds if target_seconds > 0 else 0.0
        drafted, self_decoded = token_shares(self.sdcp)
        predrafts = self.used + self.discarded
        return {
            "rtt_ms": self.rtt_ms,
            "predraft": self.predraft,
            "requests": len(self.sdcp),
            "tokens": tokens,
            "tokens_per_s": round(rate, 2),
            "target_only_tokens_per_s": round(target_rate, 2),
            "speedup": round(rate / target_rate, 3) if target_rate > 0 else None,
            "share_drafted": round(drafted, 3),
            "share_self_decoded": round(self_decoded, 3),
            "predrafts_used": self.used,
            "predrafts_discarded": self.discarded,
            "predraft_hit_rate": round(self.used / predrafts, 3) if predrafts else None,
            "gap_p50_ms": round(1000 * statistics.median(self.gaps_s), 3) if self.gaps_s else None,
            "gaps": len(self.gaps_s),
            "gap_metric": self.gap_metric,
            "outputs_differing_from_target_only": self.mismatches,
        }


def distance_target(model: str) -> tuple[Target, str]:
    threads = usable_cores()
    choice = choose_backend("auto", model, device="cpu", threads=threads)
    slots = min(4, LLAMACPP_KV_SLOTS)
    return load_target(model, backend=choice.backend, threads=threads, kv_slots=slots, kv_capacity=2048), str(
        choice.backend
    )


async def distance_run(
    target: Target, args: argparse.Namespace, requests: Requests, stop: list[int], rtt_ms: float, predraft: bool
) -> DistanceRun:
    tag = f"rtt{rtt_ms:g}-{'predraft' if predraft else 'no-predraft'}".replace(".", "_")
    system = DistanceSystem(target, args.drafter, rtt_ms / 1000, predraft, tag)
    baseline = TargetOnlySDCPSystem(target, stop)
    await system.start()
    try:
        contract = scoped(
            build_contract(
                target=target.weights_digest, tokenizer=target.tokenizer_digest, max_new=args.max_new, stop=stop
            ),
            os.urandom(16),
        )
        for prompt in requests.warm:
            await system.generate(prompt.tokens, contract.max_new, contract)
        system.link.gaps_s.clear()
        used0, discarded0 = system.predrafts()
        run = DistanceRun(rtt_ms, predraft)
        for index, prompt in enumerate(requests.measured):
            # Target-only decoding on the verifier's model thread, first or second in turn.
            scorer, tokens = system.verifier.scorer, list(prompt.tokens)
            if index % 2:
                reference = await scorer.run_async(baseline.generate, tokens, args.max_new)
                result = await system.generate(prompt.tokens, contract.max_new, contract)
            else:
                result = await system.generate(prompt.tokens, contract.max_new, contract)
                reference = await scorer.run_async(baseline.generate, tokens, args.max_new)
            run.sdcp.append(result)
            run.target_only.append(reference)
            run.mismatches += int(result.tokens != reference.tokens)
        used, discarded = system.predrafts()
        run.used, run.discarded = used - used0, discarded - discarded0
        run.gaps_s = list(system.link.gaps_s)
        run.gap_metric = system.gap_metric()
        return run
    finally:
        await system.aclose()


def run_distance(args: argparse.Namespace, requests: Requests, stop: list[int]) -> dict[str, Any]:
    if False in args.predraft and "predraft" not in DrafterConfig.__dataclass_fields__:
        raise SystemExit(
            "--predraft off needs the drafter's [drafter] predraft knob (DrafterConfig.predraft), which this "
            "checkout lacks; run with --predraft on"
        )
    target, backend = distance_target(args.model)
    log(f"distance: target on {backend}, drafter {args.drafter}")

    async def sweep() -> list[dict[str, Any]]:
        rows = []
        for rtt_ms in args.rtt_ms:
            for predraft in args.predraft:
                run = await distance_run(target, args, requests, stop, rtt_ms, predraft)
                row = run.row()
                rows.append(row)
                log(
                    f"distance {rtt_ms:g} ms predraft {'on' if predraft else 'off'}: {row['tokens_per_s']} tok/s, "
                    f"speedup {row['speedup']}, hit rate {row['predraft_hit_rate']}, gap p50 {row['gap_p50_ms']} ms"
                )
        return rows

    rows = asyncio.run(sweep())
    return {"backend": backend, "drafter": args.drafter, "rows": rows, "check": distance_check(rows)}


def distance_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedup at CHECK_RTT_MS over speedup at 0 ms, per pre-drafting setting; passes on the default (on)."""
    check: dict[str, Any] = {"rtt_ms": CHECK_RTT_MS, "required_share": CHECK_SHARE}
    for predraft in (True, False):
        by_rtt = {row["rtt_ms"]: row["speedup"] for row in rows if row["predraft"] is predraft}
        near, far = by_rtt.get(0.0), by_rtt.get(CHECK_RTT_MS)
        key = "predraft_on" if predraft else "predraft_off"
        check[key] = round(far / near, 3) if near and far is not None else None
    kept = check["predraft_on"]
    check["passed"] = None if kept is None else kept >= CHECK_SHARE
    return check


# -- report ------------------------------------------------------------------------------------------


def cell(value: object) -> str:
    return "-" if value is None else str(value)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"max_new {report['max_new']}, workloads {', '.join(report['workloads'])}", ""]
    capacity = report.get("capacity")
    if capacity is not None:
        lines += [
            f"Capacity: verifier on one core ({capacity['verifier_threads']} threads), router, drafters "
            f"({', '.join(capacity['drafters'])}), gateway and client on another",
            "",
            "| mode | sessions | requests | tok/s (aggregate) | share drafted | share self-decoded |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['mode']} | {r['sessions']} | {r['requests']} | {r['tokens_per_s']} | {r['share_drafted']} "
            f"| {r['share_self_decoded']} |"
            for r in capacity["rows"]
        ]
        lines.append("")
    distance = report.get("distance")
    if distance is not None:
        lines += [
            f"Distance: engines in one process, simulated round trip, drafter {distance['drafter']}, "
            f"target on {distance['backend']}",
            "",
            "| added RTT (ms) | pre-draft | tok/s | target-only tok/s | speedup | share drafted | pre-draft hit rate "
            "| gap p50 (ms) | outputs differing |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['rtt_ms']:g} | {'on' if r['predraft'] else 'off'} | {r['tokens_per_s']} "
            f"| {r['target_only_tokens_per_s']} | {cell(r['speedup'])} | {r['share_drafted']} "
            f"| {cell(r['predraft_hit_rate'])} | {cell(r['gap_p50_ms'])} | {r['outputs_differing_from_target_only']} |"
            for r in distance["rows"]
        ]
        check = distance["check"]
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[check["passed"]]
        lines += [
            "",
            f"Check: at {check['rtt_ms']:g} ms the speedup keeps {cell(check['predraft_on'])} of its 0 ms value "
            f"with pre-drafting ({cell(check['predraft_off'])} without); required >= {check['required_share']}: "
            f"{verdict}",
        ]
    return "\n".join(lines)


def numbers(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def switches(text: str) -> list[bool]:
    values = {"on": True, "off": False}
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or any(part not in values for part in parts):
        raise argparse.ArgumentTypeError(f"--predraft takes on, off or on,off; got {text!r}")
    return [values[part] for part in parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["capacity", "distance"], help="run one part (default: both)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="history workloads, comma-separated")
    parser.add_argument("--warm", type=int, default=2, help="requests per workload that warm a run's history")
    parser.add_argument("--requests", type=int, default=4, help="measured requests per workload and run")
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--sessions", type=lambda t: [int(n) for n in numbers(t)], default=[1, 4, 16])
    parser.add_argument("--cluster-drafters", type=lambda t: tuple(t.split(",")), default=DEFAULT_DRAFTERS)
    parser.add_argument("--verifier-core", type=int, default=0)
    parser.add_argument("--other-core", type=int, default=1)
    parser.add_argument("--drafter", choices=["ngram", "suffix"], default="ngram", help="the distance drafter")
    parser.add_argument("--rtt-ms", type=numbers, default=[0.0, 1.0, 5.0, 14.0])
    parser.add_argument("--predraft", type=switches, default=[True, False], help="on, off or on,off")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.max_new < 1 or args.requests < 1 or args.warm < 0 or any(n < 1 for n in args.sessions):
        raise SystemExit("--max-new, --requests and --sessions must be at least 1, --warm at least 0")
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    requests, stop = load_requests(args.model, names, args.warm, args.requests)
    started = time.perf_counter()
    report: dict[str, Any] = {"max_new": args.max_new, "workloads": names, "warm": args.warm}
    if args.only in (None, "capacity"):
        report["capacity"] = run_capacity(args, requests, stop)
    if args.only in (None, "distance"):
        report["distance"] = run_distance(args, requests, stop)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(markdown(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log(f"results in {args.out}")
    log(f"took {report['seconds']} s")


if __name__ == "__main__":
    main()
