"""What the end-to-end tests share: the prompts, running the `sdcp` command, the greedy reference."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import torch
from tests.waiting import HANG_GUARD_S

from sdcp.cluster import LocalCluster
from sdcp.models.registry import load_model
from sdcp.protocol.messages import session_path_id
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


def greedy_reference() -> dict[str, list[int]]:
    """transformers' own greedy decoding of every prompt: what rule 1 must reproduce."""
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
