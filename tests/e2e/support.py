"""What the end-to-end tests share: the prompts, running the `sdcp` command, the greedy reference."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tests.llama_greedy import exact_llama, llama_cpp_greedy
from tests.waiting import HANG_GUARD_S

from sdcp.cluster import LocalCluster
from sdcp.models.choice import choose_backend
from sdcp.models.registry import end_of_text_tokens, load_model, load_tokenizer
from sdcp.models.weights.digests import gguf_digest, tokenizer_file_digest, weights_digest
from sdcp.models.weights.fetch import smollm2_gguf
from sdcp.protocol.messages import session_path_id
from sdcp.threads import usable_cores
from sdcp.transport.client import SDCPClient

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fib",
]
MAX_NEW = 24


def sdcp(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the `sdcp` command line as a user would, with its own SDCP home."""
    env = {**os.environ, "SDCP_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "sdcp", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@contextlib.contextmanager
def cluster_up(home: Path, *args: str) -> Iterator[subprocess.CompletedProcess[str]]:
    """`sdcp up` in ``home`` with ``args``, its result for the caller to check, and `sdcp down`
    afterwards whatever the checks found: a check that fails must not leave the cluster running."""
    started = sdcp(home, "up", *args)
    try:
        yield started
    finally:
        stopped = sdcp(home, "down")
        assert stopped.returncode == 0, stopped.stderr


def cluster_backend() -> str:
    """The backend a default cluster's verifier runs its target on: the one `backend = "auto"`
    chooses on this host (the verifier reads the same measurement, sdcp.models.choice)."""
    return choose_backend("auto", "smollm2", device="cpu", threads=usable_cores()).backend


def backend_digests(backend: str) -> dict[str, str]:
    """The target and tokenizer digests a verifier of smollm2 on ``backend`` checks: the GGUF
    file's SHA-256 on llama.cpp, the loaded weights' digest on torch (docs/models.md, "Digests")."""
    tokenizer = tokenizer_file_digest(smollm2_gguf().parent / "tokenizer.json").hex()
    if backend == "llamacpp":
        return {"target": gguf_digest(smollm2_gguf()).hex(), "tokenizer": tokenizer}
    return {"target": weights_digest(load_model("smollm2").model).hex(), "tokenizer": tokenizer}


def greedy_reference() -> dict[str, list[int]]:
    """Greedy decoding of every prompt by the target's own library, on the backend the cluster
    runs it on: what rule 1 must reproduce."""
    if cluster_backend() == "llamacpp":
        return _llama_cpp_reference()
    loaded = load_model("smollm2")
    outputs = {}
    for prompt in PROMPTS:
        ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            generated = loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
            )
        outputs[prompt] = generated[0, ids.shape[1] :].tolist()
    return outputs


def reference_log_probs(prompt: str, continuation: list[int]) -> list[list[float]]:
    """The target's log-probabilities after the prompt and each token of the continuation but the
    last, computed by its own library on the cluster's backend."""
    tokenizer = load_tokenizer("smollm2")
    ids = tokenizer(prompt)["input_ids"]
    if cluster_backend() == "llamacpp":
        llama = exact_llama(smollm2_gguf(), 512, logits_all=True)
        llama.eval([*ids, *continuation])
        logits = torch.tensor(llama.scores[len(ids) - 1 : len(ids) + len(continuation) - 1], dtype=torch.float64)
    else:
        loaded = load_model("smollm2")
        with torch.inference_mode():
            full = torch.tensor([[*ids, *continuation]])
            logits = loaded.model(full).logits[0, len(ids) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).tolist()


def _llama_cpp_reference() -> dict[str, list[int]]:
    """Plain llama.cpp greedy decoding of the GGUF, up to and with the first end-of-text token."""
    tokenizer = load_tokenizer("smollm2")
    stop = set(end_of_text_tokens(tokenizer))
    prompts = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    outputs = {}
    for prompt, tokens in zip(PROMPTS, llama_cpp_greedy(smollm2_gguf(), prompts, MAX_NEW, n_ctx=512), strict=True):
        end = next((index + 1 for index, token in enumerate(tokens) if token in stop), len(tokens))
        outputs[prompt] = tokens[:end]
    return outputs


async def stats_when_ended(home: Path, session: bytes, timeout_s: float = HANG_GUARD_S) -> dict[str, object]:
    """The verifier's statistics of a session of the local cluster, once the router says it ended."""
    cluster = LocalCluster(home)
    cert, key, ca = cluster.client_credentials()
    path = f"sessions/{session_path_id(session)}"
    async with SDCPClient(cluster.router, cert, key, ca) as router:
        async with asyncio.timeout(timeout_s):
            while not (described := (await router.get_cbor(path))[1])["ended"]:
                await asyncio.sleep(0.1)
    async with SDCPClient(str(described["verifier"]), cert, key, ca) as verifier:
        stats = (await verifier.get_cbor(f"{path}/stats"))[1]
    assert isinstance(stats, dict)
    return stats
