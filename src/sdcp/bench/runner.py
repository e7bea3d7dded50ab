"""Run every system on every prompt, alternating systems, and collect what the report needs.

Within one repeat the systems take turns on each prompt, the order rotating from prompt to prompt
and between repeats (``workloads.rotated``), so that load from other work on the machine spreads over all
of them and no system always runs right after the same other one (with one order for a whole repeat,
every request of the default cluster came right after target-only decoding on both cores in the
bench's own process). Ratios are computed within each repeat and the report gives their median.
The workloads where history matters run in the first repeat only: a second would send each cluster
requests whose answers its drafters have already seen.
The structured workload (JSON schema prompts) runs on SDCP's target alone with the grammar on, its
baseline, on SDCP's engines in process, on the n-gram-only cluster and on the default cluster
through the gateway, whose request carries the schema as a user's does (``STRUCTURED_SYSTEMS``).

``workloads`` and ``systems`` of the configuration run a part of the benchmark (`sdcp bench
--workloads structured --systems sdcp_target_only,sdcp_default`): the concurrency sweep runs only
with the n-gram-only cluster and the non-repetitive prompts, the noisy neighbour only with the
default cluster and the open prompts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdcp.bench.cluster import ClusterSystem, GatewaySystem
from sdcp.bench.inprocess import InProcessSDCPSystem
from sdcp.bench.redis_process import local_redis_server, redis_server_available
from sdcp.bench.systems import (
    HFAssistedSystem,
    HFPromptLookupSystem,
    HFTargetSystem,
    LlamaCppPromptLookupSystem,
    LlamaCppTargetSystem,
    RunResult,
    TargetOnlySDCPSystem,
)
from sdcp.bench.workloads import (
    CHAT_WORKLOADS,
    CORE_WORKLOADS,
    DEFAULT_PROMPTS_DIR,
    HISTORY_QUICK_PROMPTS,
    HISTORY_WORKLOADS,
    STRUCTURED_WORKLOAD,
    BenchInputError,
    Conversations,
    Prompt,
    Workload,
    load_history_workloads,
    load_structured_workload,
    load_workloads,
    rotated,
    tokenize_prompt,
    warm_up_prompts,
)
from sdcp.models.backend import Target
from sdcp.models.choice import choose_backend
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel, end_of_text_tokens, load_model, load_target
from sdcp.models.weights.fetch import SMOLLM2_NAME, smollm2_gguf
from sdcp.models.weights.paths import TINY_DRAFT_NAME, TINY_NAME
from sdcp.models.worker import ModelThread
from sdcp.threads import usable_cores

__all__ = ["ALL_SYSTEMS", "ALL_WORKLOADS", "BenchConfig", "Measurement", "run_bench"]

# Time for the model threads to notice a neighbour before the busy measurement starts.
_NEIGHBOUR_SETTLE_S = 2.0

# Systems whose outputs must equal target-only greedy decoding token for token (SDCP's target-only
# decoding on its backend; transformers' only where that backend is torch).
EXACT_SYSTEMS = ("hf_target", "sdcp_target_only", "sdcp_inprocess", "sdcp_e2e", "sdcp_e2e_redis", "sdcp_default")
# The systems that run the chat workloads: what a user compares (plain and prompt-lookup decoding
# in transformers and in llama.cpp, the default cluster), SDCP's target alone (the reference of
# exactness) and the n-gram-only cluster the default is held against.
CHAT_SYSTEMS = (
    "hf_target",
    "sdcp_target_only",
    "hf_prompt_lookup",
    "llamacpp_target",
    "llamacpp_prompt_lookup",
    "sdcp_e2e",
    "sdcp_default",
)
# The workloads only CHAT_SYSTEMS run.
USER_WORKLOADS = (*CHAT_WORKLOADS, *HISTORY_WORKLOADS)
# The systems that run the structured workload, each with its prompts' constraints: the masked target
# alone (the baseline with the grammar on), and the engines in process, the n-gram-only cluster and
# the default cluster through the gateway (response_format), whose outputs must equal it (rule 1).
# Plain llama.cpp is left out: its JSON schema grammar is another language (whitespace between
# tokens) over the GGUF's quantised weights, so no output of it could be compared (performance.md).
STRUCTURED_SYSTEMS = ("sdcp_target_only", "sdcp_inprocess", "sdcp_e2e", "sdcp_default")
# Every system and workload a run can be limited to (BenchConfig.systems, .workloads).
ALL_SYSTEMS = (
    "hf_target",
    "hf_prompt_lookup",
    "hf_assisted",
    "llamacpp_target",
    "llamacpp_prompt_lookup",
    "sdcp_target_only",
    "sdcp_inprocess",
    "sdcp_e2e",
    "sdcp_default",
    "sdcp_e2e_redis",
)
ALL_WORKLOADS = (*CORE_WORKLOADS, *CHAT_WORKLOADS, *HISTORY_WORKLOADS, STRUCTURED_WORKLOAD)


@dataclass(frozen=True)
class BenchConfig:
    out: Path
    model: str = "smollm2"
    quick: bool = False
    prompts_dir: Path = DEFAULT_PROMPTS_DIR
    per_workload: int | None = None
    max_new: int | None = None
    repeats: int | None = None
    concurrency: tuple[int, ...] | None = None
    redis: bool = True
    # Only these workloads and systems run, where given (None: all of them).
    workloads: tuple[str, ...] | None = None
    systems: tuple[str, ...] | None = None

    def runs(self, system: str) -> bool:
        return self.systems is None or system in self.systems

    def check_selection(self) -> None:
        """A typed error for an unknown workload or system, or a selection without the reference."""
        for kind, given, known in (("workload", self.workloads, ALL_WORKLOADS), ("system", self.systems, ALL_SYSTEMS)):
            unknown = [name for name in given or () if name not in known]
            if unknown:
                raise BenchInputError(f"no {kind} {', '.join(unknown)}; the {kind}s are {', '.join(known)}")
            if given is not None and not given:
                raise BenchInputError(f"name at least one {kind}")
        if not self.runs("sdcp_target_only"):
            raise BenchInputError("sdcp_target_only must run: the outputs are compared with its own")

    @property
    def effective_per_workload(self) -> int | None:
        return self.per_workload if self.per_workload is not None else (2 if self.quick else None)

    @property
    def effective_history_per_workload(self) -> int | None:
        """Requests per history workload: ``per_workload`` when given, a few for --quick, else all."""
        if self.per_workload is not None:
            return self.per_workload
        return HISTORY_QUICK_PROMPTS if self.quick else None

    @property
    def effective_max_new(self) -> int:
        return self.max_new if self.max_new is not None else (64 if self.quick else 128)

    @property
    def effective_repeats(self) -> int:
        return self.repeats if self.repeats is not None else (2 if self.quick else 3)

    @property
    def effective_concurrency(self) -> tuple[int, ...]:
        if self.concurrency is not None:
            return self.concurrency
        return (1, 16) if self.quick else (1, 4, 8, 16)


@dataclass
class Measurement:
    system: str
    workload: str
    prompt: int
    repeat: int
    result: RunResult


@dataclass
class ConcurrencyLevel:
    sessions: int
    tokens: int
    seconds: float
    inter_token_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)


@dataclass
class BenchData:
    config: BenchConfig
    workloads: list[Workload]
    measurements: list[Measurement]
    concurrency: list[ConcurrencyLevel]
    systems: list[str]
    seconds: float
    # The default cluster's tokens per second on the open prompts without and with one core kept
    # busy by an unrelated process (docs/deploy.md, "Threads and cores").
    neighbour: dict[str, float] = field(default_factory=dict)
    # Who runs SDCP's target, in process and in the clusters (`backend = "auto"`'s choice).
    backend: str = "torch"


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_bench(config: BenchConfig, log: Callable[[str], None] = _log) -> BenchData:
    if config.effective_max_new < 1 or config.effective_repeats < 1:
        raise BenchInputError("max_new and repeats must be at least 1")
    if any(level < 1 for level in config.effective_concurrency):
        raise BenchInputError("concurrency levels must be at least 1")
    config.check_selection()
    started = time.perf_counter()
    workloads = load_workloads(config.prompts_dir, per_workload=config.effective_per_workload)
    history = load_history_workloads(config.prompts_dir, per_workload=config.effective_history_per_workload)
    missing = [name for name in HISTORY_WORKLOADS if name not in {w.name for w in history}]
    if missing:
        log(f"history workloads left out (no prompt file in {config.prompts_dir}): {', '.join(missing)}")
    workloads += history
    structured = load_structured_workload(config.prompts_dir, per_workload=config.effective_per_workload)
    if structured is None:
        log(f"the {STRUCTURED_WORKLOAD} workload left out (no prompt file in {config.prompts_dir})")
    else:
        workloads.append(structured)
    if config.workloads is not None:
        workloads = [w for w in workloads if w.name in config.workloads]
        if not workloads:
            raise BenchInputError(f"none of the workloads {', '.join(config.workloads)} has a prompt file")
    config.out.mkdir(parents=True, exist_ok=True)
    log(f"loading {config.model}")
    loaded = load_model(config.model)
    tokenizer = loaded.tokenizer
    stop = end_of_text_tokens(tokenizer)
    target = _sdcp_target(config, loaded, log)
    backend = target.backend
    prompts = {
        w.name: [
            Prompt(p, tuple(tokenize_prompt(tokenizer, p)), constraint=w.constraint_at(i))
            for i, p in enumerate(w.prompts)
        ]
        for w in workloads
    }
    in_process: list[Any] = [HFTargetSystem(loaded.model, stop), HFPromptLookupSystem(loaded.model, stop)]
    if config.model == TINY_NAME:
        in_process.append(HFAssistedSystem(loaded.model, stop, load_model(TINY_DRAFT_NAME).model))
    longest = max(
        len(prompt.tokens) + _conversation_room(w, prompts[w.name], index, config.effective_max_new)
        for w in workloads
        for index, prompt in enumerate(prompts[w.name])
    )
    if config.runs("llamacpp_target") or config.runs("llamacpp_prompt_lookup"):
        context_tokens = longest + config.effective_max_new
        in_process.extend(_llamacpp_systems(config, stop, context_tokens=context_tokens, log=log))
    in_process.append(TargetOnlySDCPSystem(target, stop))
    if config.runs("sdcp_inprocess"):
        in_process.append(InProcessSDCPSystem(target, stop))
    in_process = [system for system in in_process if config.runs(system.name)]
    with ExitStack() as stack:
        clusters: list[ClusterSystem] = []
        if config.runs("sdcp_e2e"):
            clusters.append(ClusterSystem(config.out / "sdcp-home", config.model))
        if config.runs("sdcp_default"):
            chat = bool(getattr(tokenizer, "chat_template", None))
            clusters.append(GatewaySystem(config.out / "sdcp-home-default", config.model, chat=chat))
        if config.runs("sdcp_e2e_redis") and config.redis and redis_server_available():
            redis_url = stack.enter_context(local_redis_server(config.out / "redis"))
            clusters.append(
                ClusterSystem(config.out / "sdcp-home-redis", config.model, redis_url=redis_url, name="sdcp_e2e_redis")
            )
        try:
            for cluster in clusters:
                log(f"starting the local cluster {cluster.name}")
                cluster.start()
            measurements, levels, neighbour = asyncio.run(
                _measure(config, in_process, clusters, prompts, stop, log, workloads=workloads, tokenizer=tokenizer)
            )
        finally:
            for cluster in clusters:
                cluster.stop()
    systems = [system.name for system in in_process] + [cluster.name for cluster in clusters]
    seconds = time.perf_counter() - started
    return BenchData(config, workloads, measurements, levels, systems, seconds, neighbour, backend)


def _conversation_room(workload: Workload, prompts: list[Prompt], index: int, max_new: int) -> int:
    """Tokens a later turn of a conversation adds to its turn in the file: each earlier turn (at
    most its templated prompt) and answer (up to max_new tokens), and the last answer quoted."""
    earlier = 0
    while workload.continues_at(index - earlier):
        earlier += 1
    if not earlier:
        return 0
    return sum(len(prompts[index - back].tokens) for back in range(1, earlier + 1)) + (earlier + 1) * max_new


def _sdcp_target(config: BenchConfig, loaded: LoadedModel, log: Callable[[str], None]) -> Target:
    """The target of SDCP's in-process systems: on the backend a verifier of `sdcp up` chooses."""
    threads = usable_cores()
    choice = choose_backend("auto", config.model, device="cpu", threads=threads)
    log(f"SDCP's target runs on {choice.backend} ({choice.reason})")
    if choice.backend == "torch":
        return TargetModel(loaded.model, loaded.tokenizer, name=loaded.name)
    return load_target(config.model, backend=choice.backend, threads=threads)


