"""The client host's program: opens sessions through the router and streams their output,
following failovers as a front end does (SDCP 6.7). Prints one JSON object per line: `opened`,
`progress` as tokens arrive, and `done` with every token and the epoch it came with.

Given several routers (`--router` more than once), session lane i prefers router i modulo their
number, so that each router holds sessions; each lane falls back to the others as a front end does.

With `--until-stdin-closes` it keeps N sessions running, opening another as each ends, until its
standard input closes; then those running go on to their end.

python -m tests.faults.drive --router URI [--router URI] --cert F --key F --ca F --sessions N --max-new M
    [--until-stdin-closes]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from pathlib import Path

from sdcp.frontend.client import ClusterClient, SessionHandle
from sdcp.protocol.messages import Action, Contract
from sdcp.protocol.problems import ProtocolError
from sdcp.transport.errors import TransportError

PROMPT = [5, 17, 42, 9, 100, 3]
# A front end tries an open again while the router or the verifiers restart: up to about two
# minutes, backing off to 2 s between tries.
OPEN_ATTEMPTS = 60
# A bound for a router that never lists a target, not how long registration takes.
TARGET_WAIT_S = 300.0


def _say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def _open(client: ClusterClient, contract: Contract) -> SessionHandle:
    for attempt in range(1, OPEN_ATTEMPTS):
        try:
            return await client.open(PROMPT, contract)
        except (TransportError, ProtocolError):
            await asyncio.sleep(min(2.0, 0.1 * attempt))
    return await client.open(PROMPT, contract)


async def _one(client: ClusterClient, index: int, contract: Contract) -> None:
    tokens: list[int] = []
    epochs: list[int] = []
    finish: int | None = None
    error: str | None = None
    try:
        handle = await _open(client, contract)
        _say(event="opened", session=index, id=handle.session.hex(), verifier=handle.verifier, drafter=handle.drafter)
        async for chunk in client.stream(handle):
            if chunk.start != len(tokens):
                error = f"chunk at {chunk.start} after {len(tokens)} tokens"
                break
            tokens.extend(chunk.tokens)
            epochs.extend([chunk.epoch] * len(chunk.tokens))
            _say(event="progress", session=index, tokens=len(tokens), epoch=chunk.epoch)
            if chunk.finish is not None:
                finish = int(chunk.finish)
    except Exception as exc:  # noqa: BLE001 - a clear error is one of the outcomes the test accepts
        error = f"{type(exc).__name__}: {exc}"
    _say(event="done", session=index, tokens=tokens, epochs=epochs, finish=finish, error=error)


async def _target(client: ClusterClient) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TARGET_WAIT_S
    while not (targets := await client.targets()):
        if loop.time() > deadline:
            raise RuntimeError(f"the router listed no target in {TARGET_WAIT_S} s")
        await asyncio.sleep(0.1)
    return targets[0]


async def main(args: argparse.Namespace) -> None:
    routers: list[str] = args.router
    clients = [
        ClusterClient(routers[i:] + routers[:i], cert=args.cert, key=args.key, ca=args.ca, follow_attempts=60)
        for i in range(len(routers))
    ]
    try:
        await _drive(args, clients)
    finally:
        for client in clients:
            await client.aclose()


async def _drive(args: argparse.Namespace, clients: list[ClusterClient]) -> None:
    target = await _target(clients[0])
    contract = Contract.from_obj(
        {
            "target": target["model"],
            "tokenizer": target["tokenizer"],
            "rule": 1,
            "m_max": 4,
            "max_new": args.max_new,
            "stop": [],
            # Drafters drive every round: rejections never escalate.
            "low_rounds": 1_000_000,
            "fallback": [int(Action.REDUCE), int(Action.FAIL)],
        }
    )
    stdin_closed = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read)) if args.until_stdin_closes else None
    indices = itertools.count()

    async def lane(client: ClusterClient) -> None:
        while True:
            await _one(client, next(indices), contract)
            if stdin_closed is None or stdin_closed.done():
                return

    await asyncio.gather(*(lane(clients[i % len(clients)]) for i in range(args.sessions)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--router", required=True, action="append")
    parser.add_argument("--cert", type=Path, required=True)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--ca", type=Path, required=True)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=200)
    parser.add_argument("--until-stdin-closes", action="store_true")
    asyncio.run(main(parser.parse_args()))
