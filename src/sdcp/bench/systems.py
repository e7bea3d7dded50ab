"""The in-process baselines of the benchmark: transformers greedy and speculative, SDCP's backend alone.

Every system decodes greedily with the same model, prompt, max_new and stop tokens and returns a
``RunResult`` (SDCP's engines in process are ``sdcp.bench.inprocess``, the clusters
``sdcp.bench.cluster``; both read a session's rounds from the verifier's stats, ``result_from_stats``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sdcp.models.target import TargetModel

__all__ = [
    "HF_PROMPT_LOOKUP_TOKENS",
    "HFAssistedSystem",
    "HFPromptLookupSystem",
    "HFTargetSystem",
    "RunResult",
    "TargetOnlySDCPSystem",
    "non_model_ms",
    "result_from_stats",
]

# transformers' documented example value for prompt lookup decoding.
HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass
class RunResult:
    """One generation: tokens, wall time and, for SDCP systems, what its rounds did."""

    tokens: list[int]
    seconds: float
    rounds: int = 0
    self_decoded: int = 0
    accepted: int = 0
    proposed: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)
    # Per round after the first: wall time minus the model's time (ms).
    overhead_ms: list[float] = field(default_factory=list)
    # Per token after the first: time since the previous token arrived (ms).
    inter_token_ms: list[float] = field(default_factory=list)
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

    Its gap to ``hf_target`` is what the backend itself gains (sdcp.models.packed); the gap between
    it and the speculative systems is what speculation gains on top.
    """

    name = "sdcp_target_only"

    def __init__(self, target: TargetModel, stop: Sequence[int]) -> None:
        self.target = target
        self.stop = set(stop)
        self._sessions = 0

    def generate(self, prompt: Sequence[int], max_new: int) -> RunResult:
        self._sessions += 1
        session = (1 << 64 | self._sessions).to_bytes(16, "big")
        tokens: list[int] = []
        started = time.perf_counter()
        self.target.open_session(session, list(prompt))
        try:
            while len(tokens) < max_new and not (tokens and tokens[-1] in self.stop):
                (row,) = self.target.score([(session, ())])
                token = int(row[0].argmax())
                self.target.commit(session, 0, [token])
                tokens.append(token)
        finally:
            self.target.close_session(session)
        return RunResult(tokens=tokens, seconds=time.perf_counter() - started)
