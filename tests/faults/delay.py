"""Delay on a host's link without netem (this kernel has none): a transparent TCP relay on the
host. iptables redirects every TCP connection the host opens to the relay, which connects to the
original destination (SO_ORIGINAL_DST) with a socket mark the redirect skips, and forwards each
chunk in both directions `--delay-ms` after it arrived, in order. It prints `LISTENING` once it
accepts connections.

ip netns exec HOST python -m tests.faults.delay --port 15001 --delay-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct

MARK = 0x5DC  # the relay's own connections, which the redirect leaves alone
LISTENING = "LISTENING"
_SO_ORIGINAL_DST = 80


def _original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(address), port


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            at, chunk = await due.get()
            if not chunk:
                break
            await asyncio.sleep(max(0.0, at - loop.time()))
            writer.write(chunk)
            await writer.drain()
        writer.close()

    sender = asyncio.ensure_future(deliver())
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await reader.read(65536):
            due.put_nowait((loop.time() + delay, chunk))
    due.put_nowait((loop.time() + delay, b""))
    with contextlib.suppress(ConnectionError, OSError):
        await sender


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    host, port = _original_destination(writer.get_extra_info("socket"))
    upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
    upstream.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(upstream, (host, port))
        up_reader, up_writer = await asyncio.open_connection(sock=upstream)
    except OSError:
        upstream.close()
        writer.close()
        return
    await asyncio.gather(_pump(reader, up_writer, delay), _pump(up_reader, writer, delay))


async def main(port: int, delay_ms: float) -> None:
    server = await asyncio.start_server(lambda r, w: _relay(r, w, delay_ms / 1000), "127.0.0.1", port)
    print(LISTENING, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=15001)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.port, arguments.delay_ms))