def _llamacpp_systems(
    config: BenchConfig, stop: list[int], *, context_tokens: int, log: Callable[[str], None]
) -> list[LlamaCppTargetSystem]:
    """llama.cpp greedy and prompt lookup on the bundled model's GGUF, with as many threads as the
    verifier gets; none (and one line saying why) where that cannot run."""
    gguf = smollm2_gguf()
    if config.model != SMOLLM2_NAME:
        reason = f"the model is {config.model}, not {SMOLLM2_NAME}, whose GGUF they run"
    elif importlib.util.find_spec("llama_cpp") is None:
        reason = "llama_cpp (llama-cpp-python) is not installed"
    elif not gguf.is_file():
        reason = f"{gguf} is missing (sdcp models fetch keeps it)"
    else:
        threads = usable_cores()
        return [
            LlamaCppTargetSystem(gguf, stop, context_tokens=context_tokens, threads=threads),
            LlamaCppPromptLookupSystem(gguf, stop, context_tokens=context_tokens, threads=threads),
        ]
    log(f"llamacpp_target and llamacpp_prompt_lookup skipped: {reason}")
    return []


async def _measure(
    config: BenchConfig,
    in_process: list[Any],
    clusters: list[ClusterSystem],
    prompts: dict[str, list[Prompt]],
    stop: list[int],
    log: Callable[[str], None],
    *,
    workloads: list[Workload],
    tokenizer: Any,
) -> tuple[list[Measurement], list[ConcurrencyLevel], dict[str, float]]:
    max_new = config.effective_max_new
    by_name = {workload.name: workload for workload in workloads}
    engines = [system for system in in_process if isinstance(system, InProcessSDCPSystem)]
    for system in engines:
        await system.start()
    for cluster in clusters:
        await cluster.connect()
    # One thread runs every in-process system's model work: the engines' model thread (one of its
    # own where they do not run). Two threads that run torch each bring an OpenMP team, whose
    # spinning workers slow the other's passes.
    own_thread = None if engines else ModelThread("bench-baselines")
    try:
        runners: list[tuple[str, Callable[[Prompt, int], Any]]] = []
        model_thread = engines[0].verifier.scorer if engines else own_thread
        if own_thread is not None:
            # What the engines' verifier does at its start (packed weights, digests).
            for system in in_process:
                if isinstance(system, TargetOnlySDCPSystem):
                    await own_thread.run_async(system.target.prepare)
        for system in in_process:
            if isinstance(system, InProcessSDCPSystem):
                runners.append((system.name, _engines(system)))
            else:
                runners.append((system.name, _on_model_thread(model_thread, system.generate)))
        for cluster in clusters:
            runners.append((cluster.name, _bound(cluster, stop)))
        warm, structured_warm = warm_up_prompts(tokenizer, prompts.get(STRUCTURED_WORKLOAD, []))
        for name, run in runners:
            log(f"warming up {name}")
            await run(warm, min(8, max_new))
            if structured_warm is not None and name in STRUCTURED_SYSTEMS:
                await run(structured_warm, min(8, max_new))
        measurements: list[Measurement] = []
        for repeat in range(config.effective_repeats):
            turn = 0
            for workload, workload_prompts in prompts.items():
                if workload in HISTORY_WORKLOADS and repeat > 0:
                    continue
                conversations = Conversations(tokenizer, by_name[workload])
                for index, prompt in enumerate(workload_prompts):
                    # One further at each prompt, and each repeat's first prompt one further again.
                    order, turn = rotated(runners, repeat + turn), turn + 1
                    for name, run in order:
                        if workload in USER_WORKLOADS and name not in CHAT_SYSTEMS:
                            continue
                        if workload == STRUCTURED_WORKLOAD and name not in STRUCTURED_SYSTEMS:
                            continue
                        sent = conversations.prompt(name, index, prompt)
                        result = await run(sent, max_new)
                        conversations.answered(name, sent, result.tokens)
                        measurements.append(Measurement(name, workload, index, repeat, result))
                        log(
                            f"repeat {repeat + 1} {workload}[{index}] {name}: {len(result.tokens)} tokens, "
                            f"{result.tokens_per_s:.1f} tok/s"
                        )
        e2e = next((cluster for cluster in clusters if cluster.name == "sdcp_e2e"), None)
        levels: list[ConcurrencyLevel] = []
        if e2e is not None and "nonrepetitive" in prompts:
            levels = await _concurrency_sweep(config, e2e, prompts, stop, log)
        else:
            log("concurrency sweep left out (it runs sdcp_e2e on the nonrepetitive prompts)")
        default = next((cluster for cluster in clusters if isinstance(cluster, GatewaySystem)), None)
        neighbour: dict[str, float] = {}
        if default is not None and "open" in prompts:
            neighbour = await _noisy_neighbour(config, default, prompts["open"], stop, log)
        else:
            log("noisy neighbour left out (it runs sdcp_default on the open prompts)")
        return measurements, levels, neighbour
    finally:
        for cluster in clusters:
            await cluster.aclose()
        for system in engines:
            await system.aclose()
        if own_thread is not None:
            own_thread.close()


