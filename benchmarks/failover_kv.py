"""How long a verifier failover takes on a long prompt, resumed from the published target KV or
by a prefill (draft-li-sdcp 6.9 resume.target_kv; docs/performance.md).

Two verifier engines over one MLC (a disk store without a memory tier, so the successor reads the
blob back from the store) play the failed verifier and its successor, each on its own target. Per
repetition: a session of a long prompt opens at the first, which publishes its KV at the open
(kv_publish_min_tokens = 1: at its first commit), and self-decodes DECODED tokens; then what the router does at a
failover: fence the log, replay it, write the committed tokens, look the blob up, open the session
at the successor with or without ``target_kv``, and ask it to self-decode. Timed from the fence to
the end of the open, and to the first token the successor commits. The two ways alternate; every
output after the failover is checked against the session decoded without one (rule 1).

Run: .venv/bin/python benchmarks/failover_kv.py --backend llamacpp --repeats 5   (needs `sdcp models fetch`)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.cache import MLC, build_uri, target_kv_uri
from sdcp.cache.uri import LOG_KIND, TOKENS_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.verifier import VerifierEngine
from sdcp.models.backend import Target, TargetBackend
from sdcp.models.registry import load_target, load_tokenizer
from sdcp.protocol.messages import Action, Contract, SelfDecodeRequest, SessionOpen
from sdcp.protocol.records import encode_token_list, replay_commit_log
from sdcp.protocol.router import RouterSession
from sdcp.protocol.rules import GREEDY

AUTHORITY = "bench"
# Tokens the first verifier decodes before it fails, and the successor after it.
DECODED = 16
AFTER = 8
# A torch (fp32) blob is 45 KiB a token: above the MLC's default object limit (64 MiB) past about
# 1450 tokens. The benchmark's store takes larger ones.
MAX_OBJECT_BYTES = 512 * 2**20


@dataclass
class Failover:
    mode: str
    open_s: float
    first_token_s: float
    imported: int
    tokens: tuple[int, ...]


def long_prompt(length: int) -> list[int]:
    """The benchmark's prompts through the chat template, one after another, cut to ``length``."""
    tokenizer = load_tokenizer("smollm2")
    chats = [tokenize_prompt(tokenizer, text) for workload in load_workloads() for text in workload.prompts]
    tokens = [token for chat in chats for token in chat]
    while len(tokens) < length:
        tokens += tokens
    return tokens[:length]


def contract_for(target: Target) -> Contract:
    return Contract.from_obj(
        {
            "target": target.weights_digest,
            "tokenizer": target.tokenizer_digest,
            "rule": GREEDY.id,
            "m_max": 4,
            "max_new": DECODED + AFTER,
            "stop": [],
            "low_rounds": 1000,
            "fallback": [Action.FAIL],
            "self_load": 100,
            "self_max": DECODED,
        }
    )


async def self_decode(engine: VerifierEngine, session: bytes, epoch: int) -> None:
    """One self-decoding period, to its end."""
    live = engine.sessions[session]
    await engine.self_decode(SelfDecodeRequest(session=session, epoch=epoch))
    decoder = live.self_decoder
    assert decoder is not None
    await decoder


