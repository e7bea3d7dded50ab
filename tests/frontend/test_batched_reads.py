"""`BatchedReads`, the client's output reads of one verifier sent together as POST outputs, against a
verifier played by the test: which reads go in which request, and what each reader learns. The
service itself is tested over HTTP/2 + mTLS (tests/services/test_verifier_service.py, and with a
router and real streams, tests/services/test_router_service.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from sdcp.frontend.client import BatchedReads, ReadAlone
from sdcp.protocol.messages import Output, OutputBatch, OutputReads
from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.transport.client import SDCPClient
from sdcp.transport.errors import ConnectionLost

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


class PlayedVerifier:
    """Answers each POST outputs when the test says so."""

    base_uri = "https://127.0.0.1:1"

    def __init__(self) -> None:
        self.asked: list[dict[bytes, int]] = []
        self.answers: list[asyncio.Future[object]] = []
        self.arrived = asyncio.Event()

    async def post_cbor(self, path: str, obj: object, **_options: Any) -> tuple[int, object]:
        assert path == "outputs"
        reads = OutputReads.from_obj(obj)
        self.asked.append({read.session: read.from_ for read in reads.reads})
        answer: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        self.arrived.set()
        result = await answer
        if isinstance(result, Exception):
            raise result
        return 200, result

    async def request(self, count: int) -> None:
        """Until ``count`` requests have arrived."""
        while len(self.asked) < count:
            self.arrived.clear()
            await self.arrived.wait()


def output(session: bytes, start: int, *tokens: int) -> Output:
    return Output(session=session, epoch=1, from_=start, tokens=tokens, final=False)


def answer(*outputs: Output) -> dict[str, object]:
    return OutputBatch(outputs=outputs, refused=()).to_obj()


@pytest.fixture
def verifier() -> PlayedVerifier:
    return PlayedVerifier()


async def test_reads_asked_together_go_in_one_request_and_the_unanswered_go_again(verifier: PlayedVerifier) -> None:
    reads = BatchedReads(cast(SDCPClient, verifier))
    first, second = asyncio.create_task(reads.read(A, 3)), asyncio.create_task(reads.read(B, 0))
    await verifier.request(1)
    assert verifier.asked == [{A: 3, B: 0}]
    verifier.answers[0].set_result(answer(output(A, 3, 7, 8)))
    assert await first == output(A, 3, 7, 8)
    # B had no news: it is asked again, alone.
    await verifier.request(2)
    assert verifier.asked[1] == {B: 0} and not second.done()
    verifier.answers[1].set_result(answer(output(B, 0, 9)))
    assert await second == output(B, 0, 9)
    await reads.aclose()


async def test_a_read_asked_while_a_request_waits_goes_at_once_in_its_own(verifier: PlayedVerifier) -> None:
    reads = BatchedReads(cast(SDCPClient, verifier))
    waiting = asyncio.create_task(reads.read(A, 5))
    await verifier.request(1)
    newcomer = asyncio.create_task(reads.read(C, 0))
    await verifier.request(2)
    assert verifier.asked == [{A: 5}, {C: 0}]
    verifier.answers[1].set_result(answer(output(C, 0, 1)))
    assert await newcomer == output(C, 0, 1) and not waiting.done()
    # An answer for a position the reader no longer waits at is not given to it.
    verifier.answers[0].set_result(answer(output(A, 4, 2, 3)))
    await verifier.request(3)
    assert verifier.asked[2] == {A: 5} and not waiting.done()
    waiting.cancel()
    await reads.aclose()


async def test_a_second_read_of_a_session_goes_alone(verifier: PlayedVerifier) -> None:
    reads = BatchedReads(cast(SDCPClient, verifier))
    waiting = asyncio.create_task(reads.read(A, 0))
    await verifier.request(1)
    with pytest.raises(ReadAlone):
        await reads.read(A, 0)
    waiting.cancel()
    await reads.aclose()


async def test_a_failed_request_fails_each_of_its_reads_and_a_refusal_its_own(verifier: PlayedVerifier) -> None:
    reads = BatchedReads(cast(SDCPClient, verifier))
    first, second = asyncio.create_task(reads.read(A, 0)), asyncio.create_task(reads.read(B, 0))
    await verifier.request(1)
    verifier.answers[0].set_result(ConnectionLost("the verifier went away"))
    for read in (first, second):
        with pytest.raises(ConnectionLost):
            await read
    refused = asyncio.create_task(reads.read(A, 2))
    await verifier.request(2)
    problem = ProtocolError(ProblemType.STALE_EPOCH, "epoch 2 is current").to_problem()
    refusal = {"session": A, "type": problem["type"], "status": problem["status"], "detail": problem["detail"]}
    verifier.answers[1].set_result({"outputs": [], "refused": [refusal]})
    with pytest.raises(ProtocolError) as err:
        await refused
    assert err.value.problem is ProblemType.STALE_EPOCH and reads.supported
    await reads.aclose()


async def test_a_verifier_without_post_outputs_is_read_one_get_a_session(verifier: PlayedVerifier) -> None:
    reads = BatchedReads(cast(SDCPClient, verifier))
    read = asyncio.create_task(reads.read(A, 0))
    await verifier.request(1)
    verifier.answers[0].set_result(ProtocolError(None, "Not Found", status=404))
    with pytest.raises(ReadAlone):
        await read
    assert not reads.supported
    await reads.aclose()


async def test_closed_reads_answer_their_waiting_readers_and_ask_nothing_more(verifier: PlayedVerifier) -> None:
    reads = BatchedReads(cast(SDCPClient, verifier))
    waiting = asyncio.create_task(reads.read(A, 0))
    await verifier.request(1)
    await reads.aclose()
    with pytest.raises(ConnectionLost):
        await waiting
    # Turns of the loop in which a read left unanswered would have been asked again.
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(verifier.asked) == 1
    with pytest.raises(ConnectionLost):
        await reads.read(B, 0)


async def test_reads_past_the_first_token_wait_for_the_others_and_a_first_read_takes_them(
    verifier: PlayedVerifier,
) -> None:
    """Streams past their first token wait for the others the same pass answers (keep_pace_s, an
    hour here); a stream's first read goes at once, and those waiting go with it."""
    reads = BatchedReads(cast(SDCPClient, verifier), keep_pace_s=3600)
    first = asyncio.create_task(reads.read(A, 5))
    await asyncio.sleep(0)
    second = asyncio.create_task(reads.read(B, 7))
    for _ in range(3):
        await asyncio.sleep(0)
    assert verifier.asked == []
    newcomer = asyncio.create_task(reads.read(C, 0))
    await verifier.request(1)
    assert verifier.asked == [{A: 5, B: 7, C: 0}]
    verifier.answers[0].set_result(answer(output(A, 5, 1), output(B, 7, 2), output(C, 0, 3)))
    assert [await read for read in (first, second, newcomer)] == [output(A, 5, 1), output(B, 7, 2), output(C, 0, 3)]
    await reads.aclose()
