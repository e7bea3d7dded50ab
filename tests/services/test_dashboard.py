"""The router's dashboard on its admin listener (docs/observability.md, docs/security.md "Admin
listeners"): it asks for no credentials, so it shows no session content, and an anonymous request
never makes the router call verifiers beyond one refresh per REFRESH_S.

A real router with its admin listener, a verifier and a drafter on 127.0.0.1 (the tiny model).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from tests.services.outputs import output_tokens, read_output
from tests.services.router_harness import (
    PROMPT,
    Deployment,
    deployed,
    jump_clock,
    start_drafter,
    start_verifier,
    tiny_contract,
)
from tests.waiting import eventually

from sdcp.config import AdminConfig
from sdcp.localhost import free_port
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.services.dashboard import MAX_SESSIONS, REFRESH_S
from sdcp.services.verifier import VerifierNode

pytestmark = pytest.mark.timeout(120)

# What a user might type: none of it may reach the admin listener.
SECRET = "card 4111 1111 1111 1111, password hunter2"


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")


@pytest.fixture
def verifier_asked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The session resources the verifiers started below are asked for (stats, trace)."""
    asked: list[str] = []
    for name in ("stats", "trace"):
        original = getattr(VerifierNode, name)

        async def counted(self: VerifierNode, request: Request, _name: str = name, _of: Any = original) -> Response:
            asked.append(_name)
            response: Response = await _of(self, request)
            return response

        monkeypatch.setattr(VerifierNode, name, counted)
    return asked


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    async with deployed(tmp_path, admin=AdminConfig(listen=f"127.0.0.1:{free_port()}")) as env:
        yield env


def state_url(env: Deployment) -> str:
    assert env.router is not None and env.router.config.admin.listen is not None
    return f"http://{env.router.config.admin.listen}/dashboard/state"


async def run_session(env: Deployment, target: TargetModel, prompt: list[int]) -> tuple[bytes, list[int]]:
    """A session through the router to its end: its id and its output tokens."""
    code, opened = await env.client("frontend").post_cbor(
        "sessions", {"prompt": prompt, "contract": tiny_contract(target, max_new=12).to_obj()}
    )
    assert code == 201 and isinstance(opened, dict) and isinstance(opened["session"], bytes)
    session = opened["session"]
    tokens = output_tokens(await read_output(env.client("frontend", peer="verifier1"), session))
    router = env.router
    assert router is not None
    await eventually(lambda: router.sessions[session].ended)
    return session, tokens


async def test_the_dashboard_state_holds_no_session_content(deployment: Deployment, target: TargetModel) -> None:
    await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    prompt = tiny_tokenizer()(SECRET)["input_ids"]
    assert 0 not in prompt and len(prompt) > 20
    session, output = await run_session(deployment, target, prompt)
    text = tiny_tokenizer().decode(output)

    async with httpx.AsyncClient() as client:
        response = await client.get(state_url(deployment))
    assert response.status_code == 200
    body = response.text
    state = response.json()
    # The session is shown, by its counts, under a key of the router's own: not its id, nor a
    # request id the client chose, nor its per-round trace (issue #36).
    (entry,) = state["sessions"]
    assert entry["committed"] == len(output) == 12 and entry["ended"] and entry["rounds"] >= 1
    assert session.hex() not in body and not {"session", "request", "trace"} & set(entry)
    assert entry["acceptance"] is None or 0 <= entry["acceptance"] <= 1
    assert (state["sessions_live"], state["sessions_ended"]) == (0, 1)
    # None of what the user typed or was answered: no text, no token ids, in any spelling.
    assert not {"text", "tokens", "prompt", "output"} & set(entry)
    for secret in (SECRET, "4111", "hunter2", text.strip()):
        assert secret and secret not in body, secret
    for ids in (prompt, output):
        for spelling in (json.dumps(ids), json.dumps(ids, separators=(",", ":")), " ".join(map(str, ids))):
            assert spelling[1:-1] not in body
    # The page itself shows no text either.
    async with httpx.AsyncClient() as client:
        page = (await client.get(state_url(deployment).removesuffix("/state"))).text
    assert 'createElement("pre")' not in page and "s.text" not in page and "s.tokens" not in page


async def test_anonymous_dashboard_requests_ask_the_verifiers_once_per_refresh(
    deployment: Deployment, target: TargetModel, verifier_asked: list[str]
) -> None:
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    sessions = [(await run_session(deployment, target, list(PROMPT)))[0] for _ in range(2)]
    clock = jump_clock(router)
    # Each refresh asks the verifier once (stats) per session shown.
    per_refresh = min(len(sessions), MAX_SESSIONS)
    asked_before = len(verifier_asked)
    started = clock()
    async with httpx.AsyncClient() as client:
        # A burst of concurrent requests, then a run of sequential ones.
        answers = await asyncio.gather(*(client.get(state_url(deployment)) for _ in range(40)))
        answers += [await client.get(state_url(deployment)) for _ in range(40)]
        elapsed = clock() - started
        assert all(a.status_code == 200 for a in answers)
        assert all(len({s["key"] for s in a.json()["sessions"]}) == len(sessions) for a in answers)
        asked = len(verifier_asked) - asked_before
        # One refresh for the first request, and one more per REFRESH_S that passed: never one per
        # request (80 requests would have asked 80 * per_refresh times).
        refreshes = 1 + int(elapsed // REFRESH_S) + 1
        assert per_refresh <= asked <= per_refresh * refreshes, (asked, elapsed)
        assert asked < 80 * per_refresh // 4
        # Once REFRESH_S has passed, the next request refreshes the figures, once.
        clock.advance(REFRESH_S)
        before = len(verifier_asked)
        await asyncio.gather(*(client.get(state_url(deployment)) for _ in range(10)))
        assert len(verifier_asked) - before == per_refresh
