"""The suffix drafter through the drafter service, against the real verifier service on the tiny
target (SDCP 6.2, 6.4 rule 1): the output is the target's greedy decoding, and a session that
repeats a finished one's task gets most of its tokens from the drafter."""

from __future__ import annotations

import asyncio
import os

import pytest
from tests.services import test_drafter_service as drafter_service
from tests.services.test_drafter_service import (
    PROMPT,
    ROUTER,
    STRANGER,
    Env,
    drafter_node,
    greedy,
    make_assignment,
    make_contract,
    open_session,
    read_all_output,
    verifier_node,
)
from tests.waiting import eventually

from sdcp.models.suffix import SuffixDrafter
from sdcp.models.target import TargetModel
from sdcp.protocol.messages import session_path_id

pytestmark = pytest.mark.timeout(90)

# The drafter service tests' fixtures: the certificates, MLC and identities, and the tiny target.
env = drafter_service.env
target = drafter_service.target


async def test_a_repeated_task_is_drafted_from_the_finished_sessions_output(env: Env, target: TargetModel) -> None:
    verifier = await verifier_node(env, target)
    drafter = await drafter_node(env, model="suffix")
    suffix = drafter.engine.drafter
    assert isinstance(suffix, SuffixDrafter)
    try:
        contract = make_contract(target, max_new=40)
        outputs: list[list[int]] = []
        accepted: list[int] = []
        for _ in range(2):
            session = os.urandom(16)
            await open_session(env, contract, session)
            assignment = make_assignment(env, contract, session)
            await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
            outputs.append(await asyncio.wait_for(read_all_output(env, session), 60))
            # The drafter learns a session's output as it closes the session after the last verdict.
            await eventually(lambda: not drafter.engine.runs)
            path = f"sessions/{session_path_id(session)}/stats"
            _, stats = await env.client(env.verifier_uri, STRANGER).get_cbor(path)
            assert isinstance(stats, dict)
            accepted.append(stats["accepted"])
        # SDCP 6.4 rule 1: whatever the drafter proposes, the output is the target's greedy decoding.
        assert outputs[0] == outputs[1] == greedy(target, PROMPT, contract.max_new)
        assert (suffix.history_size.sessions, suffix.history_size.tokens) == (2, 2 * contract.max_new)
        # The second session drafted from the first one's output: most of its tokens are the drafter's,
        # more than the first session's own tokens gave it.
        assert 2 * accepted[1] > contract.max_new
        assert accepted[1] > accepted[0]
    finally:
        await drafter.stop()
        await verifier.stop()
