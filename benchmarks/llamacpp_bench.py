"""The llama.cpp target: do its rows depend on the shape of the pass, and how fast does it decode?

exactness: for the benchmark prompts (and one of 700 tokens), the rows after each position of the
greedy continuation, computed one token per pass and in passes of W tokens (a drafter proposing
W - 1 tokens that are all accepted), under llama.cpp's default settings, with flash attention, and
with LlamaCppTarget's settings; and how many greedy outputs change when they are verified in such
passes instead of decoded one token per pass.

speed: target-only greedy decoding of one session through LlamaCppTarget.score against plain
`Llama.generate` on the same GGUF and threads (with llama.cpp's defaults and with the target's
settings), alternating.

Run: .venv/bin/python benchmarks/llamacpp_bench.py exactness   (needs `sdcp models fetch`)
     .venv/bin/python benchmarks/llamacpp_bench.py speed --tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
import numpy as np

from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.models.fetch import smollm2_gguf
from sdcp.models.llamacpp import SEQUENCE_TOKENS_PER_CALL, LlamaCppTarget
from sdcp.models.registry import load_tokenizer
from sdcp.threads import usable_cores

CONTEXT = 1024
LONG_PROMPT_TOKENS = 700


@dataclass(frozen=True)
class Setting:
    name: str
    flash_attention: bool
    # Threads of a one-token ubatch (llama.cpp's n_threads) and of wider ones (n_threads_batch).
    one_token_threads: int
    threads: int
    ubatch: int


class Context:
    """One sequence of a llama.cpp context under a setting, fed at explicit positions."""

    def __init__(self, model: llama_cpp.llama_model_p, setting: Setting) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = CONTEXT
        params.n_batch = CONTEXT
        params.n_ubatch = setting.ubatch
        params.n_outputs_max_per_seq = 0
        params.n_threads, params.n_threads_batch = setting.one_token_threads, setting.threads
        flash = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.flash_attn_type = flash[0] if setting.flash_attention else flash[1]
        context = llama_cpp.llama_init_from_model(model, params)
        assert context is not None
        self.context = context
        memory = llama_cpp.llama_get_memory(context)
        assert memory is not None
        self.memory = memory
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(CONTEXT, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.context)

    def feed(self, tokens: list[int], start: int, rows: bool) -> np.ndarray:
        """Decode ``tokens`` at positions start.. in one llama_decode call; their rows if asked."""
        llama_cpp.llama_memory_seq_rm(self.memory, 0, start, -1)
        for slot, token in enumerate(tokens):
            self.batch.token[slot], self.batch.pos[slot] = token, start + slot
            self.batch.n_seq_id[slot], self.batch.logits[slot] = 1, rows
            self.batch.seq_id[slot][0] = 0
        self.batch.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(self.context, self.batch) == 0
        if not rows:
            return np.empty((0, self.vocab), np.float32)
        pointers = [llama_cpp.llama_get_logits_ith(self.context, slot) for slot in range(len(tokens))]
        return np.stack([np.ctypeslib.as_array(pointer, shape=(self.vocab,)) for pointer in pointers])

    def prefill(self, prompt: list[int]) -> None:
        for first in range(0, len(prompt) - 1, SEQUENCE_TOKENS_PER_CALL):
            self.feed(prompt[first : min(first + SEQUENCE_TOKENS_PER_CALL, len(prompt) - 1)], first, rows=False)

    def rows(self, prompt: list[int], continuation: list[int], width: int) -> np.ndarray:
        """The rows after prompt + continuation[:j] for every j, in passes of ``width`` tokens."""
        self.prefill(prompt)
        fed = [prompt[-1], *continuation[:-1]]
        start = len(prompt) - 1
        return np.concatenate([self.feed(fed[i : i + width], start + i, rows=True) for i in range(0, len(fed), width)])

    def greedy(self, prompt: list[int], steps: int, width: int, proposals: list[int]) -> list[int]:
        """Rule 1 over passes that feed the last token and the next width - 1 of ``proposals``."""
        self.prefill(prompt)
        out: list[int] = []
        while len(out) < steps:
            proposal = proposals[len(out) : len(out) + width - 1]
            rows = self.feed([([*prompt, *out])[-1], *proposal], len(prompt) + len(out) - 1, rows=True)
            accepted = 0
            while accepted < len(proposal) and int(rows[accepted].argmax()) == proposal[accepted]:
                accepted += 1
            out.extend([*proposal[:accepted], int(rows[accepted].argmax())])
        return out[:steps]


def _prompts() -> list[list[int]]:
    tokenizer = load_tokenizer("smollm2")
    chats = [tokenize_prompt(tokenizer, text) for workload in load_workloads() for text in workload.prompts]
    return [*chats, [token for chat in chats for token in chat][:LONG_PROMPT_TOKENS]]


def exactness(new_tokens: int, threads: int) -> None:
    prompts = _prompts()
    gguf = smollm2_gguf()
    target = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=1, kv_capacity=CONTEXT, threads=threads)
    continuations = []
    for prompt in prompts:
        target.open_session(b"c" * 16, prompt)
        decoded: list[int] = []
        for _ in range(new_tokens):
            decoded.append(int(target.score([(b"c" * 16, ())])[0][0].argmax()))
            target.commit(b"c" * 16, 0, decoded[-1:])
        target.close_session(b"c" * 16)
        continuations.append(decoded)
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
    settings = [
        Setting("llama.cpp defaults (no flash attention)", False, threads, threads, 512),
        Setting("flash attention", True, threads, threads, 512),
        Setting("LlamaCppTarget's settings", True, 1, threads, SEQUENCE_TOKENS_PER_CALL),
    ]
    for setting in settings:
        context = Context(model, setting)
        one = [context.rows(p, c, 1) for p, c in zip(prompts, continuations, strict=True)]
        for width in (9, new_tokens):
            wide = [context.rows(p, c, width) for p, c in zip(prompts, continuations, strict=True)]
            differences = np.concatenate([np.abs(a - b).max(axis=1) for a, b in zip(one, wide, strict=True)])
            flips = sum(int((a.argmax(1) != b.argmax(1)).sum()) for a, b in zip(one, wide, strict=True))
            print(
                f"{setting.name}: rows of {width}-token passes against one-token passes: "
                f"max |d| {differences.max():.3g}, median {np.median(differences):.3g}, "
                f"rows that differ {np.mean(differences > 0):.0%}, argmax differs in {flips} of {len(differences)}"
            )
        one_token_greedy = [context.greedy(p, new_tokens, 1, []) for p in prompts]
        verified = [context.greedy(p, new_tokens, 9, g) for p, g in zip(prompts, one_token_greedy, strict=True)]
        changed = [i for i, (a, b) in enumerate(zip(one_token_greedy, verified, strict=True)) if a != b]
        print(
            f"{setting.name}: greedy outputs verified in 9-token passes that differ from one-token decoding: "
            f"{len(changed)} of {len(prompts)}; differ from LlamaCppTarget's: "
            f"{sum(a != b for a, b in zip(one_token_greedy, continuations, strict=True))} of {len(prompts)}"
        )
        context.close()
    llama_cpp.llama_model_free(model)


def speed(new_tokens: int, repeats: int, threads: int) -> None:
    gguf = smollm2_gguf()
    prompt = _prompts()[0]
    target = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=1, kv_capacity=CONTEXT, threads=threads)
    plain = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    # Plain llama.cpp with the target's settings: flash attention, one thread for a one-token ubatch.
    alike = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=CONTEXT,
        n_ubatch=SEQUENCE_TOKENS_PER_CALL,
        flash_attn=True,
        n_threads=1,
        n_threads_batch=threads,
        verbose=False,
    )

    def through_target() -> list[int]:
        target.open_session(b"s" * 16, prompt)
        decoded: list[int] = []
        for _ in range(new_tokens):
            decoded.append(int(target.score([(b"s" * 16, ())])[0][0].argmax()))
            target.commit(b"s" * 16, 0, decoded[-1:])
        target.close_session(b"s" * 16)
        return decoded

    def through_generate(llama: llama_cpp.Llama) -> list[int]:
        llama.reset()  # no prefix reuse between repeats
        decoded: list[int] = []
        for token in llama.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
            decoded.append(int(token))
            if len(decoded) == new_tokens:
                break
        return decoded

    runs: dict[str, Callable[[], list[int]]] = {
        "LlamaCppTarget.score": through_target,
        "Llama.generate, llama.cpp's defaults": lambda: through_generate(plain),
        "Llama.generate, the target's settings": lambda: through_generate(alike),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    for name, samples in seconds.items():
        print(
            f"{name}: {new_tokens} tokens after a {len(prompt)}-token prompt, {threads} threads: median "
            f"{1000 * statistics.median(samples) / new_tokens:.1f} ms/token "
            f"({', '.join(f'{s:.2f}' for s in samples)} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("what", choices=["exactness", "speed"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=usable_cores())
    args = parser.parse_args()
    # LlamaCppTarget, made first, routes llama.cpp's log lines away from stderr.
    if args.what == "exactness":
        exactness(args.tokens, args.threads)
    else:
        speed(args.tokens, args.repeats, args.threads)


if __name__ == "__main__":
    main()
