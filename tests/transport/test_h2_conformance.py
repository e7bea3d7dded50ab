"""HTTP/2 conformance of the mTLS server: the cases of h2spec (which no package registry here offers)
that concern a server of SDCP's requests, ported, each naming its RFC 9113 section. A client sends
raw frames; the server must answer with the error the RFC names and keep serving other clients."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hyperframe.frame as frames
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sdcp.transport import Listener, MTLSServer, cbor_response

from .h2_wire import Wire
from .tls_harness import PKI, client_for

pytestmark = pytest.mark.timeout(60)

E = h2.errors.ErrorCodes


async def ok(_request: Request) -> Response:
    return cbor_response({"ok": True})


@contextlib.asynccontextmanager
async def server(pki: PKI) -> AsyncIterator[MTLSServer]:
    listener = Listener.mtls("127.0.0.1", 0, cert=pki.server.cert, key=pki.server.key, ca=pki.ca)
    started = MTLSServer(Starlette(routes=[Route("/ok", ok)]), listener)
    await started.start()
    try:
        yield started
    finally:
        await started.stop()


def goaway(seen: list[frames.Frame]) -> frames.GoAwayFrame | None:
    return next((f for f in seen if isinstance(f, frames.GoAwayFrame)), None)


async def still_serving(target: MTLSServer, pki: PKI) -> None:
    async with client_for(target, pki, pki.drafter_b) as client:
        assert await client.get_cbor("ok") == (200, {"ok": True})


async def connection_error(pki: PKI, code: h2.errors.ErrorCodes, *sent: frames.Frame | bytes) -> None:
    async with server(pki) as target:
        wire = await Wire.open(target, pki)
        await wire.send(*sent)
        events = await wire.until((frames.GoAwayFrame,))
        terminated = goaway(events)
        assert terminated is not None and terminated.error_code == code, events
        wire.close()
        await still_serving(target, pki)


async def test_3_4_an_invalid_preface_ends_the_connection(pki: PKI) -> None:
    async with server(pki) as target:
        wire = await Wire.open(target, pki, preface=b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
        events = await wire.until((frames.GoAwayFrame,))
        assert goaway(events) is not None or wire.reader.at_eof()
        wire.close()
        await still_serving(target, pki)


async def test_4_2_a_frame_over_the_maximum_size_is_a_frame_size_error(pki: PKI) -> None:
    ping = frames.PingFrame(0)
    ping.opaque_data = b"12345678"
    oversized = bytearray(ping.serialize())
    oversized[0:3] = (20000).to_bytes(3, "big")  # a PING claiming a 20,000-octet payload
    await connection_error(pki, E.FRAME_SIZE_ERROR, bytes(oversized) + bytes(20000))


async def test_5_1_1_a_client_stream_with_an_even_id_is_a_protocol_error(pki: PKI) -> None:
    async with server(pki) as target:
        wire = await Wire.open(target, pki)
        await wire.send(wire.headers(2))
        terminated = goaway(await wire.until((frames.GoAwayFrame,)))
        assert terminated is not None and terminated.error_code == E.PROTOCOL_ERROR
        wire.close()


async def test_5_1_data_on_an_idle_stream_is_a_protocol_error(pki: PKI) -> None:
    data = frames.DataFrame(1)
    data.data = b"x"
    await connection_error(pki, E.PROTOCOL_ERROR, data)


async def test_6_1_data_on_stream_zero_is_a_protocol_error(pki: PKI) -> None:
    # hyperframe refuses to build it; the bytes of a DATA frame on stream 0 are written by hand.
    await connection_error(pki, E.PROTOCOL_ERROR, b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x")


async def test_6_7_a_ping_is_answered_with_its_payload(pki: PKI) -> None:
    async with server(pki) as target:
        wire = await Wire.open(target, pki)
        ping = frames.PingFrame(0)
        ping.opaque_data = b"sdcp-h2!"
        await wire.send(ping)
        events = await wire.until((frames.PingFrame,))
        acks = [f for f in events if isinstance(f, frames.PingFrame) and "ACK" in f.flags]
        assert acks and acks[0].opaque_data == b"sdcp-h2!"
        wire.close()


async def test_6_9_a_zero_window_increment_is_a_protocol_error(pki: PKI) -> None:
    update = frames.WindowUpdateFrame(0)
    update.window_increment = 0
    await connection_error(pki, E.PROTOCOL_ERROR, update)


async def test_6_9_1_a_window_past_2_31_minus_1_is_a_flow_control_error(pki: PKI) -> None:
    updates = []
    for _ in range(2):
        update = frames.WindowUpdateFrame(0)
        update.window_increment = 2**31 - 1
        updates.append(update)
    await connection_error(pki, E.FLOW_CONTROL_ERROR, *updates)


async def test_6_5_2_an_initial_window_past_2_31_minus_1_is_a_flow_control_error(pki: PKI) -> None:
    settings = frames.SettingsFrame(0)
    settings.settings = {frames.SettingsFrame.INITIAL_WINDOW_SIZE: 2**31}
    await connection_error(pki, E.FLOW_CONTROL_ERROR, settings)


async def test_8_2_an_uppercase_header_name_is_malformed(pki: PKI) -> None:
    async with server(pki) as target:
        wire = await Wire.open(target, pki)
        await wire.send(wire.headers(1, extra=[(b"X-Upper", b"1")]))
        events = await wire.until((frames.GoAwayFrame, frames.RstStreamFrame))
        reset = next((e for e in events if isinstance(e, frames.RstStreamFrame)), None)
        terminated = goaway(events)
        assert (reset is not None and reset.error_code == E.PROTOCOL_ERROR) or (
            terminated is not None and terminated.error_code == E.PROTOCOL_ERROR
        )
        assert not any(isinstance(e, frames.HeadersFrame) for e in events)  # never answered
        wire.close()
        await still_serving(target, pki)


async def test_5_1_2_streams_past_the_advertised_limit_are_refused_or_end_the_connection(pki: PKI) -> None:
    async with server(pki) as target:
        wire = await Wire.open(target, pki)
        limit = target._h2.state.max_concurrent_streams
        opened = []
        for index in range(limit + 5):
            frame = wire.headers(2 * index + 1)
            frame.flags.discard("END_STREAM")  # left open: each counts against the limit
            opened.append(frame)
        await wire.send(*opened)
        events = await wire.until((frames.GoAwayFrame, frames.RstStreamFrame))
        refused = [e for e in events if isinstance(e, frames.RstStreamFrame)]
        terminated = goaway(events)
        assert (refused and refused[0].error_code == E.REFUSED_STREAM) or (
            terminated is not None and terminated.error_code == E.PROTOCOL_ERROR
        )
        wire.close()
        await still_serving(target, pki)


async def test_6_7_a_peer_that_answers_no_ping_is_dropped_and_a_live_one_kept(pki: PKI) -> None:
    async with server(pki) as target:
        target._h2.state.ping_interval_s = 0.3
        async with client_for(target, pki, pki.drafter_b) as live:
            assert await live.get_cbor("ok") == (200, {"ok": True})
            silent = await Wire.open(target, pki)  # sends nothing more, answers no PING
            seen = await silent.until((frames.GoAwayFrame,), timeout=3.0)
            assert any(isinstance(f, frames.PingFrame) and "ACK" not in f.flags for f in seen)
            assert silent.reader.at_eof()  # dropped after its PING went unanswered
            assert len(target._h2.state.connections) == 1  # the h2 client answered every PING
            assert await live.get_cbor("ok") == (200, {"ok": True})
            silent.close()
