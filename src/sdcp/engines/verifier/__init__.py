"""The verifier engine (SDCP 6.1, 6.3, 6.5.2, 6.6, 6.7, 6.8), free of any transport.

``engine.VerifierEngine`` is the facade the services and the in-process bench call; its parts are
``rounds`` (verify, commit, append, fence, release), ``selfdecode`` (self-decoding passes and their
lookahead), ``kvsync`` (the model's KV cache kept at the committed tokens, and its repair),
``events`` (events to the router, the sweeps over idle and silent sessions), ``observe`` (pass
costs, metrics, stats, traces) and ``live`` (a session as the verifier holds it).
"""

from sdcp.engines.verifier.engine import VerifierEngine
from sdcp.engines.verifier.observe import TRACE_ROUNDS, PassCurves

__all__ = ["TRACE_ROUNDS", "PassCurves", "VerifierEngine"]
