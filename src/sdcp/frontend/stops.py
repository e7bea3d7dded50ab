"""How a choice ends: the stop tokens a session's contract names and the stop strings matched in its
text. One copy for every front end: the gateway's OpenAI answers and `sdcp generate`."""

from __future__ import annotations

from collections.abc import Sequence

from sdcp.frontend.text import IncrementalDecoder, TextCodec

__all__ = ["ChoiceText", "one_token_stops", "stop_token_ids"]


def stop_token_ids(
    codec: TextCodec, stop_texts: Sequence[str], extra: Sequence[int] = (), *, ignore_eos: bool = False
) -> tuple[int, ...]:
    """The contract's stop tokens: ``extra``, the end-of-text tokens unless ``ignore_eos``, and the
    stop strings that are one token each."""
    ids = set(extra)
    if not ignore_eos:
        ids.update(codec.end_of_text_tokens())
    # A stop string that is one token stops the session at the verifier itself (SDCP 6.3); a longer
    # one is matched in the text, which then cancels the session.
    ids.update(one_token_stops(codec, stop_texts))
    return tuple(sorted(ids))


def one_token_stops(codec: TextCodec, stop_texts: Sequence[str]) -> dict[int, str]:
    """The stop strings that are one token each, by that token."""
    stops: dict[int, str] = {}
    for text in stop_texts:
        encoded = codec.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            stops.setdefault(encoded[0], text)
    return stops


class ChoiceText:
    """The text of one choice as its tokens come: decoded incrementally, with a possible start of a
    stop string held back until the text after it decides whether the choice ends there."""

    def __init__(
        self,
        codec: TextCodec,
        stop_texts: Sequence[str] = (),
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = IncrementalDecoder(codec, skip_special_tokens=skip_special_tokens)
        self._stops = tuple(stop_texts)
        self._hold = max((len(stop) - 1 for stop in self._stops), default=0)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._tokens = 0
        # Decoded, not given out yet: the last characters, one fewer than the longest stop string
        # has, for they may start one; no stop string that can still end the choice starts earlier.
        self._held = ""
        # The stop string that ended the choice, once one has.
        self.stopped_by: str | None = None

    def add(self, tokens: Sequence[int], *, last: bool) -> tuple[str, bool]:
        """The text that these tokens decide, and whether a stop string ended the choice there
        (``last``: the session ended after them, nothing is held back any more)."""
        searched = len(self._held)
        self._tokens += len(tokens)
        self._held += self._decoder.add(tokens)
        if last:
            self._held += self._decoder.finish()
        # Stop strings count from min_tokens on, as vLLM's: one that ends in the text of earlier
        # tokens (searched then, or come before min_tokens) does not stop the choice.
        if self._tokens >= self._min_tokens:
            stop = self._earliest_stop(searched)
            if stop is not None:
                cut, matched = stop
                text, self._held = self._held[: cut + (len(matched) if self._include_stop else 0)], ""
                self.stopped_by = matched
                return text, True
        ready = len(self._held) if last else max(0, len(self._held) - self._hold)
        text, self._held = self._held[:ready], self._held[ready:]
        return text, False

    def _earliest_stop(self, searched: int) -> tuple[int, str] | None:
        """Where the first stop string that ends past ``searched`` in the held text starts, and which."""
        found = []
        for stop in self._stops:
            at = self._held.find(stop, max(0, searched - len(stop) + 1))
            if at >= 0:
                found.append((at, stop))
        return min(found, default=None)
