"""The verifier engine's own life: stopping it leaves the event loop free."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import REGISTRY

from sdcp.cache import MLC
from sdcp.config import VerifierConfig
from sdcp.engines.verifier import VerifierEngine
from sdcp.models.hf.target import TargetModel
from sdcp.protocol.passcost import FIRST_CURVE_MS, PASS_ROWS
from sdcp.together import local_output_reader
from sdcp.transport.errors import PeerClientError

# How long the scorer's thread waits for the event loop before the test gives up on it.
_GIVE_UP_S = 30.0


async def test_stop_joins_the_scorers_thread_off_the_event_loop(
    target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlc = MLC.from_config(authority="verifier.test")
    engine = VerifierEngine(uri="https://verifier.test", settings=VerifierConfig(), target=target, mlc=mlc, ttl_ms=1000)
    # The scorer's thread is busy until the event loop opens the gate: a join on the loop would
    # wait for it in vain, until the gate's wait gives up.
    gate = threading.Event()
    busy = engine.scorer.run(gate.wait, _GIVE_UP_S)
    loop = asyncio.get_running_loop()
    closing = asyncio.Event()
    close = engine.scorer.close

    def close_and_tell() -> None:
        loop.call_soon_threadsafe(closing.set)
        close()

    monkeypatch.setattr(engine.scorer, "close", close_and_tell)
    stopping = asyncio.create_task(engine.stop())
    await closing.wait()
    gate.set()
    await stopping
    await mlc.close()
    assert busy.result() is True, "the event loop was blocked while the scorer's thread was joined"


async def test_the_pass_cost_curve_is_measured_before_the_verifier_serves(target: TargetModel) -> None:
    mlc = MLC.from_config(authority="verifier.test")
    engine = VerifierEngine(uri="https://verifier.test", settings=VerifierConfig(), target=target, mlc=mlc, ttl_ms=1000)
    await engine.start()
    try:
        measured = list(engine.pass_curves.base.points_ms)
        # Every point was timed here (none is the first curve's SmolLM2 figure any more), and the
        # one-row pass is the time per self-decoded token.
        assert all(ms > 0 and ms != first for ms, first in zip(measured, FIRST_CURVE_MS, strict=True))
        assert engine.status().self_us == round(1000 * measured[0])
        exposed = {
            sample.labels["rows"]: sample.value
            for family in REGISTRY.collect()
            if family.name == "sdcp_verifier_pass_seconds"
            for sample in family.samples
            if sample.labels["instance"] == engine.uri
        }
        assert exposed == {str(rows): ms / 1000 for rows, ms in zip(PASS_ROWS, measured, strict=True)}
        # The router reads the same curve from the status report, and the sessions sharing passes.
        status = engine.status()
        assert status.pass_us is not None and status.pass_sessions == 0 and status.pass_apart is False
        assert [(point.rows, point.us) for point in status.pass_us] == [
            (rows, round(1000 * ms)) for rows, ms in zip(PASS_ROWS, measured, strict=True)
        ]
    finally:
        await engine.stop()
        await mlc.close()


async def test_a_direct_output_read_fails_as_the_verifiers_http_answers(target: TargetModel) -> None:
    mlc = MLC.from_config(authority="verifier.test")
    engine = VerifierEngine(uri="https://verifier.test", settings=VerifierConfig(), target=target, mlc=mlc, ttl_ms=1000)
    await engine.start()
    try:
        read = local_output_reader(engine)
        # A session the verifier does not hold: the 404 its service answers, which the client follows.
        with pytest.raises(PeerClientError) as missing:
            await read(b"\x01" * 16, 0)
        assert missing.value.status == 404
    finally:
        await engine.stop()
        await mlc.close()
