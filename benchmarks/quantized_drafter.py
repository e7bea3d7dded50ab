"""Does a cheaper quantization of the bundled model pay as a drafter for its Q4_1 target on llama.cpp?

The bundled GGUF (SmolLM2-135M-Instruct, Q4_1) is requantized with llama.cpp's own quantize API
(`llama_model_quantize`, allow_requantize) into the types below, and each candidate drafts for the
Q4_1 target under rule 1 (draft-li-sdcp, 6.4): on benchmark prompts, rounds of k drafted tokens
are checked against the target's greedy continuation (accepted: the drafted tokens up to the first
that differs, and the target's own token is emitted after them). Measured: the drafter's time per
drafted token (`LlamaCppDrafter`, one thread), the acceptance, the target's time per token decoding
alone and per verification pass of k + 1 tokens (`LlamaCppTarget`, its own threads). Estimated: the
tokens per second of drafting and verifying in turn (k t_d + t_verify(k + 1) per round, no overlap)
against the target decoding alone, and the t_d at which a drafter of that acceptance would break even.

Run: .venv/bin/python benchmarks/quantized_drafter.py --prompts 12 --tokens 24   (needs `sdcp models fetch`)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp

from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.home import sdcp_home
from sdcp.models.fetch import smollm2_gguf
from sdcp.models.llamacpp import LlamaCppTarget
from sdcp.models.llamacpp_draft import LlamaCppDrafter
from sdcp.models.registry import load_tokenizer
from sdcp.protocol.messages import Sampling

DRAFT_LENGTHS = (2, 4, 6)
GREEDY = Sampling(temperature_milli=0)
SESSION = b"quantized-draft!"
# Timed verification passes per prompt and draft length.
VERIFY_REPEATS = 3


@dataclass(frozen=True)
class Quantization:
    """A llama.cpp file type (LLAMA_FTYPE_*)."""

    name: str
    ftype: int


# SmolLM2-135M's hidden size, 576, is no multiple of 256: llama.cpp stores the K-quants' tensors of
# that width (all but ffn_down) as Q4_0 instead, so Q2_K shrinks the file by a tenth only. Q2_0 (blocks
# of 32) applies to every layer's weights. The IQ1/IQ2 types, Q2_K_S and Q1_0 are refused (they need an
# importance matrix, or blocks that 576 is no multiple of).
QUANTIZATIONS = (
    Quantization("Q2_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K),
    Quantization("Q2_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_0),
)


def quantize(source: Path, quantization: Quantization, directory: Path) -> Path:
    """The quantized file, made once into ``directory``."""
    out = directory / f"{source.stem}-{quantization.name}.gguf"
    if out.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = quantization.ftype
    params.allow_requantize = True  # the source is quantized already (Q4_1)
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize refused {quantization.name}")
    partial.rename(out)
    return out


@dataclass
class DraftTally:
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.drafted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds


@dataclass
class TargetTimes:
    alone: list[float] = field(default_factory=list)
    verify: dict[int, list[float]] = field(default_factory=lambda: {k: [] for k in DRAFT_LENGTHS})


def target_pass(target: LlamaCppTarget, prompt: list[int], continuation: list[int], times: TargetTimes) -> None:
    """Time the target's one-token passes of the continuation, then passes that verify k of it."""
    target.open_session(SESSION, prompt)
    for token in continuation:
        started = time.perf_counter()
        row = target.score([(SESSION, ())])[0][0]
        times.alone.append(time.perf_counter() - started)
        assert int(row.argmax()) == token, "the target's greedy continuation changed between runs"
        target.commit(SESSION, 0, [token])
    target.close_session(SESSION)
    target.open_session(SESSION, prompt)
    for k in DRAFT_LENGTHS:
        for _ in range(VERIFY_REPEATS):
            started = time.perf_counter()
            target.score([(SESSION, continuation[:k])])
            times.verify[k].append(time.perf_counter() - started)
            target.rollback(SESSION)
    target.close_session(SESSION)


