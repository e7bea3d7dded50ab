"""The router engine (SDCP 6.1, 6.5.2, 6.6, 6.9), free of any transport.

``engine.RouterEngine`` is the facade the router service and the in-process bench call; its parts
are ``sessions`` (a session as the router keeps it, its phase moved by ``sdcp.protocol.router_life``),
``assign`` (who drafts: the choice by expected rate, the verifier told before the drafter),
``failover`` (SDCP 6.9: fence, replay, reopen elsewhere), ``logs`` (commit logs read and replayed),
``placement`` (which verifier opens a session, its prefill deadline), ``store`` (sessions' durable
facts in the shared tier) and ``observe`` (metrics, views of the live instances).
"""

from sdcp.engines.router.engine import RouterEngine
from sdcp.engines.router.observe import SELF_DECODING_AT
from sdcp.engines.router.sessions import SELF_DECODING, TrackedSession

__all__ = ["SELF_DECODING", "SELF_DECODING_AT", "RouterEngine", "TrackedSession"]
