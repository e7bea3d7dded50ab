"""The verifier engine (SDCP 6.1, 6.3, 6.5.2, 6.6, 6.7, 6.8), free of any transport.

``engine.VerifierEngine`` is the facade the services and the in-process bench call.
"""

from sdcp.engines.verifier.engine import TRACE_ROUNDS, PassCosts, VerifierEngine, lookahead_length

__all__ = ["TRACE_ROUNDS", "PassCosts", "VerifierEngine", "lookahead_length"]