def _engines(system: InProcessSDCPSystem) -> Callable[[Prompt, int], Any]:
    async def run(prompt: Prompt, max_new: int) -> RunResult:
        return await system.generate(list(prompt.tokens), max_new, constraint=prompt.constraint)

    return run


def _on_model_thread(thread: ModelThread | None, generate: Callable[..., RunResult]) -> Callable[[Prompt, int], Any]:
    """A baseline's generation, on the model thread when there is one (else on this thread, which
    then blocks the loop: nothing else runs meanwhile). A prompt's constraint goes to the systems
    that take one: only STRUCTURED_SYSTEMS are sent prompts that have one."""

    async def run(prompt: Prompt, max_new: int) -> RunResult:
        arguments: tuple[object, ...] = (list(prompt.tokens), max_new)
        if prompt.constraint is not None:
            arguments += (prompt.constraint,)
        if thread is None:
            return generate(*arguments)
        return await thread.run_async(generate, *arguments)

    return run


def _bound(cluster: ClusterSystem, stop: list[int]) -> Callable[[Prompt, int], Any]:
    async def run(prompt: Prompt, max_new: int) -> RunResult:
        return await cluster.generate(prompt, max_new, stop)

    return run


async def _concurrency_sweep(
    config: BenchConfig,
    cluster: ClusterSystem,
    prompts: dict[str, list[Prompt]],
    stop: list[int],
    log: Callable[[str], None],
) -> list[ConcurrencyLevel]:
    """N sessions at once over the non-repetitive prompts (cycled), aggregate tokens per second.

    A single session is measured as one session at a time over the same prompts, so that every
    level decodes the same mix of text.
    """
    pool = prompts["nonrepetitive"]
    max_new = config.effective_max_new
    levels = []
    for sessions in config.effective_concurrency:
        chosen = [pool[i % len(pool)] for i in range(max(sessions, len(pool) if sessions == 1 else sessions))]
        started = time.perf_counter()
        if sessions == 1:
            results = [await cluster.generate(prompt, max_new, stop) for prompt in chosen]
        else:
            results = list(await asyncio.gather(*(cluster.generate(p, max_new, stop) for p in chosen)))
        seconds = time.perf_counter() - started
        level = ConcurrencyLevel(
            sessions=sessions,
            tokens=sum(len(r.tokens) for r in results),
            seconds=seconds,
            inter_token_ms=[gap for r in results for gap in r.inter_token_ms],
            batch_sizes=[size for r in results for size in r.batch_sizes],
        )
        levels.append(level)
        log(
            f"concurrency {sessions}: {level.tokens / seconds:.1f} tok/s aggregate, "
            f"mean batch {statistics.fmean(level.batch_sizes) if level.batch_sizes else 0:.1f}"
        )
    return levels


async def _noisy_neighbour(
    config: BenchConfig, cluster: ClusterSystem, pool: list[Prompt], stop: list[int], log: Callable[[str], None]
) -> dict[str, float]:
    """The default cluster on the open prompts, then the same with an unrelated process keeping one
    core busy: the cluster should lose about that core, not most of its speed."""
    max_new = config.effective_max_new

    async def rate() -> float:
        results = [await cluster.generate(prompt, max_new, stop) for prompt in pool]
        seconds = sum(r.seconds for r in results)
        return sum(len(r.tokens) for r in results) / seconds if seconds > 0 else 0.0

    idle = await rate()
    busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        await asyncio.sleep(_NEIGHBOUR_SETTLE_S)  # the governors notice the neighbour within a second
        busy = await rate()
    finally:
        busy_loop.kill()
        busy_loop.wait()
    log(f"noisy neighbour: {idle:.1f} tok/s alone, {busy:.1f} tok/s with one core busy")
    return {
        "idle_tokens_per_s": round(idle, 2),
        "busy_tokens_per_s": round(busy, 2),
        "busy_vs_idle": round(busy / idle, 3) if idle > 0 else 0.0,
    }
