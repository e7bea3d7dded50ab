"""A raw HTTP/2 connection to the mTLS server for the transport's conformance tests
(tests/transport/test_h2_conformance.py, tests/transport/test_server_tls.py): `Wire` opens TLS as the
first drafter of the test PKI, sends the preface and SETTINGS of its choosing, writes frames the test
builds (bypassing any client state) and reads the server's frames with hyperframe alone."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import h2.config
import h2.connection
import hyperframe.frame as frames

from sdcp.transport import MTLSServer, client_context

from .tls_harness import PKI

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class Wire:
    """A TLS connection on which the test writes frames of its choosing and reads the server's."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        # Parses what the server sends; what the test sends bypasses it.
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))

    @classmethod
    async def open(cls, target: MTLSServer, pki: PKI, *, preface: bytes = PREFACE) -> Wire:
        context = client_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port, ssl=context)
        wire = cls(reader, writer)
        wire.h2.initiate_connection()
        wire.h2.data_to_send()  # the h2 client's own preface is replaced by ours
        # Our SETTINGS, and the acknowledgement of the server's, which it sends first (RFC 9113 3.4).
        writer.write(preface + frames.SettingsFrame(0).serialize() + frames.SettingsFrame(0, flags=["ACK"]).serialize())
        await writer.drain()
        return wire

    async def send(self, *sent: frames.Frame | bytes) -> None:
        for frame in sent:
            self.writer.write(frame if isinstance(frame, bytes) else frame.serialize())
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()

    def headers(
        self, stream_id: int, *, path: bytes = b"/ok", extra: list[tuple[bytes, bytes]] | None = None
    ) -> frames.HeadersFrame:
        encoder = self.h2.encoder
        block = encoder.encode(
            [(b":method", b"GET"), (b":path", path), (b":scheme", b"https"), (b":authority", b"x"), *(extra or [])]
        )
        frame = frames.HeadersFrame(stream_id)
        frame.data = block
        frame.flags.add("END_HEADERS")
        frame.flags.add("END_STREAM")
        return frame

    async def until(self, kinds: tuple[type[frames.Frame], ...], timeout: float = 5.0) -> list[frames.Frame]:
        """The server's frames until one of ``kinds`` arrives, the connection closes or time passes.
        Parsed with hyperframe alone: the test's own frames bypass any client state."""
        seen: list[frames.Frame] = []
        buffer = b""
        with contextlib.suppress(TimeoutError, ConnectionError, ssl.SSLError):
            async with asyncio.timeout(timeout):
                while not any(isinstance(frame, kinds) for frame in seen):
                    data = await self.reader.read(65536)
                    if not data:
                        break
                    buffer += data
                    while len(buffer) >= 9:
                        frame, length = frames.Frame.parse_frame_header(memoryview(buffer[:9]))
                        if len(buffer) < 9 + length:
                            break
                        frame.parse_body(memoryview(buffer[9 : 9 + length]))
                        buffer = buffer[9 + length :]
                        seen.append(frame)
        return seen

    def close(self) -> None:
        self.writer.close()
