"""Which HTTP/2 server for the mTLS listeners: hypercorn or the project's own (sdcp.transport.h2server)?

Both serve the same starlette app with the same certificates (TLS 1.3, client certificate required,
ALPN h2) on 127.0.0.1; the project's client sends the same requests to each: SDCP-sized CBOR POSTs,
one at a time and 16 at once. The figure that matters is the server's CPU per request, since on a
verifier's host it comes out of the model's passes (docs/performance.md). Run:

    .venv/bin/python benchmarks/h2_servers.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sdcp.localhost import free_port
from sdcp.transport import Listener, MTLSServer, SDCPClient, cbor_response, make_certs, read_cbor_body

SERVER = "https://127.0.0.1:9443"
CLIENT = "https://127.0.0.1:9444"
PROPOSAL = {"session": bytes(16), "epoch": 1, "round": 7, "base": 100, "tokens": list(range(8)), "digest": bytes(32)}


async def echo(request: Request) -> Response:
    return cbor_response(await read_cbor_body(request))


APP = Starlette(routes=[Route("/echo", echo, methods=["POST"])])


@contextlib.asynccontextmanager
async def own_server(certs: Path, port: int) -> AsyncIterator[None]:
    name = "127.0.0.1_9443"
    listener = Listener.mtls(
        "127.0.0.1", port, cert=certs / f"{name}.pem", key=certs / f"{name}.key", ca=certs / "ca.pem"
    )
    server = MTLSServer(APP, listener)
    await server.start()
    try:
        yield
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def hypercorn_server(certs: Path, port: int) -> AsyncIterator[None]:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.certfile = str(certs / "127.0.0.1_9443.pem")
    config.keyfile = str(certs / "127.0.0.1_9443.key")
    config.ca_certs = str(certs / "ca.pem")
    config.verify_mode = ssl.CERT_REQUIRED
    config.alpn_protocols = ["h2"]
    config.keep_alive_max_requests = 10**9
    config.loglevel = "WARNING"
    stop = asyncio.Event()
    task = asyncio.create_task(serve(APP, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    await asyncio.sleep(0.5)
    try:
        yield
    finally:
        stop.set()
        await task


async def measure(certs: Path, port: int, requests: int, concurrency: int) -> float:
    """Process CPU seconds per request (client and server share the process; the client's part is
    the same for both servers, so the difference is the server's)."""
    name = "127.0.0.1_9444"
    async with SDCPClient(
        f"https://127.0.0.1:{port}", certs / f"{name}.pem", certs / f"{name}.key", certs / "ca.pem",
        server_identity=SERVER,
    ) as client:  # fmt: skip
        await client.post_cbor("echo", PROPOSAL)
        started = time.process_time()
        for _ in range(requests // concurrency):
            await asyncio.gather(*(client.post_cbor("echo", PROPOSAL) for _ in range(concurrency)))
        return (time.process_time() - started) / requests


async def main(requests: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        certs = Path(directory)
        make_certs(certs, [SERVER, CLIENT])
        servers: dict[str, Callable[[Path, int], contextlib.AbstractAsyncContextManager[None]]] = {
            "own (h2)": own_server,
            "hypercorn": hypercorn_server,
        }
        for concurrency in (1, 16):
            for label, start in servers.items():
                port = free_port()
                async with start(certs, port):
                    per_request = await measure(certs, port, requests, concurrency)
                print(f"{label:>10}, {concurrency:>2} at once: {1000 * per_request:.3f} ms CPU per request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    asyncio.run(main(parser.parse_args().requests))
