"""The drafter engine (SDCP 6.2, 6.3 after the verdict, 6.9), free of any transport.

``engine.DrafterEngine`` is the facade the drafter service and the in-process bench call; its parts
are ``rounds`` (choose M, draft, publish the rows, propose, pre-draft, apply the verdict),
``catchup`` (the committed output brought to the verifier's, resyncs), ``guided`` (drafting a
constrained session by its grammar), ``runs`` (a session as the drafter holds it) and ``observe``
(metrics, the round trip and the acceptance its status reports).
"""

from sdcp.engines.drafter.engine import DrafterEngine
from sdcp.engines.drafter.observe import MEASURED_AFTER_VERDICTS
from sdcp.engines.drafter.rounds import confirmed_predraft
from sdcp.engines.drafter.runs import InconsistentPrefix, q_rows_uri

__all__ = ["MEASURED_AFTER_VERDICTS", "DrafterEngine", "InconsistentPrefix", "confirmed_predraft", "q_rows_uri"]
