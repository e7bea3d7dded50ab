"""Reading a session's output from a verifier (SDCP 6.7), shared by the service tests."""

from __future__ import annotations

from sdcp.protocol.messages import Output, session_path_id
from sdcp.transport.client import SDCPClient


async def read_output(client: SDCPClient, session: bytes, start: int = 0, *, until: int | None = None) -> list[Output]:
    """Output messages from index ``start`` until the final one (or until ``until`` tokens)."""
    outputs: list[Output] = []
    position = start
    while True:
        _, body = await client.get_cbor(f"sessions/{session_path_id(session)}/output", {"from": position})
        output = Output.from_obj(body)
        outputs.append(output)
        position = output.from_ + len(output.tokens)
        if output.final or (until is not None and position >= until):
            return outputs


def output_tokens(outputs: list[Output]) -> list[int]:
    return [token for output in outputs for token in output.tokens]