async def failover(
    mlc: MLC, targets: tuple[Target, Target], prompt: tuple[int, ...], session: bytes, offer_kv: bool
) -> Failover:
    settings = VerifierConfig(kv_publish_min_tokens=1, kv_publish_every=0, drafter_silence_s=0)
    first, second = (
        VerifierEngine(uri=f"https://verifier{i}.bench", settings=settings, target=t, mlc=mlc, ttl_ms=1000)
        for i, t in enumerate(targets, 1)
    )
    await first.start()
    await second.start()
    try:
        contract = contract_for(targets[0])
        commit_log = build_uri(AUTHORITY, None, LOG_KIND, session.hex())
        await first.open_session(
            SessionOpen(session=session, epoch=1, contract=contract, prompt=prompt, commit_log=commit_log)
        )
        await self_decode(first, session, 1)
        publishing = first.sessions[session].kv_publishing
        if publishing is not None:
            await publishing

        started = time.perf_counter()
        log = mlc.commit_log(commit_log)
        await log.fence(2)
        replay = replay_commit_log((await log.read()).records, contract.digest, prompt)
        tokens_uri = build_uri(AUTHORITY, None, TOKENS_KIND, f"{session.hex()}-{len(replay.tokens)}")
        await mlc.put(tokens_uri, encode_token_list(replay.tokens))
        published = target_kv_uri(commit_log, session, 1)
        offered = published if offer_kv and published is not None and await mlc.exists(published) else None
        plan = RouterSession(
            session=session, epoch=1, contract=contract, prompt=prompt, commit_log=commit_log, verifier=first.uri
        )
        moved = plan.fail_over(second.uri, replay, tokens_uri, target_kv=offered)
        await second.open_session(moved.open_message())
        opened = time.perf_counter()
        await second.self_decode(SelfDecodeRequest(session=session, epoch=2))
        while not (await second.output(session, len(replay.tokens))).tokens:
            pass  # a read waits for tokens up to output_wait_s
        first_token = time.perf_counter()
        decoder = second.sessions[session].self_decoder
        if decoder is not None:
            await decoder
        output = await second.output(session, 0)
        return Failover(
            mode="published KV" if offer_kv else "prefill",
            open_s=opened - started,
            first_token_s=first_token - started,
            imported=second.sessions[session].kv_imported,
            tokens=output.tokens,
        )
    finally:
        await first.stop()
        await second.stop()


async def export_cost(target: Target, prompt: tuple[int, ...], repeats: int) -> tuple[float, int]:
    """Median seconds of one export of the prompt's KV (on the calling thread), and its size."""
    session = b"sdcp-export-time"
    target.open_session(session, prompt)
    try:
        times, size = [], 0
        for _ in range(repeats):
            started = time.perf_counter()
            size = len(target.export_kv(session))
            times.append(time.perf_counter() - started)
        return statistics.median(times), size
    finally:
        target.close_session(session)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["llamacpp", "torch"], default="llamacpp")
    parser.add_argument("--prompt-tokens", type=int, default=1800)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    backend: TargetBackend = args.backend
    prompt = tuple(long_prompt(args.prompt_tokens))
    capacity = args.prompt_tokens + DECODED + AFTER + 64
    targets = (
        load_target("smollm2", backend=backend, kv_slots=2, kv_capacity=capacity, threads=args.threads),
        load_target("smollm2", backend=backend, kv_slots=2, kv_capacity=capacity, threads=args.threads),
    )
    with tempfile.TemporaryDirectory() as store:
        mlc = MLC.from_config(
            authority=AUTHORITY, disk_dir=Path(store), memory_bytes=0, max_object_bytes=MAX_OBJECT_BYTES
        )
        results: list[Failover] = []
        for repeat in range(args.repeats):
            for offer_kv in (repeat % 2 == 0, repeat % 2 == 1):
                session = (2 * repeat + int(offer_kv)).to_bytes(16, "big")
                result = await failover(mlc, targets, prompt, session, offer_kv)
                results.append(result)
                print(
                    f"{result.mode:>12}: open {result.open_s:6.3f} s, first token {result.first_token_s:6.3f} s, "
                    f"imported {result.imported} tokens",
                    flush=True,
                )
        await mlc.close()
    reference = results[0].tokens
    assert all(r.tokens == reference for r in results), "an output after a failover differs (rule 1)"
    export_s, blob_bytes = await export_cost(targets[0], prompt, args.repeats)
    print(f"\n{backend}, prompt {len(prompt)} tokens, {DECODED} decoded before the failover, {args.threads} threads")
    print("| way | fence to session open (s) | fence to first token (s) | runs |")
    print("|---|---|---|---|")
    for mode in ("published KV", "prefill"):
        runs = [r for r in results if r.mode == mode]
        print(
            f"| {mode} | {statistics.median(r.open_s for r in runs):.3f} "
            f"| {statistics.median(r.first_token_s for r in runs):.3f} | {len(runs)} |"
        )
    print(f"blob {blob_bytes / 2**20:.1f} MiB, export {1000 * export_s:.0f} ms (median), outputs identical")


if __name__ == "__main__":
    asyncio.run(main())
