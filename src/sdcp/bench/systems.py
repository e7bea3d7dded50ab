"""The in-process baselines of the benchmark: transformers greedy and speculative, llama.cpp greedy and
speculative on the same GGUF, SDCP's backend alone.

Every system decodes greedily with the same model, prompt, max_new and stop tokens and returns a
``RunResult`` (SDCP's engines in process are ``sdcp.bench.inprocess``, the clusters
``sdcp.bench.cluster``; both read a session's rounds from the verifier's stats, ``result_from_stats``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sdcp.grammar import GrammarConstraint, grammar_tokenizer
from sdcp.models.backend import Target
from sdcp.protocol.constraint import constrain_rows
from sdcp.protocol.messages import Constraint

if TYPE_CHECKING:  # llama-cpp-python is optional: imported only when its systems are built
    from llama_cpp.llama_speculative import LlamaDraftModel

__all__ = [
    "HF_PROMPT_LOOKUP_TOKENS",
    "HFAssistedSystem",
    "HFPromptLookupSystem",
    "HFTargetSystem",
    "LLAMACPP_PROMPT_LOOKUP_TOKENS",
    "LlamaCppPromptLookupSystem",
    "LlamaCppTargetSystem",
    "RunResult",
    "TargetOnlySDCPSystem",
    "non_model_ms",
    "result_from_stats",
]

# transformers' documented example value for prompt lookup decoding.
HF_PROMPT_LOOKUP_TOKENS = 10
# llama-cpp-python's default for LlamaPromptLookupDecoding, the same as transformers' above.
LLAMACPP_PROMPT_LOOKUP_TOKENS = 10
# llama.cpp pads its context to a multiple of this, while llama-cpp-python sizes its own token and
# logit arrays by the n_ctx it was given: a speculative pass into the padding overruns them.
_LLAMACPP_CONTEXT_PADDING = 256


@dataclass
class RunResult:
    """One generation: tokens, wall time and, for SDCP systems, what its rounds did."""

    tokens: list[int]
    seconds: float
    rounds: int = 0
    self_decoded: int = 0
    # The target passes of the self-decoded rounds (the verifier's stats).
    self_passes: int = 0
    accepted: int = 0
    proposed: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)
    # Per round after the first: wall time minus the model's time (ms).
    overhead_ms: list[float] = field(default_factory=list)
    # Per token after the first: time since the previous token arrived (ms).
    inter_token_ms: list[float] = field(default_factory=list)
    # From the start of the generation to its first token (ms); None where the system cannot tell.
    first_token_ms: float | None = None
    batch_sizes: list[int] = field(default_factory=list)
    # Who drafted for the session, in order (cluster systems): instance names, or "self-decoding".
    served: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def non_model_ms(stats: dict[str, Any]) -> list[float]:
    """Per round after the first: time between commits minus the model's time in the round."""
    gaps = stats.get("round_gap_us", [])
    model = stats.get("round_model_us", [])
    return [(gap - used) / 1000 for gap, used in list(zip(gaps, model, strict=False))[1:]]


def result_from_stats(stats: dict[str, Any], seconds: float) -> RunResult:
    """What a session's rounds did, from the verifier's stats (GET sessions/{id}/stats)."""
    return RunResult(
        tokens=[],
        seconds=seconds,
        rounds=int(stats.get("rounds", 0)),
        self_decoded=int(stats.get("self_decoded", 0)),
        self_passes=int(stats.get("self_passes", 0)),
        accepted=int(stats.get("accepted", 0)),
        proposed=int(stats.get("proposed", 0)),
        accepted_by_position=list(stats.get("accepted_by_position", [])),
        proposed_by_position=list(stats.get("proposed_by_position", [])),
        overhead_ms=non_model_ms(stats),
        # Rounds committed from rows of an earlier pass (self-decoding lookahead) report 0.
        batch_sizes=[size for size in stats.get("round_batch", []) if size > 0],
    )


class _HFGenerateSystem:
    """transformers ``generate`` with greedy decoding; subclasses add the speculative options."""

    name = "hf_target"

    def __init__(self, model: Any, stop: Sequence[int]) -> None:
        self.model = model
        self.stop = list(stop)

    def options(self) -> dict[str, Any]:
        return {}

    def generate(self, prompt: Sequence[int], max_new: int) -> RunResult:
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=max_new,
                eos_token_id=self.stop or None,
                pad_token_id=self.stop[0] if self.stop else 0,
                **self.options(),
            )
        seconds = time.perf_counter() - started
        return RunResult(tokens=[int(t) for t in output[0, input_ids.shape[1] :]], seconds=seconds)


class HFTargetSystem(_HFGenerateSystem):
    """System 1: target-only greedy decoding."""

    name = "hf_target"


class HFPromptLookupSystem(_HFGenerateSystem):
    """System 2: transformers prompt lookup decoding (the in-process n-gram drafter)."""

    name = "hf_prompt_lookup"

    def options(self) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}


