"""Model backend benchmark: decode, verification by M, batched verification, drafters.

Run: .venv/bin/python benchmarks/models_bench.py   (needs `sdcp models fetch` for smollm2)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from itertools import count

from sdcp.models import Drafter, TargetModel, load_drafter, load_model
from sdcp.protocol.messages import Sampling
from sdcp.protocol.rules import RULES, SecureRandom

GREEDY = Sampling(temperature_milli=0)
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Write a short story about a robot who learns to paint.",
    "List three facts about the moon.",
]
_SESSIONS: Iterator[bytes] = (index.to_bytes(16, "big") for index in count(1))


def _median_ms(run: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def _prompt(target: TargetModel, text: str) -> list[int]:
    return target.tokenizer(text).input_ids  # type: ignore[attr-defined, union-attr]


def bench_decode(target: TargetModel, tokens: int) -> float:
    session = next(_SESSIONS)
    target.open_session(session, _prompt(target, PROMPTS[2]))
    started = time.perf_counter()
    for _ in range(tokens):
        row = target.score([(session, ())])[0]
        target.commit(session, 0, [int(row[0].argmax())])
    target.close_session(session)
    return (time.perf_counter() - started) * 1000 / tokens


def bench_verify_by_m(target: TargetModel, repeats: int) -> dict[int, float]:
    session = next(_SESSIONS)
    target.open_session(session, _prompt(target, PROMPTS[2]))
    results = {}
    for m in range(1, 9):
        def one_pass(m: int = m) -> None:
            target.score([(session, list(range(100, 100 + m)))])
            target.rollback(session)

        results[m] = _median_ms(one_pass, repeats)
    target.close_session(session)
    return results


def bench_batched(target: TargetModel, repeats: int, m: int = 5) -> dict[int, tuple[float, float]]:
    results = {}
    for size in (1, 4, 8, 16):
        sessions = [next(_SESSIONS) for _ in range(size)]
        for index, session in enumerate(sessions):
            target.open_session(session, _prompt(target, PROMPTS[index % len(PROMPTS)]))
        proposal = list(range(200, 200 + m))

        def batched() -> None:
            target.score([(session, proposal) for session in sessions])
            for session in sessions:
                target.rollback(session)

        def separate() -> None:
            for session in sessions:
                target.score([(session, proposal)])
                target.rollback(session)

        results[size] = (_median_ms(batched, repeats), _median_ms(separate, repeats))
        for session in sessions:
            target.close_session(session)
    return results


def bench_drafter(
    target: TargetModel, drafter: Drafter, new_tokens: int, m: int
) -> tuple[float, float, float]:
    """(drafter ms/token, acceptance a/M, committed tokens per target pass) under rule 1."""
    proposed = accepted = passes = 0
    draft_seconds = 0.0
    for text in PROMPTS:
        session = next(_SESSIONS)
        prompt = _prompt(target, text)
        target.open_session(session, prompt)
        drafter.open_session(session, prompt)
        output: list[int] = []
        while len(output) < new_tokens:
            draft = drafter.draft(session, m, GREEDY)
            draft_seconds += draft.seconds
            rows = target.score([(session, draft.tokens)])[0]
            verdict = RULES[1].accept(rows, None, draft.tokens, SecureRandom())
            emitted = [*draft.tokens[: verdict.accepted], verdict.extra_token]
            target.commit(session, verdict.accepted, emitted)
            output.extend(emitted)
            drafter.sync(session, [*prompt, *output])
            proposed += len(draft.tokens)
            accepted += verdict.accepted
            passes += 1
        target.close_session(session)
        drafter.close_session(session)
    committed = passes + accepted
    return draft_seconds * 1000 / proposed, accepted / proposed, committed / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafters", default="ngram,hf:smollm2")
    parser.add_argument("--tokens", type=int, default=32, help="decode/drafting tokens per prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--m", type=int, default=4, help="M for the drafter runs")
    args = parser.parse_args()

    loaded = load_model(args.target)
    target = TargetModel(loaded.model, loaded.tokenizer, name=loaded.name)
    print(f"target {args.target}: vocab {target.vocab_size}")
    print(f"target-only decode: {bench_decode(target, args.tokens):.1f} ms/token")
    print("verification pass (1 session), ms by M:")
    for m, ms in bench_verify_by_m(target, args.repeats).items():
        print(f"  M={m}: {ms:.1f}")
    print("batched verification, M=5: sessions, one batched pass ms, separate passes ms, ratio")
    for size, (batched, separate) in bench_batched(target, args.repeats).items():
        print(f"  {size:>2}: {batched:8.1f} {separate:8.1f}  {separate / batched:.2f}x")
    print(f"drafters (rule 1, M={args.m}, {len(PROMPTS)} prompts x {args.tokens} tokens):")
    for spec in args.drafters.split(","):
        drafter = load_drafter(spec, vocab_size=target.vocab_size)
        ms_per_token, acceptance, per_pass = bench_drafter(target, drafter, args.tokens, args.m)
        print(f"  {spec}: {ms_per_token:.2f} ms/token, acceptance {acceptance:.2f}, "
              f"{per_pass:.2f} tokens per target pass")


if __name__ == "__main__":
    main()
