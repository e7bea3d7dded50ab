"""The verifier service on the llama.cpp target (SDCP 6.4 rule 1): a prompt-lookup drafter's rounds,
over real HTTP/2 + mTLS, give llama.cpp's greedy decoding of the bundled GGUF token for token; and
`[verifier] backend = "llamacpp"` makes a verifier of it.

The test plays the router and the drafter, whose proposals come from `NgramDrafter`; the reference is
plain llama-cpp-python's greedy decoding (tests/llama_greedy.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.llama_greedy import llama_cpp_greedy
from tests.services.llamacpp_harness import CAPACITY, M_MAX, MAX_NEW, prompt, target
from tests.services.verifier_harness import DRAFTER, SESSION, advance, contract, proposal, running_cluster

from sdcp.cache import build_uri
from sdcp.config import load_config
from sdcp.models.llamacpp.target import LlamaCppTarget
from sdcp.models.registry import load_drafter
from sdcp.models.weights.fetch import smollm2_gguf
from sdcp.protocol.messages import Action, Assignment, Sampling, SessionOpen, SessionState, Verdict, session_path_id
from sdcp.services.verifier import VerifierNode
from sdcp.transport.certs import make_certs

__all__ = ["prompt", "target"]  # fixtures, from the llama.cpp verifier tests' harness

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(prompt: tuple[int, ...]) -> list[int]:
    return llama_cpp_greedy(smollm2_gguf(), [prompt], MAX_NEW, CAPACITY)[0]


async def test_prompt_lookup_rounds_give_llama_cpp_greedy_decoding(
    tmp_path: Path, target: LlamaCppTarget, prompt: tuple[int, ...], reference: list[int]
) -> None:
    async with running_cluster(tmp_path, target) as cluster:
        # No escalation: the rounds of low acceptance are part of what the test exercises.
        terms = contract(target, max_new=MAX_NEW, m_max=M_MAX, low_rounds=MAX_NEW)
        router, drafter = cluster.client("router"), cluster.client("drafter")
        log_uri = build_uri("local", None, "log", SESSION.hex())
        opened = SessionOpen(session=SESSION, epoch=1, contract=terms, prompt=prompt, commit_log=log_uri)
        status, body = await router.post_cbor("sessions", opened.to_obj())
        assert status == 201
        state = SessionState.from_obj(body)
        assignment = Assignment(
            session=SESSION,
            epoch=1,
            contract=terms,
            verifier=cluster.node.uri,
            drafter=DRAFTER,
            prompt=prompt,
            round=0,
            committed=0,
            digest=state.digest,
            m_init=M_MAX,
        )
        status, _ = await router.put_cbor(f"sessions/{session_path_id(SESSION)}/drafter", assignment.to_obj())
        assert status == 200

        lookup = load_drafter("ngram", vocab_size=target.vocab_size)
        lookup.open_session(SESSION, prompt)
        committed: list[int] = []
        m = M_MAX
        while True:
            draft = lookup.draft(SESSION, m, Sampling(temperature_milli=0))
            status, body = await drafter.post_cbor("proposals", proposal(state, draft.tokens).to_obj(), idempotent=True)
            assert status == 200
            verdict = Verdict.from_obj(body)
            committed.extend(verdict.emitted)
            state = advance(state, verdict)
            if verdict.action == Action.FINISH:
                break
            lookup.sync(SESSION, [*prompt, *committed])
            m = min(M_MAX, verdict.m_cap)
        assert committed == reference

        _, stats = await router.get_cbor(f"sessions/{session_path_id(SESSION)}/stats")
        assert isinstance(stats, dict)
        # Prompt lookup was right in some rounds and wrong in others: both paths of the target ran.
        assert 0 < stats["accepted"] < stats["proposed"] and stats["rounds"] < MAX_NEW


def test_a_verifier_configured_for_llama_cpp_holds_at_most_its_sequences(tmp_path: Path) -> None:
    uri = "https://127.0.0.1:1"
    issued = make_certs(tmp_path / "certs", [uri])
    path = tmp_path / "verifier.toml"
    path.write_text(
        f'[instance]\nuri = "{uri}"\ncert = "{issued[uri].cert_path}"\nkey = "{issued[uri].key_path}"\n'
        f'ca = "{tmp_path / "certs" / "ca.pem"}"\nthreads = 1\n'
        '[verifier]\nbackend = "llamacpp"\nkv_slots = 2\nkv_capacity = 128\n',
        encoding="utf-8",
    )
    node = VerifierNode(load_config(path))
    try:
        assert isinstance(node.engine.target, LlamaCppTarget) and node.engine.target.context_length == 128
        # Past its sequences the engine refuses an open as past max_sessions (503, Retry-After).
        assert node.engine.settings.max_sessions == 2
    finally:
        node.engine.scorer.close()
