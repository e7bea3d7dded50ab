"""A drafter that knows a session's constraint (#30; docs/interpretations.md, "Structured output"):
the n-gram drafter engine, with the grammar of the contract's tokenizer ([drafter] target), proposes
the tokens the grammar forces at full confidence and its own drafts only up to a token the grammar
disallows, so its proposals are accepted where an unguided drafter's are not; the output is the
masked target's all the same (rule 1), and in the language under rule 2. The engines run in one
process (sdcp.bench.inprocess), the router always choosing the drafter."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sdcp.bench.inprocess import InProcessSDCPSystem
from sdcp.bench.systems import RunResult, TargetOnlySDCPSystem
from sdcp.config import DrafterConfig
from sdcp.frontend.client import build_contract
from sdcp.frontend.text import load_text_codec
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel, end_of_text_tokens
from sdcp.models.weights.paths import TINY_NAME
from sdcp.protocol.messages import Constraint, Sampling

pytestmark = pytest.mark.timeout(180)

# Bounded: the tiny random model's text ends within MAX_NEW.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["alpha", "beta"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "size", "ok"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint(kind="json_schema", text=json.dumps(SCHEMA))
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
MAX_NEW = 96


async def decode(target: TargetModel, stop: list[int], drafter_target: str, rule: int) -> RunResult:
    """One constrained session through the engines, drafted by the n-gram drafter configured with
    ``drafter_target`` (the tiny target's tokenizer: guided; SmolLM2's: not the contract's)."""
    system = InProcessSDCPSystem(
        target, stop, drafter_settings=DrafterConfig(target=drafter_target), self_decoding=False
    )
    contract = build_contract(
        target=target.weights_digest,
        tokenizer=target.tokenizer_digest,
        rule=rule,
        max_new=MAX_NEW,
        stop=stop,
        sampling=Sampling(temperature_milli=800, seed=30) if rule == 2 else None,
    )
    await system.start()
    try:
        return await system.generate(PROMPT, MAX_NEW, contract=contract, constraint=CONSTRAINT)
    finally:
        await system.aclose()


@pytest.mark.parametrize("rule", [1, 2])
async def test_a_drafter_that_knows_the_constraint_proposes_what_it_forces(tiny_loaded: LoadedModel, rule: int) -> None:
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    stop = end_of_text_tokens(tiny_loaded.tokenizer)
    guided = await decode(target, stop, TINY_NAME, rule)
    unguided = await decode(target, stop, "smollm2", rule)
    # The n-gram drafter alone repeats the prompt's numbers, which no JSON text allows; guided, its
    # proposals of the keys and punctuation are accepted.
    assert unguided.proposed > 0 and unguided.accepted == 0
    assert guided.proposed > 0 and guided.accepted > 0
    if rule == 1:
        # Under rule 2 the tokens the grammar leaves open are sampled, and a drafted one is accepted
        # with its probability only: how many of them a run proposes varies with what it sampled.
        assert 2 * guided.accepted > guided.proposed
    codec = load_text_codec(TINY_NAME)
    for result in (guided, unguided):
        assert result.tokens[-1] in stop
        jsonschema.validate(json.loads(codec.decode(result.tokens[:-1])), SCHEMA)
    if rule == 1:
        masked = TargetOnlySDCPSystem(target, stop).generate(PROMPT, MAX_NEW, CONSTRAINT)
        assert guided.tokens == unguided.tokens == masked.tokens
