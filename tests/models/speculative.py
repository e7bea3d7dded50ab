"""A small in-process greedy speculative loop (rule 1) over the model backends, for tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sdcp.models import Drafter, DraftResult, TargetModel
from sdcp.protocol.messages import Sampling
from sdcp.protocol.rules import RULES, SecureRandom

GREEDY = Sampling(temperature_milli=0)


@dataclass
class LoopStats:
    tokens: list[int]
    proposed: int = 0
    accepted: int = 0


def speculative_greedy(
    target: TargetModel,
    drafter: Drafter,
    session: bytes,
    prompt: Sequence[int],
    max_new: int,
    m: int,
) -> LoopStats:
    """Decode `max_new` tokens: draft m, score in one pass, accept by rule 1, commit, sync."""
    target.open_session(session, prompt)
    drafter.open_session(session, prompt)
    stats = LoopStats(tokens=[])
    while len(stats.tokens) < max_new:
        draft = drafter.draft(session, m, GREEDY)
        rows = target.score([(session, draft.tokens)])[0]
        verdict = RULES[1].accept(rows, None, draft.tokens, SecureRandom())
        emitted = [*draft.tokens[: verdict.accepted], verdict.extra_token]
        emitted = emitted[: max_new - len(stats.tokens)]
        target.commit(session, verdict.accepted, emitted)
        stats.tokens.extend(emitted)
        stats.proposed += len(draft.tokens)
        stats.accepted += verdict.accepted
        drafter.sync(session, [*prompt, *stats.tokens])
    return stats


def reference_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new: int) -> list[int]:
    """`model.generate(do_sample=False)`; may stop early at an end-of-sequence token."""
    with torch.inference_mode():
        output = model.generate(
            torch.tensor([list(prompt)]),
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=model.config.pad_token_id or 0,
        )
    return output[0, len(prompt) :].tolist()


class RandomDrafter:
    """Proposes uniformly random tokens with one-hot rows: a drafter that is almost always wrong."""

    name = "random"
    runs_inline = True
    weights_digest = b"\x00" * 32
    seconds_per_token = 0.0

    def set_threads(self, threads: int) -> None:
        return None  # one thread, the caller's

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)

    def prepare(self) -> None:
        return None

    def open_session(self, session: bytes, prompt_tokens: Sequence[int]) -> None:
        return None

    def sync(self, session: bytes, committed_tokens: Sequence[int]) -> None:
        return None

    def close_session(self, session: bytes) -> None:
        return None

    def draft(
        self, session: bytes, m: int, sampling: Sampling | None, rng: np.random.Generator | None = None
    ) -> DraftResult:
        tokens = tuple(int(t) for t in self._rng.integers(0, self.vocab_size, size=m))
        rows = np.zeros((m, self.vocab_size), dtype=np.float32)
        rows[np.arange(m), tokens] = 1.0
        return DraftResult(tokens, rows, 0.0)
