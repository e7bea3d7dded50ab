"""Penalties and logit_bias on the llama.cpp target (docs/interpretations.md, "Penalties, logit_bias
and min_p"): prompt-lookup rounds, whose proposals repeat the prompt's list and so repeat tokens
inside a proposal, give the penalised greedy decoding of the bundled GGUF token for token. The
reference is plain llama-cpp-python, one token per pass, its rows shaped by the reference of
tests/protocol/shaping_reference.py; the test plays the router and the drafter, as
tests/services/test_verifier_llamacpp.py does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from tests.llama_greedy import exact_llama
from tests.protocol.shaping_reference import reference_logits
from tests.services.llamacpp_harness import CAPACITY, M_MAX, MAX_NEW, prompt, target
from tests.services.verifier_harness import DRAFTER, SESSION, advance, contract, proposal, running_cluster

from sdcp.cache import build_uri
from sdcp.models.llamacpp.target import LlamaCppTarget
from sdcp.models.registry import load_drafter
from sdcp.models.weights.fetch import smollm2_gguf
from sdcp.protocol.messages import Action, Assignment, Sampling, SessionOpen, SessionState, Verdict, session_path_id

__all__ = ["prompt", "target"]  # fixtures, from the llama.cpp verifier tests' harness

pytestmark = pytest.mark.timeout(300)

PENALTIES = Sampling(frequency_penalty_milli=400, presence_penalty_milli=200, repetition_penalty_milli=1100)


def penalised_greedy(prompt: Sequence[int], sampling: Sampling) -> list[int]:
    """llama.cpp's rows for PROMPT and each token after it, one token per pass with the settings of
    tests/llama_greedy.py, each token the argmax of the reference's shaped row."""
    llama = exact_llama(smollm2_gguf(), CAPACITY)
    llama.eval(list(prompt))
    tokens: list[int] = []
    while len(tokens) < MAX_NEW:
        # The last token's row: llama-cpp-python keeps no rows of its own without logits_all.
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, -1), shape=(llama.n_vocab(),)).copy()
        tokens.append(int(np.argmax(reference_logits(row, prompt, tokens, sampling))))
        llama.eval(tokens[-1:])
    return tokens


async def test_prompt_lookup_rounds_give_the_penalised_greedy_decoding(
    tmp_path: Path, target: LlamaCppTarget, prompt: tuple[int, ...]
) -> None:
    reference = penalised_greedy(prompt, PENALTIES)
    async with running_cluster(tmp_path, target) as cluster:
        terms = contract(target, max_new=MAX_NEW, m_max=M_MAX, low_rounds=MAX_NEW, sampling=PENALTIES.to_obj())
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
        repeats = 0
        m = M_MAX
        while True:
            draft = lookup.draft(SESSION, m, Sampling(temperature_milli=0))
            repeats += len(draft.tokens) - len(set(draft.tokens))
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
        # Proposals held repeated tokens, and the penalties changed the output.
        assert repeats > 0
        assert reference != penalised_greedy(prompt, Sampling())
