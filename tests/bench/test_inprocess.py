"""The benchmark's in-process system runs the services' engines: same tokens as greedy decoding."""

from __future__ import annotations

from sdcp.bench.inprocess import DRAFTER_URI, InProcessSDCPSystem
from sdcp.bench.systems import TargetOnlySDCPSystem
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import TINY_NAME, end_of_text_tokens, load_model


async def test_the_engines_in_process_decode_greedily_and_speculate() -> None:
    loaded = load_model(TINY_NAME)
    target = TargetModel(loaded.model, loaded.tokenizer, name=loaded.name)
    stop = end_of_text_tokens(loaded.tokenizer)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    reference = TargetOnlySDCPSystem(target, stop).generate(prompt, 24)
    system = InProcessSDCPSystem(target, stop)
    await system.start()
    try:
        first = await system.generate(prompt, 24)
        second = await system.generate(prompt, 24)
    finally:
        await system.aclose()
    assert first.tokens == reference.tokens and second.tokens == reference.tokens
    # Rounds went through the drafter engine (proposals) or the verifier alone, and were timed.
    assert first.rounds >= 1 and first.proposed + first.self_decoded >= 1
    assert len(first.overhead_ms) == first.rounds + first.self_decoded - 1
    assert not system.drafter.runs  # every session's drafting ended with it
    assert DRAFTER_URI.startswith("https://")
