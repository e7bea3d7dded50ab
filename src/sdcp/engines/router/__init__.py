"""The router engine (SDCP 6.1, 6.5.2, 6.6, 6.9), free of any transport.

``engine.RouterEngine`` is the facade the router service and the in-process bench call; ``sessions``
holds a session as the router keeps it.
"""

from sdcp.engines.router.engine import SELF_DECODING_AT, RouterEngine
from sdcp.engines.router.sessions import SELF_DECODING, TrackedSession

__all__ = ["SELF_DECODING", "SELF_DECODING_AT", "RouterEngine", "TrackedSession"]