class HFAssistedSystem(_HFGenerateSystem):
    """System 2b: transformers assisted generation with a draft model."""

    name = "hf_assisted"

    def __init__(self, model: Any, stop: Sequence[int], assistant: Any) -> None:
        super().__init__(model, stop)
        self.assistant = assistant

    def options(self) -> dict[str, Any]:
        return {"assistant_model": self.assistant}


class TargetOnlySDCPSystem:
    """SDCP's target backend decoding one token per pass: no drafts, no protocol.

    Its gap to ``hf_target`` is what the backend itself gains (sdcp.models.hf.packed); the gap between
    it and the speculative systems is what speculation gains on top. Under a constraint it decodes
    the masked target (the most probable token the grammar allows, as the verifier's rule 1 does):
    structured output's baseline, with the grammar on.
    """

    name = "sdcp_target_only"

    def __init__(self, target: Target, stop: Sequence[int]) -> None:
        self.target = target
        self.stop = set(stop)
        self._sessions = 0

    def generate(self, prompt: Sequence[int], max_new: int, constraint: Constraint | None = None) -> RunResult:
        self._sessions += 1
        session = (1 << 64 | self._sessions).to_bytes(16, "big")
        tokens: list[int] = []
        first_token_ms: float | None = None
        started = time.perf_counter()
        grammar = None
        if constraint is not None:
            # Compiled within the timed generation, as the verifier compiles a session's at its open.
            vocab = self.target.vocab_size
            tokenizer = grammar_tokenizer(self.target.tokenizer_definition, vocab)
            grammar = GrammarConstraint(tokenizer, constraint, sorted(self.stop), vocab)
        self.target.open_session(session, list(prompt))
        try:
            while len(tokens) < max_new and not (tokens and tokens[-1] in self.stop):
                (row,) = self.target.score([(session, ())])
                if grammar is not None:
                    row = constrain_rows(row[:1], grammar.allowed(()), len(tokens), 0, sorted(self.stop))
                token = int(row[0].argmax())
                if grammar is not None:
                    grammar.commit([token])
                self.target.commit(session, 0, [token])
                tokens.append(token)
                if first_token_ms is None:
                    first_token_ms = 1000 * (time.perf_counter() - started)
        finally:
            self.target.close_session(session)
        return RunResult(tokens=tokens, seconds=time.perf_counter() - started, first_token_ms=first_token_ms)


class LlamaCppTargetSystem:
    """llama.cpp greedy decoding of the GGUF that SDCP's fp32 weights were dequantised from: what a
    CPU user runs instead of transformers. One token per pass, no speculation.

    llama.cpp computes with the quantised weights (Q4_1 against 8-bit activations), so its greedy
    output may part from the fp32 systems' where two tokens are almost tied; the report counts it.
    """

    name = "llamacpp_target"

    def __init__(self, gguf: Path, stop: Sequence[int], *, context_tokens: int, threads: int) -> None:
        """``context_tokens``: the prompt and max_new of the longest generation it will decode."""
        from llama_cpp import Llama

        self.stop = set(stop)
        # Room for the drafts of the last round too, which go past max_new.
        needed = context_tokens + 1 + LLAMACPP_PROMPT_LOOKUP_TOKENS
        self.llama = Llama(
            model_path=str(gguf),
            n_ctx=math.ceil(needed / _LLAMACPP_CONTEXT_PADDING) * _LLAMACPP_CONTEXT_PADDING,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=self.draft_model(),
            verbose=False,
        )

    def draft_model(self) -> LlamaDraftModel | None:
        return None

    def generate(self, prompt: Sequence[int], max_new: int) -> RunResult:
        tokens: list[int] = []
        inter_token_ms: list[float] = []
        first_token_ms: float | None = None
        started = previous = time.perf_counter()
        # Every prompt is evaluated from scratch: generate() would otherwise keep the KV cache of
        # the prefix it shares with the previous prompt, which no other system gets. (reset() is
        # unannotated; "unused-ignore" for when llama_cpp joins untyped_calls_exclude.)
        self.llama.reset()  # type: ignore[no-untyped-call,unused-ignore]
        for token in self.llama.generate(list(prompt), top_k=1, temp=0.0):
            now = time.perf_counter()
            if first_token_ms is None:
                first_token_ms = 1000 * (now - started)
            else:
                inter_token_ms.append(1000 * (now - previous))
            previous = now
            tokens.append(int(token))
            if len(tokens) >= max_new or tokens[-1] in self.stop:
                break
        return RunResult(
            tokens=tokens,
            seconds=time.perf_counter() - started,
            inter_token_ms=inter_token_ms,
            first_token_ms=first_token_ms,
        )


class LlamaCppPromptLookupSystem(LlamaCppTargetSystem):
    """llama-cpp-python's own speculative decoding with prompt lookup drafts, greedy.

    Its drafts are checked in one pass of several tokens, whose rounding differs from one-token
    passes: near ties can fall the other way than in ``llamacpp_target`` (the report counts it).
    """

    name = "llamacpp_prompt_lookup"

    def draft_model(self) -> LlamaDraftModel | None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        return LlamaPromptLookupDecoding(num_pred_tokens=LLAMACPP_PROMPT_LOOKUP_TOKENS)
