"""Where a session opens, and how long its opening may take: the verifier that holds the prompt's
longest prefix or is least loaded (``sdcp.protocol.router``), and the prefill deadline after the
opens already queued there."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from sdcp.cache.prefix import SHARE_TOKENS, shared_hashes, tenant_scope
from sdcp.config import RouterConfig
from sdcp.protocol.messages import Contract, Role
from sdcp.protocol.router import (
    InstanceRegistry,
    InstanceView,
    open_deadline_s,
    prefer_cached_prefix,
    prefer_idle_and_accepting,
    serves,
    unreported,
)

__all__ = ["Placement"]


class Placement:
    """Verifier choices of one router, from its ``registry`` of live instances."""

    def __init__(
        self, *, registry: InstanceRegistry, clock: Callable[[], float], settings: Callable[[], RouterConfig]
    ) -> None:
        self._registry = registry
        self._clock = clock
        self._settings = settings
        # Prompt tokens of the session-opens in flight at each verifier (their prefill deadlines).
        self._opening: dict[str, int] = {}

    @contextlib.contextmanager
    def prefill_at(self, verifier: str, tokens: int) -> Iterator[float]:
        """The deadline of a session-open at ``verifier`` that prefills ``tokens``, counted among
        this router's opens there while the block runs. The verifier prefills one session at a
        time: this one's turn comes after its queue as it last reported it, and after this router's
        opens there since (not in that report yet)."""
        view = self._registry.get(verifier)
        queued = (view.status.prefill_tokens or 0) if view is not None else 0
        queued += self._opening.get(verifier, 0)
        self._opening[verifier] = self._opening.get(verifier, 0) + tokens
        settings = self._settings()
        try:
            yield open_deadline_s(settings.open_timeout_s, tokens + queued, settings.open_timeout_per_token_ms)
        finally:
            self._opening[verifier] -= tokens
            if not self._opening[verifier]:
                del self._opening[verifier]

    def pick_verifier(
        self, contract: Contract, *, avoid: Sequence[str], prompt: tuple[int, ...] | str = (), tenant: str | None = None
    ) -> str | None:
        """A live verifier of the contract's target: where the prompt's longest prefix is held, if
        any with room holds one, else the least loaded (sdcp.protocol.router)."""
        live = [view for view in self._registry.live(Role.VERIFIER, self._clock()) if view.uri not in avoid]
        candidates = [view for view in live if serves(view, contract)] or unreported(live)
        if not candidates:
            return None
        if isinstance(prompt, tuple) and len(prompt) > SHARE_TOKENS:
            # The verifier prefills all but the prompt's last token; its prefixes are named so.
            names = shared_hashes(prompt[:-1], salt=contract.target + contract.tokenizer, scope=tenant_scope(tenant))
            return prefer_cached_prefix(candidates, partial(_cached_length, names)).uri
        return prefer_idle_and_accepting(candidates).uri


def _cached_length(names: Sequence[bytes], view: InstanceView) -> int:
    """How many tokens of a prompt (``names``: its prefixes' names) the verifier reports holding."""
    held = set(view.status.prefixes or ())
    return max(((index + 1) * SHARE_TOKENS for index, name in enumerate(names) if name in held), default=0)
