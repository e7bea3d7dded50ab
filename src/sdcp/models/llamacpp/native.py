"""What the llama.cpp target and drafter share: a GGUF loaded on the CPU into a context whose KV
cache has a sequence per session, each of its own, and llama.cpp's log routed to Python logging."""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from sdcp.models.backend import MAX_SLOT_CAPACITY
from sdcp.models.errors import ModelError, UnknownModel

__all__ = ["PROPOSAL_ROOM", "SEQUENCE_TOKENS_PER_CALL", "NativeContext", "load_native"]

log = logging.getLogger("sdcp.models.llamacpp.target")

# llama.cpp's CPU flash attention computes 64 or more queries of one sequence in a ubatch another
# way than fewer, with logits that differ by up to 2: no llama_decode call holds more tokens of one
# sequence than this (a longer prefill or proposal takes several calls).
SEQUENCE_TOKENS_PER_CALL = 63
# Positions a sequence holds beyond kv_capacity: a proposal's, made near the end of a session whose
# prompt and max_new fill the capacity (a contract's m_max is at most 64, sdcp.protocol.messages).
PROPOSAL_ROOM = 64


@dataclass(frozen=True)
class NativeContext:
    """A loaded model and its context; freed when ``load_native``'s owner is collected."""

    context: llama_cpp.llama_context_p
    memory: llama_cpp.llama_memory_t
    # llama-cpp-python's annotations nest its batch's arrays one level too deep for a checker.
    batch: Any
    vocab_size: int
    # Positions a session may hold, besides a proposal's PROPOSAL_ROOM.
    capacity: int


def load_native(
    gguf: Path,
    *,
    owner: object,
    kv_slots: int,
    kv_capacity: int | None,
    threads: int,
    one_token_threads: int,
    batch_tokens: int,
    native_log: bool,
    vocab_size: int | None = None,
) -> NativeContext:
    """``gguf`` on the CPU (the exactness of docs/models.md is measured on its kernels) with flash
    attention and a KV cache per sequence: ``kv_slots`` sequences of ``kv_capacity`` positions
    (default: the model's training context, at most 4096) and PROPOSAL_ROOM, allocated up front, a
    row for every token of a call of up to ``batch_tokens``. A model whose vocabulary is not
    ``vocab_size`` is refused before its cache is made."""
    most_sequences = llama_cpp.llama_max_parallel_sequences()
    if not 1 <= kv_slots <= most_sequences:
        raise ModelError(f"kv_slots must be 1..{most_sequences} on llama.cpp, got {kv_slots}")
    if threads < 1 or (kv_capacity is not None and kv_capacity < 1):
        raise ModelError(f"threads and kv_capacity must be at least 1, got {threads} and {kv_capacity}")
    _route_native_log(native_log)
    _init_backend()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
    if model is None:
        raise ModelError(f"llama.cpp could not load {gguf}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    assert vocab is not None  # a loaded model has one
    model_vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
    if vocab_size is not None and model_vocab_size != vocab_size:
        llama_cpp.llama_model_free(model)
        raise UnknownModel(f"{gguf.name} has vocabulary {model_vocab_size}, the target {vocab_size}")
    capacity = kv_capacity or min(int(llama_cpp.llama_model_n_ctx_train(model)), MAX_SLOT_CAPACITY)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = kv_slots * (capacity + PROPOSAL_ROOM)
    params.n_seq_max = kv_slots
    # A cache per sequence keeps a session's cells in the order of its positions, whatever the
    # other sessions free: attention runs over cells in their order, and in one shared cache a
    # session's tokens written into cells before its older ones gave logits up to 1 apart.
    # llama.cpp splits a batch of several sequences into ubatches of consecutive sequence ids that
    # feed as many tokens each (hence batches in sequence order).
    params.kv_unified = False
    params.n_batch = params.n_ubatch = batch_tokens
    params.n_outputs_max = 0  # as many rows as tokens in a call
    params.n_outputs_max_per_seq = 0
    # llama.cpp runs a ubatch of one token on n_threads, wider ones on n_threads_batch.
    params.n_threads = one_token_threads
    params.n_threads_batch = threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.no_perf = True
    context = llama_cpp.llama_init_from_model(model, params)
    if context is None:
        llama_cpp.llama_model_free(model)
        raise ModelError(f"llama.cpp could not make a context of {params.n_ctx} positions for {gguf}")
    batch = llama_cpp.llama_batch_init(batch_tokens, 0, 1)
    weakref.finalize(owner, _free_native, model, context, batch)
    memory = llama_cpp.llama_get_memory(context)
    assert memory is not None  # a decoder's context has a KV cache
    return NativeContext(context, memory, batch, model_vocab_size, capacity)


def _log_to_python(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    log.debug("%s", text.decode("utf-8", "replace").rstrip("\n"))


# ctypes holds no reference to a callback handed to C: this one lives as long as the module.
_LOG_CALLBACK = llama_cpp.llama_log_callback(_log_to_python)
# A NULL callback: llama.cpp prints to stderr itself.
_NATIVE_LOG = llama_cpp.llama_log_callback()


def _route_native_log(native: bool) -> None:
    """llama.cpp keeps one log callback per process: the last model loaded decides."""
    llama_cpp.llama_log_set(_NATIVE_LOG if native else _LOG_CALLBACK, ctypes.c_void_p(0))


@functools.cache
def _init_backend() -> None:
    llama_cpp.llama_backend_init()


def _free_native(
    model: llama_cpp.llama_model_p, context: llama_cpp.llama_context_p, batch: llama_cpp.llama_batch
) -> None:
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(context)
    llama_cpp.llama_model_free(model)
