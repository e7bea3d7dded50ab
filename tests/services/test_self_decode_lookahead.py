"""Self-decoding with prompt-lookup lookahead (SDCP 6.5.2): one token per round, fewer passes.

Real verifier service, bundled SmolLM2, a repetitive prompt; the test plays the router and a drafter
whose proposals are always refused, so the ladder moves the session to self-decoding at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from tests.services.outputs import output_tokens, read_output
from tests.waiting import eventually

from sdcp.cache import build_uri
from sdcp.config import InstanceConfig, MLCConfig, ServiceConfig, VerifierConfig
from sdcp.engines.verifier import PassCurves
from sdcp.engines.verifier import engine as engine_module
from sdcp.localhost import free_port
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import end_of_text_tokens, load_target
from sdcp.protocol.messages import (
    Action,
    Assignment,
    Contract,
    Event,
    Proposal,
    Role,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
    session_path_id,
)
from sdcp.protocol.passcost import PassCurve, speculation_length
from sdcp.services.verifier import VerifierNode
from sdcp.transport.certs import make_certs
from sdcp.transport.client import SDCPClient

pytestmark = pytest.mark.timeout(300)

PROMPT_TEXT = (
    "Repeat this list exactly as it is written:\n\n1. Preheat the oven to 180 degrees.\n"
    "2. Mix the flour, sugar and butter in a large bowl.\n3. Add two eggs and stir until smooth.\n\n"
    "1. Preheat the oven to 180 degrees.\n2."
)
SESSION = bytes(range(16))
MAX_NEW = 40
# A pass that barely grows with its rows, as torch's fp32 one (docs/models.md): guesses pay.
FLAT_CURVE_MS = (50.0, 51.0, 52.0, 54.0, 58.0, 66.0)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return load_target("smollm2")


@pytest.fixture
async def node(tmp_path: Path, target: TargetModel) -> AsyncIterator[tuple[VerifierNode, dict[str, SDCPClient]]]:
    uris = {
        "verifier": f"https://127.0.0.1:{free_port()}",
        "router": "https://127.0.0.1:1",
        "drafter": "https://127.0.0.1:2",
    }
    issued = make_certs(tmp_path / "certs", list(uris.values()))
    ca = tmp_path / "certs" / "ca.pem"
    config = ServiceConfig(
        instance=InstanceConfig(
            uri=uris["verifier"],
            cert=issued[uris["verifier"]].cert_path,
            key=issued[uris["verifier"]].key_path,
            ca=ca,
            router=uris["router"],
        ),
        mlc=MLCConfig(disk_dir=tmp_path / "mlc"),
        verifier=VerifierConfig(model="smollm2", output_wait_s=0.5),
    )
    verifier = VerifierNode(config, target=target)
    await verifier.start()
    clients = {
        name: SDCPClient(uris["verifier"], issued[uris[name]].cert_path, issued[uris[name]].key_path, ca)
        for name in ("router", "drafter")
    }
    try:
        yield verifier, clients
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))
        await verifier.stop()


DRAFTER = "https://127.0.0.1:2"


def _prompt_and_reference(target: TargetModel) -> tuple[tuple[int, ...], list[int]]:
    prompt = tuple(target.tokenizer(PROMPT_TEXT)["input_ids"])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        reference = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
        )[0, len(prompt) :].tolist()
    return prompt, reference


async def _open_self_decoding_session(
    verifier: VerifierNode,
    clients: dict[str, SDCPClient],
    target: TargetModel,
    prompt: tuple[int, ...],
    fallback: list[Action],
) -> Contract:
    """Open the session (low_rounds 1, self_max MAX_NEW) and assign the test's drafter."""
    contract = Contract.from_obj(
        {
            "target": target.weights_digest,
            "tokenizer": target.tokenizer_digest,
            "rule": 1,
            "m_max": 4,
            "max_new": MAX_NEW,
            "stop": end_of_text_tokens(target.tokenizer),
            "low_rounds": 1,
            "fallback": fallback,
            "self_load": 100,
            "self_max": MAX_NEW,
        }
    )
    opened = SessionOpen(
        session=SESSION,
        epoch=1,
        contract=contract,
        prompt=prompt,
        commit_log=build_uri("local", None, "log", SESSION.hex()),
    )
    _, body = await clients["router"].post_cbor("sessions", opened.to_obj())
    await _assign(clients, verifier, contract, prompt, SessionState.from_obj(body))
    return contract


