"""What an operator sees of a running local cluster (#20): metrics over plain HTTP equal to what the
sessions did, a session's timeline, and the router's dashboard in a real (headless) browser."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from tests.e2e.support import sdcp, stats_when_ended
from tests.waiting import wait_until

from sdcp.bench.streamed import first_token_parts
from sdcp.cluster import LocalCluster
from sdcp.latency import GATEWAY_PARTS, ROUTER_PARTS, VERIFIER_PARTS
from sdcp.protocol.messages import session_path_id
from sdcp.protocol.problems import ProtocolError
from sdcp.transport.client import SDCPClient

pytestmark = pytest.mark.timeout(600)

# Prompt lookup drafts well on a prompt that repeats itself: the session has proposal rounds.
REPETITIVE = "one two three four five six seven. one two three four five six seven. one two three four"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def admin_of(home: Path, role: str) -> str:
    admin = next(i.admin for i in LocalCluster(home).instances() if i.role == role)
    assert admin is not None
    return admin


def scrape(home: Path, role: str) -> Samples:
    text = httpx.get(f"{admin_of(home, role)}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    assert found, f"no series {name} {labels}"
    return sum(found)


def client_of(home: Path) -> openai.OpenAI:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    return openai.OpenAI(base_url=gateway, api_key="unused", timeout=300, max_retries=0)


def generate(home: Path, prompt: str, max_tokens: int) -> tuple[bytes, openai.types.Completion]:
    raw = client_of(home).completions.with_raw_response.create(
        model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return bytes.fromhex(raw.headers["x-sdcp-sessions"]), raw.parse()


async def trace_at_verifier(home: Path, session: bytes, query: dict[str, str]) -> object:
    """GET sessions/{id}/trace at the session's verifier, with the CLI's operator identity."""
    cluster = LocalCluster(home)
    cert, key, ca = cluster.client_credentials()
    path = f"sessions/{session_path_id(session)}"
    async with SDCPClient(cluster.router, cert, key, ca) as router:
        verifier = str((await router.get_cbor(path))[1]["verifier"])
    async with SDCPClient(verifier, cert, key, ca) as client:
        return (await client.get_cbor(f"{path}/trace", query))[1]


def session_stats(home: Path, session: bytes) -> dict[str, object]:
    return asyncio.run(stats_when_ended(home, session))


def test_every_labelled_series_exists_before_its_first_event(home: Path) -> None:
    # The module's cluster has served nothing yet: the series are there, at zero.
    verifier = scrape(home, "verifier")
    assert value(verifier, "sdcp_verifier_problems_total", type="sdcp-stale-epoch") == 0
    assert value(verifier, "sdcp_verifier_rounds_total", kind="cancel", outcome="fail") == 0
    assert value(verifier, "sdcp:spec_decode_num_accepted_tokens_per_pos_total", position="63") == 0
    assert value(verifier, "sdcp_verifier_escalations_total", action="self_decode") == 0
    gateway = scrape(home, "gateway")
    assert value(gateway, "sdcp:request_success_total", finished_reason="abort") == 0
    assert value(gateway, "sdcp:time_to_first_token_seconds_count") == 0
    router = scrape(home, "router")
    assert value(router, "sdcp_router_events_total", kind="switch") == 0
    drafter = next(i for i in LocalCluster(home).instances() if i.role == "drafter")
    assert value(router, "sdcp_router_assignments_total", drafter=drafter.uri) == 0
    assert value(scrape(home, "drafter"), "sdcp_drafter_predrafts_total", outcome="used") == 0


def test_metrics_equal_the_verdicts_of_a_session(home: Path) -> None:
    verifier_before, gateway_before = scrape(home, "verifier"), scrape(home, "gateway")
    session, reply = generate(home, REPETITIVE, 64)
    stats = session_stats(home, session)
    verifier, gateway = scrape(home, "verifier"), scrape(home, "gateway")

    def grew(after: Samples, before: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    rounds, accepted_by_position = stats["rounds"], stats["accepted_by_position"]
    assert isinstance(rounds, int) and rounds > 0 and isinstance(accepted_by_position, list)
    per_position = "sdcp:spec_decode_num_accepted_tokens_per_pos_total"
    for position, accepted in enumerate(accepted_by_position):
        assert grew(verifier, verifier_before, per_position, position=str(position)) == accepted
    assert grew(verifier, verifier_before, "sdcp:spec_decode_num_drafts_total") == rounds
    assert grew(verifier, verifier_before, "sdcp_verifier_rounds_total", kind="proposal") == rounds
    assert grew(verifier, verifier_before, "sdcp:spec_decode_num_draft_tokens_total") == stats["proposed"]
    assert grew(verifier, verifier_before, "sdcp:spec_decode_num_accepted_tokens_total") == stats["accepted"]
    assert grew(verifier, verifier_before, "sdcp_verifier_self_decoded_tokens_total") == stats["self_decoded"]
    assert grew(verifier, verifier_before, "sdcp_verifier_rounds_total", kind="self") == stats["self_decoded"]
    assert grew(verifier, verifier_before, "sdcp_verifier_tokens_committed_total") == stats["committed"]
    assert grew(verifier, verifier_before, "sdcp_verifier_escalations_total") == stats["escalations"]
    usage = reply.usage
    assert usage is not None
    assert grew(gateway, gateway_before, "sdcp:prompt_tokens_total") == usage.prompt_tokens
    assert grew(gateway, gateway_before, "sdcp:generation_tokens_total") == usage.completion_tokens
    assert grew(gateway, gateway_before, "sdcp:time_to_first_token_seconds_count") == 1
    reason = reply.choices[0].finish_reason
    assert grew(gateway, gateway_before, "sdcp:request_success_total", finished_reason=reason) == 1


def test_a_sessions_trace_shows_each_round(home: Path) -> None:
    session, _ = generate(home, REPETITIVE, 48)
    stats = session_stats(home, session)
    shown = sdcp(home, "trace", session.hex(), "--json")
    assert shown.returncode == 0, shown.stderr
    rounds = json.loads(shown.stdout)
    proposals = [r for r in rounds if r["kind"] == "proposal"]
    assert len(proposals) == stats["rounds"]
    assert sum(r["accepted"] for r in proposals) == stats["accepted"]
    assert sum(r["emitted"] for r in rounds) == stats["committed"]
    for entry in proposals:
        assert {"drafter", "proposed", "queue_us", "fetch_us", "model_us", "append_us", "other_us"} <= set(entry)
    # Not on the verifier's admin listener, which asks for no credentials (issue #36); a table too.
    anonymous = httpx.get(f"{admin_of(home, 'verifier')}/sessions/{session.hex()}/trace", timeout=10)
    assert anonymous.status_code == 404
    assert asyncio.run(trace_at_verifier(home, session, {"last": "2"})) == rounds[-2:]
    with pytest.raises(ProtocolError) as refused:
        asyncio.run(trace_at_verifier(home, session, {"last": "-1"}))
    assert refused.value.status == 400
    table = sdcp(home, "trace", session.hex())
    assert table.returncode == 0 and f"session {session.hex()}" in table.stdout


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    service = Service(shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def _committed(browser: webdriver.Chrome) -> int | None:
    """The tokens the page shows committed by its live sessions now (it names no session id: a
    card's key is the router's own); None while it shows none, or when the page redrew a card
    between finding it and reading it (the next poll reads the new one)."""
    cards = browser.find_elements(By.CSS_SELECTOR, '.session:not(.ended) b[data-field="committed"]')
    try:
        texts = [card.text for card in cards]
    except StaleElementReferenceException:
        return None
    counts = [int(text) for text in texts if text.isdigit()]
    return sum(counts) if counts else None


def test_the_dashboard_shows_a_running_session_grow(home: Path, browser: webdriver.Chrome, tmp_path: Path) -> None:
    dashboard = LocalCluster(home).dashboard
    assert dashboard is not None
    sessions: list[bytes] = []
    # A generation longer than any machine finishes while the page watches it; the client leaves
    # (and so cancels it) once the page has shown it grow.
    stream = client_of(home).completions.with_streaming_response.create(
        model="smollm2",
        prompt="A long story about a lighthouse keeper.",
        max_tokens=4000,
        temperature=0,
        stream=True,
        # The model ends this story after about 150 tokens: a second on a quiet machine.
        extra_body={"ignore_eos": True},
    )
    watched = threading.Event()

    def read() -> None:
        with stream as response:
            sessions.append(bytes.fromhex(response.headers["x-sdcp-sessions"]))
            for _ in response.iter_lines():
                if watched.is_set():
                    break

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: bool(sessions), what="the gateway answered")
    session = sessions[0].hex()
    browser.get(dashboard)
    seen: list[int] = []

    def grown() -> bool:
        committed = _committed(browser)
        if committed is not None and (not seen or committed != seen[-1]):
            seen.append(committed)
        return len(set(seen)) >= 3

    try:
        wait_until(grown, what=f"the dashboard showing session {session} grow")
    finally:
        watched.set()
    assert seen == sorted(seen), seen
    assert browser.find_elements(By.CSS_SELECTOR, "#instances tr"), "no instances listed"

    # The admin listener asks for no credentials: the page shows figures, never the session's text.
    assert "lighthouse" not in browser.page_source.lower()
    assert not browser.find_elements(By.CSS_SELECTOR, ".session pre")
    assert session not in browser.page_source
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # `SDCP_DASHBOARD_SCREENSHOT=docs/dashboard.png` refreshes the picture in the docs.
    target = os.environ.get("SDCP_DASHBOARD_SCREENSHOT")
    if target:
        shutil.copy(shot, target)
    reader.join(timeout=300)


def test_the_first_tokens_latency_is_split_into_its_parts(home: Path) -> None:
    roles = {"gateway": GATEWAY_PARTS, "router": ROUTER_PARTS, "verifier": VERIFIER_PARTS}
    before = {role: scrape(home, role) for role in roles}
    bench_before = first_token_parts(LocalCluster(home))
    session, _ = generate(home, "Name three rivers.", 8)
    stats = session_stats(home, session)
    after = {role: scrape(home, role) for role in roles}
    # The bench's reading of every instance counts each part once, also where one process serves
    # every instance's series on each admin listener.
    bench_after = first_token_parts(LocalCluster(home))
    for name in (*GATEWAY_PARTS, *ROUTER_PARTS, *VERIFIER_PARTS):
        assert bench_after[name][1] - bench_before.get(name, (0.0, 0.0))[1] == 1, name

    def part(role: str, name: str, suffix: str) -> float:
        metric = f"sdcp_first_token_part_seconds_{suffix}"
        return value(after[role], metric, part=name) - value(before[role], metric, part=name)

    # Each role observed its parts of this one request, once each.
    for role, parts in roles.items():
        for name in parts:
            assert part(role, name, "count") == 1, (role, name)
    # The router's own work and the verifier's prefill happen within the gateway's open.
    within_open = part("router", "route", "sum") + part("verifier", "prefill_wait", "sum")
    assert within_open + part("verifier", "prefill", "sum") <= part("gateway", "open", "sum")
    # The session's stats carry the verifier's parts, as its metrics observed them.
    first_token_us = stats["first_token_us"]
    assert isinstance(first_token_us, dict) and set(first_token_us) == set(VERIFIER_PARTS)
    for name in VERIFIER_PARTS:
        assert first_token_us[name] == pytest.approx(1e6 * part("verifier", name, "sum"), abs=1)
