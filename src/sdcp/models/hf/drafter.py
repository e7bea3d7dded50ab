"""A Hugging Face causal LM as drafter (draft-li-sdcp, 6.2), on torch + transformers."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from sdcp.models.backend import SessionId
from sdcp.models.drafter import DraftSession, SeededDraws, SessionDrafter, draw_tokens, probe_seconds_per_token
from sdcp.models.hf import kvcache
from sdcp.models.hf.packed import pack_weights, with_packed_linears
from sdcp.models.weights.digests import weights_digest
from sdcp.protocol.messages import Sampling


@dataclass
class _LMSession(DraftSession):
    cache: DynamicCache
    draws: SeededDraws = field(default_factory=SeededDraws)


class HFDrafter(SessionDrafter[_LMSession]):
    """A Hugging Face causal LM as drafter: samples each token from the row it publishes."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        name: str,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(name=name, runs_inline=False, seconds_per_token=0.01)
        # transformers wraps `to` in functools.wraps(nn.Module.to), which mypy reads as the unbound method.
        placed = model.to(device=device or "cpu", dtype=dtype).eval()  # type: ignore[call-arg]
        self.model: PreTrainedModel = with_packed_linears(placed)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @cached_property
    def weights_digest(self) -> bytes:
        return weights_digest(self.model)

    def prepare(self) -> None:
        with self._lock:
            pack_weights(self.model)
        _ = self.weights_digest
        with self._lock:
            self._timer.value = probe_seconds_per_token(self)

    def set_threads(self, threads: int) -> None:
        # OpenMP's team size is a setting of the calling thread: the drafter's own.
        torch.set_num_threads(threads)

    def _new_session(self, tokens: list[int]) -> _LMSession:
        return _LMSession(tokens, cache=kvcache.new_cache(self.model))

    def _resync(self, state: _LMSession, committed: list[int], common: int) -> None:
        # SDCP 6.3: discard draft state for positions beyond the accepted ones; the cache keeps
        # covering at most all tokens but the last, so the next pass feeds >= 1 token.
        kvcache.crop_to(state.cache, min(common, len(committed) - 1))
        state.tokens = committed

    def _draft(
        self,
        session: SessionId,
        state: _LMSession,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None,
    ) -> tuple[list[int], np.ndarray]:
        generator = rng if rng is not None else state.draws.generator(session, sampling)
        proposed, rows = draw_tokens(state.tokens, m, sampling, generator, lambda: self._next_logits(state))
        return proposed, np.stack(rows)

    def _next_logits(self, state: _LMSession) -> np.ndarray:
        """The float64 logits after the session's tokens, feeding those its cache lacks."""
        fed = state.tokens[kvcache.cache_length(state.cache) :]
        with torch.inference_mode():
            logits = self.model(
                input_ids=torch.tensor([fed], device=self.model.device),
                cache=state.cache,
                use_cache=True,
            ).logits[0, -1]
        row: np.ndarray = logits.to(torch.float64).cpu().numpy()
        return row