def draft_rounds(
    drafter: LlamaCppDrafter, prompt: list[int], continuation: list[int], k: int, tally: DraftTally
) -> None:
    """Rule 1 rounds of k drafted tokens against the target's greedy continuation."""
    drafter.open_session(SESSION, prompt)
    drafter.draft(SESSION, 1, GREEDY)  # the prefill, which is not a drafted token's cost
    drafter.sync(SESSION, prompt)
    committed = 0
    while committed + k + 1 <= len(continuation):
        result = drafter.draft(SESSION, k, GREEDY)
        accepted = 0
        while accepted < k and result.tokens[accepted] == continuation[committed + accepted]:
            accepted += 1
        committed += accepted + 1
        drafter.sync(SESSION, [*prompt, *continuation[:committed]])
        tally.seconds += result.seconds
        tally.drafted += k
        tally.accepted += accepted
        tally.rounds += 1
    drafter.close_session(SESSION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens after each prompt")
    parser.add_argument("--prompts", type=int, default=12, help="benchmark prompts, spread over the workloads")
    parser.add_argument("--target-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=sdcp_home() / "models" / "quantized")
    args = parser.parse_args()

    source = smollm2_gguf()
    capacity = 1024
    # The target is made first: its construction routes llama.cpp's log lines away from stderr.
    target = LlamaCppTarget(
        source, source.parent / "tokenizer.json", threads=args.target_threads, kv_slots=1, kv_capacity=capacity
    )
    files = {"Q4_1 (the target's)": source}
    files.update({q.name: quantize(source, q, args.out) for q in QUANTIZATIONS})
    drafters = {
        name: LlamaCppDrafter(path, threads=1, kv_slots=1, kv_capacity=capacity) for name, path in files.items()
    }
    tokenizer = load_tokenizer("smollm2")
    every = [tokenize_prompt(tokenizer, text) for workload in load_workloads() for text in workload.prompts]
    prompts = every[:: max(1, len(every) // args.prompts)][: args.prompts]

    times = TargetTimes()
    tallies = {(name, k): DraftTally() for name in drafters for k in DRAFT_LENGTHS}
    for index, prompt in enumerate(prompts):
        print(f"prompt {index + 1} of {len(prompts)}", file=sys.stderr, flush=True)
        target.open_session(SESSION, prompt)
        continuation: list[int] = []
        for _ in range(args.tokens):
            continuation.append(int(target.score([(SESSION, ())])[0][0].argmax()))
            target.commit(SESSION, 0, continuation[-1:])
        target.close_session(SESSION)
        # Target and drafters take turns on each prompt, so that the other work of a shared host
        # falls on all of them alike.
        target_pass(target, prompt, continuation, times)
        for name, drafter in drafters.items():
            for k in DRAFT_LENGTHS:
                draft_rounds(drafter, prompt, continuation, k, tallies[name, k])

    t_target = statistics.median(times.alone)
    t_verify = {k: statistics.median(samples) for k, samples in times.verify.items()}
    print(
        f"{len(prompts)} prompts x {args.tokens} greedy tokens; target Q4_1 on {args.target_threads} thread(s): "
        f"{1000 * t_target:.1f} ms/token alone ({1 / t_target:.1f} tokens/s); verification pass of k + 1 tokens: "
        + ", ".join(f"k={k} {1000 * t_verify[k]:.1f} ms" for k in DRAFT_LENGTHS)
    )
    print(
        f"{'drafter':<22} {'MiB':>5} {'k':>2} {'t_d ms':>7} {'accept':>7} {'tok/round':>9} "
        f"{'ms/round':>8} {'tok/s':>6} {'speedup':>7} {'t_d to pay':>10}"
    )
    for name, path in files.items():
        for k in DRAFT_LENGTHS:
            tally = tallies[name, k]
            round_s = k * tally.seconds_per_token + t_verify[k]
            rate = tally.tokens_per_round / round_s
            # The drafting time per token at which rounds would just match the target alone.
            break_even = (tally.tokens_per_round * t_target - t_verify[k]) / k
            print(
                f"{name:<22} {path.stat().st_size / 2**20:>5.1f} {k:>2} {1000 * tally.seconds_per_token:>7.1f} "
                f"{tally.acceptance:>7.2f} {tally.tokens_per_round:>9.2f} {1000 * round_s:>8.1f} {rate:>6.1f} "
                f"{rate * t_target:>7.2f} {1000 * break_even:>10.1f}"
            )


if __name__ == "__main__":
    main()
