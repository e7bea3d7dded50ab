"""The in-process systems of the benchmark: transformers greedy, transformers speculative, SDCP core.

Every system decodes greedily with the same model, prompt, max_new and stop tokens and returns a
``RunResult``. The SDCP in-process system wires the protocol core (``VerifierSession``,
``DrafterSession``, the rules) to the backends (``TargetModel``, ``NgramDrafter``) without network,
under the contract the front ends use (``build_contract``), so that its gap to the end-to-end
system is what transport, serialisation, the MLC and the processes cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sdcp.client import build_contract
from sdcp.config import RouterConfig
from sdcp.models.draft import NgramDrafter
from sdcp.models.target import TargetModel
from sdcp.protocol import codec
from sdcp.protocol.drafter import DrafterSession
from sdcp.protocol.messages import Action, Assignment, Contract, Role, Status
from sdcp.protocol.verifier import RoundTicket, VerifierSession

__all__ = [
    "HF_PROMPT_LOOKUP_TOKENS",
    "HFAssistedSystem",
    "HFPromptLookupSystem",
    "HFTargetSystem",
    "InProcessSDCPSystem",
    "RunResult",
    "TargetOnlySDCPSystem",
]

# transformers' documented example value for prompt lookup decoding.
HF_PROMPT_LOOKUP_TOKENS = 10
_VERIFIER_URI = "inprocess://verifier"
_DRAFTER_URI = "inprocess://drafter-ngram"


@dataclass
class RunResult:
    """One generation: tokens, wall time and, for SDCP systems, what its rounds did."""

    tokens: list[int]
    seconds: float
    rounds: int = 0
    self_decoded: int = 0
    accepted: int = 0
    proposed: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)
    # Per round after the first: wall time minus the model's time (ms).
    overhead_ms: list[float] = field(default_factory=list)
    # Per token after the first: time since the previous token arrived (ms).
    inter_token_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    # Who drafted for the session, in order (cluster systems): instance names, or "self-decoding".
    served: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


class _HFGenerateSystem:
    """transformers ``generate`` with greedy decoding; subclasses add the speculative options."""

    name = "hf_target"

    def __init__(self, model: Any, stop: Sequence[int]) -> None:
        self.model = model
        self.stop = list(stop)

    def options(self) -> dict[str, Any]:
        return {}

    def generate(self, prompt: Sequence[int], max_new: int) -> RunResult:
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=max_new,
                eos_token_id=self.stop or None,
                pad_token_id=self.stop[0] if self.stop else 0,
                **self.options(),
            )
        seconds = time.perf_counter() - started
        return RunResult(tokens=[int(t) for t in output[0, input_ids.shape[1] :]], seconds=seconds)


class HFTargetSystem(_HFGenerateSystem):
    """System 1: target-only greedy decoding."""

    name = "hf_target"


class HFPromptLookupSystem(_HFGenerateSystem):
    """System 2: transformers prompt lookup decoding (the in-process n-gram drafter)."""

    name = "hf_prompt_lookup"

    def options(self) -> dict[str, Any]:
        return {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS}


class HFAssistedSystem(_HFGenerateSystem):
    """System 2b: transformers assisted generation with a draft model."""

    name = "hf_assisted"

    def __init__(self, model: Any, stop: Sequence[int], assistant: Any) -> None:
        super().__init__(model, stop)
        self.assistant = assistant

    def options(self) -> dict[str, Any]:
        return {"assistant_model": self.assistant}


class TargetOnlySDCPSystem:
    """SDCP's target backend decoding one token per pass: no drafts, no protocol.

    Its gap to ``hf_target`` is what the backend itself gains (sdcp.models.packed); the gap between
    it and the speculative systems is what speculation gains on top.
    """

    name = "sdcp_target_only"

    def __init__(self, target: TargetModel, stop: Sequence[int]) -> None:
        self.target = target
        self.stop = set(stop)
        self._sessions = 0

    def generate(self, prompt: Sequence[int], max_new: int) -> RunResult:
        self._sessions += 1
        session = (1 << 64 | self._sessions).to_bytes(16, "big")
        tokens: list[int] = []
        started = time.perf_counter()
        self.target.open_session(session, list(prompt))
        try:
            while len(tokens) < max_new and not (tokens and tokens[-1] in self.stop):
                (row,) = self.target.score([(session, ())])
                token = int(row[0].argmax())
                self.target.commit(session, 0, [token])
                tokens.append(token)
        finally:
            self.target.close_session(session)
        return RunResult(tokens=tokens, seconds=time.perf_counter() - started)


class InProcessSDCPSystem:
    """System 3: SDCP's protocol core and backends in one thread, no network, no MLC."""

    name = "sdcp_inprocess"

    def __init__(self, target: TargetModel, stop: Sequence[int]) -> None:
        self.target = target
        self.stop = list(stop)
        self.drafter = NgramDrafter(target.vocab_size)
        self.m_init = RouterConfig().m_init
        self._sessions = 0
        self._status = Status(instance=_DRAFTER_URI, role=Role.DRAFTER, load=0, queue=0, ttl_ms=3000)

    def contract(self, max_new: int) -> Contract:
        return build_contract(
            target=self.target.weights_digest,
            tokenizer=self.target.tokenizer_digest,
            max_new=max_new,
            stop=self.stop,
        )

    def generate(self, prompt: Sequence[int], max_new: int) -> RunResult:
        self._sessions += 1
        session = self._sessions.to_bytes(16, "big")
        contract = self.contract(max_new)
        prompt_tokens = tuple(prompt)
        started = time.perf_counter()
        verifier = VerifierSession(session=session, epoch=1, contract=contract, prompt=prompt_tokens)
        self.target.open_session(session, prompt_tokens)
        self.drafter.open_session(session, prompt_tokens)
        result = RunResult(tokens=[], seconds=0.0)
        try:
            drafter = self._assign(verifier, contract, prompt_tokens)
            verify_s = 0.05
            round_started = time.perf_counter()
            while not verifier.ended:
                if verifier.self_decoding:
                    model_s = self._self_decode_round(verifier)
                    if not verifier.self_decoding and not verifier.ended:
                        # The verifier's event makes the router assign a drafter again (SDCP 6.5.2).
                        drafter = self._assign(verifier, contract, prompt_tokens)
                else:
                    model_s, action = self._proposal_round(verifier, drafter, verify_s)
                    verify_s = 0.75 * verify_s + 0.25 * model_s
                    if action == Action.SWITCH:
                        drafter = self._assign(verifier, contract, prompt_tokens)
                now = time.perf_counter()
                if verifier.round > 1:
                    result.overhead_ms.append(1000 * (now - round_started - model_s))
                round_started = now
        finally:
            self.target.close_session(session)
            self.drafter.close_session(session)
        result.seconds = time.perf_counter() - started
        result.tokens = list(verifier.tokens)
        stats = verifier.stats
        result.rounds, result.self_decoded = stats.rounds, stats.self_decoded
        result.accepted, result.proposed = stats.accepted, stats.proposed
        result.accepted_by_position = list(stats.accepted_by_position)
        result.proposed_by_position = list(stats.proposed_by_position)
        return result

    def _assign(self, verifier: VerifierSession, contract: Contract, prompt: tuple[int, ...]) -> DrafterSession:
        assignment = Assignment(
            session=verifier.session,
            epoch=verifier.epoch,
            contract=contract,
            verifier=_VERIFIER_URI,
            drafter=_DRAFTER_URI,
            prompt=prompt,
            round=verifier.round,
            committed=verifier.committed,
            digest=verifier.digest,
            m_init=self.m_init,
        )
        verifier.assign(assignment)
        self.drafter.sync(verifier.session, [*prompt, *verifier.tokens])
        return DrafterSession(assignment)

    def _proposal_round(
        self, verifier: VerifierSession, drafter: DrafterSession, verify_s: float
    ) -> tuple[float, Action]:
        session = verifier.session
        m = drafter.choose_m(self.drafter.seconds_per_token, verify_s)
        draft = self.drafter.draft(session, m, drafter.sampling)
        proposal = drafter.propose(draft.tokens, status=self._status)
        ticket = verifier.begin_round(proposal, _DRAFTER_URI)
        if not isinstance(ticket, RoundTicket):
            raise RuntimeError(f"the in-process verifier did not admit round {proposal.round}: {ticket}")
        model_started = time.perf_counter()
        (logits,) = self.target.score([(session, proposal.tokens)])
        model_s = time.perf_counter() - model_started
        pending = verifier.decide(ticket, logits, None, 0)
        codec.encode(pending.record.to_obj())
        self.target.commit(session, pending.verdict.accepted, pending.record.emitted)
        verdict = verifier.apply(pending)
        action = drafter.apply_verdict(verdict)
        self.drafter.sync(session, [*verifier.prompt, *verifier.tokens])
        return model_s, action

    def _self_decode_round(self, verifier: VerifierSession) -> float:
        session = verifier.session
        ticket = verifier.begin_self_decode()
        model_started = time.perf_counter()
        (logits,) = self.target.score([(session, ())])
        model_s = time.perf_counter() - model_started
        pending = verifier.decide_self_decode(ticket, logits, 0)
        codec.encode(pending.record.to_obj())
        self.target.commit(session, 0, pending.record.emitted)
        verifier.apply(pending)
        return model_s