async def _assign(
    clients: dict[str, SDCPClient],
    verifier: VerifierNode,
    contract: Contract,
    prompt: tuple[int, ...],
    state: SessionState,
) -> None:
    assignment = Assignment(
        session=SESSION,
        epoch=1,
        contract=contract,
        verifier=verifier.uri,
        drafter=DRAFTER,
        prompt=prompt,
        round=state.round,
        committed=state.committed,
        digest=state.digest,
        m_init=4,
    )
    await clients["router"].put_cbor(f"sessions/{session_path_id(SESSION)}/drafter", assignment.to_obj())


def _proposal(state: SessionState, tokens: tuple[int, ...]) -> Proposal:
    return Proposal(
        session=SESSION,
        epoch=1,
        round=state.round + 1,
        drafter=DRAFTER,
        base=state.committed,
        base_digest=state.digest,
        tokens=tokens,
        status=Status(instance=DRAFTER, role=Role.DRAFTER, load=0, queue=0, ttl_ms=1000),
    )


@pytest.mark.slow
async def test_lookahead_saves_passes_and_keeps_greedy_output(
    node: tuple[VerifierNode, dict[str, SDCPClient]], target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    verifier, clients = node
    # Where guesses pay: rows that add little to a pass. The curve measured on a busy machine, and
    # kept current from its passes, may say otherwise (speculation_length's own tests cover that).
    verifier.engine.pass_curves.base.points_ms[:] = FLAT_CURVE_MS
    monkeypatch.setattr(verifier.engine.pass_curves, "record", lambda seconds, rows, context: None)
    prompt, reference = _prompt_and_reference(target)
    await _open_self_decoding_session(verifier, clients, target, prompt, [Action.SELF_DECODE])
    wrong = (reference[0] + 1) % target.vocab_size
    proposal = _proposal(verifier.engine.sessions[SESSION].machine.state(), (wrong,))
    passes_before = verifier.engine.scorer.batches_run
    _, body = await clients["drafter"].post_cbor("proposals", proposal.to_obj())
    assert Verdict.from_obj(body).action == Action.SELF_DECODE

    tokens = output_tokens(await read_output(clients["router"], SESSION))
    assert tokens == reference[: len(tokens)] and len(tokens) >= 2
    self_decoded = verifier.engine.sessions[SESSION].machine.stats.self_decoded
    assert self_decoded == len(tokens) - 1
    # One pass per round without lookahead; the list the model repeats is predicted by lookup.
    self_decode_passes = verifier.engine.scorer.batches_run - passes_before - 1  # less the proposal's pass
    assert self_decode_passes < self_decoded
    # The session's stats count the passes whose rows its rounds took (a run's step computed after
    # the session's end is a pass none took).
    self_passes = verifier.engine.sessions[SESSION].machine.stats.self_passes
    assert 1 <= self_passes <= self_decode_passes


@pytest.mark.slow
async def test_a_failed_append_while_self_decoding_leaves_the_model_at_the_committed_tokens(
    node: tuple[VerifierNode, dict[str, SDCPClient]], target: TargetModel
) -> None:
    verifier, clients = node
    prompt, reference = _prompt_and_reference(target)
    contract = await _open_self_decoding_session(verifier, clients, target, prompt, [Action.SELF_DECODE, Action.FAIL])
    live = verifier.engine.sessions[SESSION]
    # The sixth record cannot be written: the MLC answers with an error and the record is not there
    # (those before it in its append are, as a store that appends record by record leaves them).
    appended = live.log.append_all
    written = 0

    async def failing_append(records: list[dict[str, object]], if_match: str) -> str:
        nonlocal written
        before, written = written, written + len(records)
        if before <= 5 < written:
            if before < 5:
                await appended(records[: 5 - before], if_match)
            raise OSError("the MLC is unreachable")
        return await appended(records, if_match)

    live.log.append_all = failing_append  # type: ignore[method-assign]
    wrong = (reference[0] + 1) % target.vocab_size
    _, body = await clients["drafter"].post_cbor("proposals", _proposal(live.machine.state(), (wrong,)).to_obj())
    assert Verdict.from_obj(body).action == Action.SELF_DECODE
    await eventually(lambda: not live.machine.self_decoding)
    assert not live.machine.self_decoding and not live.machine.ended
    committed = list(live.machine.tokens)
    assert committed == reference[: len(committed)] and len(committed) == 5
    # The model holds exactly the committed tokens again: a drafter proposing the reference's next
    # tokens has them all accepted.
    await verifier.engine.scorer.run_async(lambda: None)
    assert target.committed_tokens(SESSION) == (*prompt, *committed)
    state = live.machine.state()
    await _assign(clients, verifier, contract, prompt, state)
    _, body = await clients["drafter"].post_cbor("proposals", _proposal(state, tuple(reference[5:8])).to_obj())
    verdict = Verdict.from_obj(body)
    assert verdict.accepted == 3 and list(verdict.emitted) == reference[5:9]


async def test_a_cancel_that_stops_waiting_for_self_decoding_ends_the_session_quietly(
    node: tuple[VerifierNode, dict[str, SDCPClient]], target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine a cancel stops waiting for the self-decoding task and begins its own round
    while the task waits for its next pass; the task then finds that round in flight. The period
    gives way to the cancel: no error, no switch event, and the cancel's record ends the session."""
    verifier, clients = node
    prompt, reference = _prompt_and_reference(target)
    await _open_self_decoding_session(verifier, clients, target, prompt, [Action.SELF_DECODE, Action.FAIL])
    live = verifier.engine.sessions[SESSION]
    wrong = (reference[0] + 1) % target.vocab_size
    _, body = await clients["drafter"].post_cbor("proposals", _proposal(live.machine.state(), (wrong,)).to_obj())
    assert Verdict.from_obj(body).action == Action.SELF_DECODE
    await eventually(lambda: live.machine.committed >= 3)
    # The task's next pass waits behind the scorer; the cancel's record waits for the test.
    scorer_free, append_free = threading.Event(), asyncio.Event()
    blocker = asyncio.ensure_future(verifier.engine.scorer.run_async(scorer_free.wait))
    appended = live.log.append_all
    cancel_appending = asyncio.Event()

    async def held_append(records: list[dict[str, object]], if_match: str) -> str:
        if any(record.get("emitted") == [] for record in records):
            cancel_appending.set()
            await append_free.wait()
        return await appended(records, if_match)

    live.log.append_all = held_append  # type: ignore[method-assign]
    await eventually(lambda: not live.machine.verifying)
    monkeypatch.setattr(engine_module, "_ROUTER_WAIT_S", 0.0)
    cancel = asyncio.ensure_future(
        clients["router"].post_cbor(f"sessions/{session_path_id(SESSION)}/cancel", {"session": SESSION, "epoch": 1})
    )
    await cancel_appending.wait()
    events = verifier.engine._events
    sent: list[Action] = []
    send = events.send

    async def counted(event: Event) -> None:
        sent.append(event.kind)
        await send(event)

    monkeypatch.setattr(events, "send", counted)
    scorer_free.set()
    await blocker
    await eventually(lambda: live.self_decoder is not None and live.self_decoder.done())
    append_free.set()
    _, answer = await cancel
    state = SessionState.from_obj(answer)
    assert state.state == Action.FAIL and list(live.machine.tokens) == reference[: state.committed]
    # The cancel's fail event, and no switch: the session wants no drafter.
    assert Action.SWITCH not in sent


def test_speculation_length_weighs_a_guess_against_what_its_rows_add_to_the_pass() -> None:
    # On the first curve (llama.cpp on 2 cores: a second row costs about half a pass more) a lone
    # session scores a guess only above a 53 % hit rate, one among 16 only above 94 %; a strong
    # hit rate pays for the whole prediction, never longer than it.
    assert speculation_length(0.5, 1, 8) == 0
    assert speculation_length(0.6, 1, 8) > 0
    assert speculation_length(0.9, 16, 8) == 0
    assert speculation_length(0.96, 16, 8) > 0
    assert speculation_length(0.9, 1, 8) == 8
    assert speculation_length(0.9, 1, 3) == 3
    assert speculation_length(1.0, 16, 0) == 0
    lengths = [speculation_length(0.97, sessions, 8) for sessions in (1, 2, 4, 8, 16)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_where_a_shared_pass_runs_a_guess_apart_it_costs_a_pass_of_its_own() -> None:
    # llama.cpp with a cache per sequence runs the rows a session scores after its first in a
    # ubatch of their own when other sessions share the pass: a guess costs a pass of its rows, so
    # among 16 sessions none pays, among 2 a strong one still may, and a lone session's is as before.
    assert speculation_length(0.96, 16, 8) > 0
    assert speculation_length(0.999, 16, 8, apart=True) == 0
    assert speculation_length(0.8, 2, 8) == 2 and speculation_length(0.8, 2, 8, apart=True) == 0
    assert speculation_length(0.99, 2, 8, apart=True) == 8
    assert [speculation_length(rate, 1, 8, apart=True) for rate in (0.5, 0.6, 0.9)] == [
        speculation_length(rate, 1, 8) for rate in (0.5, 0.6, 0.9)
    ]


def test_sessions_share_the_rows_of_the_largest_measured_pass() -> None:
    # Past PASS_ROWS[-1] rows the curve is only extrapolated: 16 sessions accepting every token
    # score a token more each at most, a lone one the whole prediction, 40 none.
    assert speculation_length(1.0, 16, 16) == 1
    assert speculation_length(1.0, 8, 16) <= 3
    assert speculation_length(1.0, 1, 16) == 16
    assert speculation_length(1.0, 40, 16) == 0


def test_where_rows_cost_little_against_the_pass_weak_guesses_pay() -> None:
    # Guesses pay at a low hit rate.
    flat = PassCurve(list(FLAT_CURVE_MS))
    assert speculation_length(0.4, 1, 8, flat) > 0
    assert speculation_length(0.4, 1, 8, flat) > speculation_length(0.4, 1, 8)


def test_each_band_of_context_has_a_pass_curve_of_its_own() -> None:
    """Passes at long contexts neither teach the short-context curve their cost nor take it: a
    band starts from the shape of the nearest shorter band's curve, scaled to its first pass, and
    follows its own passes from then on."""
    curves = PassCurves(PassCurve([10.0, 14.0, 22.0, 38.0, 70.0, 134.0]))
    assert curves.curve(3000) is curves.base  # no pass served there yet
    curves.record(0.030, 1, 2400)  # a lone row at 2,400 positions: three short ones
    assert curves.base.ms(1) == 10.0 and curves.curve(100) is curves.base
    long = curves.curve(2400)
    assert long.ms(1) == pytest.approx(30.0) and long.ms(2) == pytest.approx(42.0)
    assert curves.curve(4000) is long and curves.curve(1500) is curves.base
    for _ in range(60):
        curves.record(0.033, 2, 2400)  # a second row costs a tenth there (attention, not weights)
    assert long.ms(2) == pytest.approx(33.0, rel=0.01)
    assert speculation_length(0.3, 1, 8, long) > 0 == speculation_length(0.3, 1, 8, curves.base)
    assert curves.base.points_ms == [10.0, 14.0, 22.0, 38.0, 70.0, 134.0]


def test_the_short_context_curve_keeps_its_measured_shape_and_follows_the_load() -> None:
    """Passes at the contexts the startup probe measured move every point of its curve, not only
    the nearest: a busy spell of 8-row passes (4 streams) must not leave the 16-row point at its
    idle figure, which made a row past 8 look nearly free and scored guesses right a third of the
    time among 13 sessions (docs/performance.md, session 31)."""
    probed = [8.5, 14.4, 20.3, 32.5, 58.2, 111.8]  # the probe's figures on this 2-core machine
    curves = PassCurves(PassCurve(list(probed)))
    for _ in range(60):
        curves.record(0.052, 8, 120)  # 8-row passes under load: 1.6 times the probe's
    base = curves.base
    assert base.ms(8) == pytest.approx(52.0, rel=0.01)
    assert [point / before for point, before in zip(base.points_ms, probed, strict=True)] == pytest.approx(
        [52.0 / 32.5] * len(probed), rel=0.01
    )
    # A row past 8 costs what the probe said, at the new level: among 13 sessions a guess right
    # half the time does not pay (with the 16-row point left at 58.2 it did).
    assert speculation_length(0.5, 13, 16, base) == 0
    assert speculation_length(0.5, 13, 16, PassCurve([8.5, 14.4, 20.3, 52.0, 58.2, 111.8])) == 1
    assert speculation_length(0.99, 13, 16, base) == 1


def test_the_pass_curve_interpolates_and_follows_the_passes_served() -> None:
    curve = PassCurve([10.0, 14.0, 22.0, 38.0, 70.0, 134.0])
    assert curve.ms(1) == 10.0 and curve.ms(3) == 18.0 and curve.ms(24) == 102.0
    assert curve.ms(48) == 198.0  # past the last point, its last slope
    for _ in range(60):
        curve.record(0.020, 1)  # lone passes now take twice as long: another load on the machine
        curve.record(0.100, 12)  # between 8 and 16 rows: the nearer point (16) follows in proportion
    assert curve.ms(1) == pytest.approx(20.0, rel=0.01)
    assert curve.ms(12) == pytest.approx(100.0, rel=0.05)
    curve.measured(32, 0.2)
    assert curve.ms(32) == 200.0
    # A pass of no rows, or one that took no time, says nothing.
    before = list(curve.points_ms)
    curve.record(0.0, 4)
    curve.record(0.05, 0)
    assert curve.points_ms == before
