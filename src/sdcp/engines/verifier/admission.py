"""Short prompts before running streams (issue 38: the first token at 16 streams).

A verifier prefills one prompt at a time. Where every pass of the sessions already decoding runs
between two prefills, the sixteenth of sixteen questions that arrive together waits for fifteen
prefills and fifteen passes of up to sixteen rows: most of its first token's time is other
sessions' decoding. llama-server does the opposite: its prompt processing shares each iteration
with its decoding slots, which wait for it. So while the prompts waiting for their prefill are all
short, a self-decoding session that has its first token waits before its next pass, at most
``hold_s`` each time (the verifier's ``admission_hold_ms``; 0: never), so that a flood of questions
cannot stop it for longer; a long prompt (an agent's tools and history) is prefilled in steps
between the running sessions' passes instead (issue 37), since holding them for its whole prefill
would stall every stream for seconds. Sessions that a drafter drives are not held: their rounds
come when the drafter proposes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

__all__ = ["SHORT_PROMPT_TOKENS", "Admissions"]

# A prompt of at most this many tokens to prefill is short: about a second of prefill on 2 cores.
SHORT_PROMPT_TOKENS = 256


class Admissions:
    """The prefills queued or running on a verifier, and the wait of running sessions for them."""

    def __init__(self, hold_s: Callable[[], float], short_tokens: int = SHORT_PROMPT_TOKENS) -> None:
        if short_tokens < 0:
            raise ValueError(f"need short_tokens >= 0, got {short_tokens}")
        # Read at each wait: the verifier's settings may change.
        self.hold_s = hold_s
        self.short_tokens = short_tokens
        # Prompt tokens waiting for or in their prefill (the status's prefill_tokens).
        self.tokens = 0
        self._short = 0
        self._long = 0
        # Set unless prompts wait for their prefill and all of them are short (the settings aside).
        self._go = asyncio.Event()
        self._go.set()

    def short(self, tokens: int) -> bool:
        """Whether a prompt of ``tokens`` to prefill is short."""
        return tokens <= self.short_tokens

    @contextlib.contextmanager
    def prefilling(self, tokens: int) -> Iterator[None]:
        """Counts a prompt of ``tokens`` to prefill as waiting until the block ends."""
        short = self.short(tokens)
        self._count(tokens, short, 1)
        try:
            yield
        finally:
            self._count(tokens, short, -1)

    def _count(self, tokens: int, short: bool, sign: int) -> None:
        self.tokens += sign * tokens
        if short:
            self._short += sign
        else:
            self._long += sign
        if self._short > 0 and self._long == 0:
            self._go.clear()
        else:
            self._go.set()

    @property
    def first(self) -> bool:
        """Whether running sessions wait now: prompts wait for their prefill, all of them short,
        and the hold is not off."""
        return not self._go.is_set() and self.hold_s() > 0

    async def held(self) -> None:
        """Returns once running sessions need not wait (`first` is false), or after ``hold_s``."""
        if not self.first:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._go.wait(), self.hold_s())
