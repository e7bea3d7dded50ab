"""Which backend runs a verifier's target when its configuration says `backend = "auto"`: the one
that decodes faster on this host, measured (docs/models.md, "Choosing the backend").

Only a model both backends can run is measured: the bundled `smollm2` (its fp32 safetensors on
torch, its GGUF as shipped on llama.cpp) on the CPU. A `.gguf` path runs on llama.cpp, a Hugging
Face directory, a test model or another device on torch, and a host without llama-cpp-python on
torch. The measurement (a few passes of each backend in the two shapes a verifier runs: one token,
and a proposal of `_DRAFT_TOKENS`) is kept in the models directory, keyed by what it depends on
(model, CPU, threads, library versions), so a host measures once; deleting the file measures again.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from sdcp.models.backend import BackendSetting, Target, TargetBackend
from sdcp.models.weights.fetch import SMOLLM2_NAME, models_dir

__all__ = ["CHOICES_FILE", "BackendChoice", "choose_backend", "known_backend"]

log = logging.getLogger("sdcp.models.choice")

CHOICES_FILE = "backend-choices.json"

# The measured passes: a prompt of chat length, then one-token passes (self-decoding) and passes
# of a proposal (verification), each repeated; the medians of both shapes, summed, decide.
_PROMPT_TOKENS = 96
_DRAFT_TOKENS = 7
_REPEATS = 7
_MEASURE_SESSION = b"backend-choice!!"


@dataclass(frozen=True)
class BackendChoice:
    backend: TargetBackend
    reason: str
    # Median milliseconds of a one-token pass and of a proposal's pass, per backend measured.
    measured_ms: dict[str, tuple[float, float]]


def choose_backend(
    setting: BackendSetting,
    model: str,
    *,
    device: str,
    threads: int,
    home: Path | None = None,
    load: Callable[[TargetBackend], Target] | None = None,
) -> BackendChoice:
    """The backend for ``model`` under ``setting``; ``load`` makes a small target of a backend to
    measure (default: `sdcp.models.registry.load_target` with one KV slot)."""
    known = known_backend(setting, model, device=device, threads=threads, home=home)
    if known is not None:
        return known
    cache = models_dir(home) / CHOICES_FILE
    key = _measurement_key(model, threads)
    cache.parent.mkdir(parents=True, exist_ok=True)
    # One measurement per host: processes that start together (a verifier, `sdcp models digest`)
    # wait for the first and read its choice, so that they agree on the backend and so on the
    # target digest a contract must name.
    with (cache.parent / f"{CHOICES_FILE}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        measured_before = _known_choice(cache, key)
        if measured_before is not None:
            return measured_before
        measured = {backend: _measure(load or _small_target(model, threads, home), backend) for backend in _BACKENDS}
        fastest = min(measured, key=lambda backend: sum(measured[backend]))
        choice = BackendChoice(fastest, "measured", {backend: ms for backend, ms in measured.items()})
        _write_choice(cache, key, choice)
    return choice


def known_backend(
    setting: BackendSetting, model: str, *, device: str, threads: int, home: Path | None = None
) -> BackendChoice | None:
    """The choice where it needs no measurement now (configured, decided by the model, or measured
    before), else None; imports neither torch nor llama.cpp, so that a process can act on it first."""
    if setting != "auto":
        return BackendChoice(setting, "configured", {})
    if model.endswith(".gguf"):
        return BackendChoice("llamacpp", "a GGUF file runs on llama.cpp", {})
    if model != SMOLLM2_NAME:
        return BackendChoice("torch", f"{model} is not a GGUF model", {})
    if device != "cpu":
        return BackendChoice("torch", f"llama.cpp runs on the cpu here, the target on {device}", {})
    if importlib.util.find_spec("llama_cpp") is None:
        return BackendChoice("torch", "llama-cpp-python is not installed", {})
    return _known_choice(models_dir(home) / CHOICES_FILE, _measurement_key(model, threads))


_BACKENDS: tuple[TargetBackend, ...] = ("torch", "llamacpp")


def _small_target(model: str, threads: int, home: Path | None) -> Callable[[TargetBackend], Target]:
    def load(backend: TargetBackend) -> Target:
        from sdcp.models.registry import load_target

        return load_target(model, home=home, backend=backend, threads=threads, kv_slots=1, kv_capacity=256)

    return load


def _measure(load: Callable[[TargetBackend], Target], backend: TargetBackend) -> tuple[float, float]:
    target = load(backend)
    target.prepare()
    vocab = target.vocab_size
    prompt = [(index * 7919) % vocab for index in range(1, _PROMPT_TOKENS + 1)]
    target.open_session(_MEASURE_SESSION, prompt)
    one_token = _median_ms(lambda: target.score([(_MEASURE_SESSION, ())]), target)
    proposal = _median_ms(lambda: target.score([(_MEASURE_SESSION, prompt[:_DRAFT_TOKENS])]), target)
    target.close_session(_MEASURE_SESSION)
    log.info("backend %s: %.1f ms a one-token pass, %.1f ms a proposal's", backend, one_token, proposal)
    return one_token, proposal


def _median_ms(run_pass: Callable[[], object], target: Target) -> float:
    run_pass()  # the first pass pays one-time work (buffers, thread pools)
    target.rollback(_MEASURE_SESSION)
    times = []
    for _ in range(_REPEATS):
        started = time.perf_counter()
        run_pass()
        times.append(time.perf_counter() - started)
        target.rollback(_MEASURE_SESSION)
    return statistics.median(times) * 1000


def _measurement_key(model: str, threads: int) -> str:
    return (
        f"{model} | {_cpu_name()} | {threads} threads | torch {_version('torch')}"
        f" | llama-cpp-python {_version('llama-cpp-python')}"
    )


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_choices(cache: Path) -> dict[str, dict[str, object]]:
    try:
        known = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _known_choice(cache: Path, key: str) -> BackendChoice | None:
    """The choice measured before, or None where there is none or the entry is not one we wrote."""
    entry = _read_choices(cache).get(key)
    if not isinstance(entry, dict) or entry.get("backend") not in _BACKENDS:
        return None
    measured = entry.get("measured_ms")
    if not isinstance(measured, dict):
        return None
    try:
        measured_ms = {str(name): (float(ms[0]), float(ms[1])) for name, ms in measured.items()}
    except (TypeError, ValueError, IndexError, KeyError):
        return None
    backend: TargetBackend = "llamacpp" if entry["backend"] == "llamacpp" else "torch"
    return BackendChoice(backend, f"measured on this host before ({cache})", measured_ms)


def _write_choice(cache: Path, key: str, choice: BackendChoice) -> None:
    """Atomically, so that verifiers starting together never read half a file."""
    known = _read_choices(cache)
    known[key] = asdict(choice) | {"reason": "measured"}
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}")
    partial.write_text(json.dumps(known, indent=2) + "\n", encoding="utf-8")
    partial.replace(cache)
