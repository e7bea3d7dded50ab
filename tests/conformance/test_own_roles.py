"""The conformance kit against the project's own roles, each started from its CLI (issue #17)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator

import pytest
from tests.conformance.own_roles import PLAYED, OwnRoles

from sdcp.config import InstanceConfig, MLCConfig, ServiceConfig, TrustConfig, VerifierConfig
from sdcp.conformance.report import Report
from sdcp.conformance.verifier import VerifierUnderTest, check_verifier
from sdcp.conformance.wire import Identity
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol import rules
from sdcp.protocol import verifier as verifier_core
from sdcp.services.verifier import VerifierNode

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnRoles]:
    roles = OwnRoles(tmp_path_factory.mktemp("own-roles"))
    roles.issue(["mlc", "verifier", "drafter", "router", *PLAYED])
    trust = (
        "[trust]\n"
        f'routers = ["{roles.uris["kit-router"]}", "{roles.uris["router"]}"]\n'
        f'verifiers = ["{roles.uris["verifier"]}", "{roles.uris["kit-verifier"]}"]\n'
        f'drafters = ["{roles.uris["drafter"]}", "{roles.uris["kit-drafter"]}", "{roles.uris["kit-drafter2"]}"]\n'
        f'front_ends = ["{roles.uris["kit-front-end"]}"]\n'
    )
    mlc_node = f'[mlc]\nmlc_url = "{roles.uris["mlc"]}"\n'
    roles.start("mlc", "mlc", roles.instance("mlc") + f'[mlc]\ndisk_dir = "{roles.tmp / "mlc-store"}"\n' + trust)
    # The kit, playing the router and the drafter, names its objects mlc://conformance-kit/...: the
    # verifier resolves them in its MLC only where configured ([mlc] unlisted is "refuse").
    kit_objects = '[mlc.authorities]\n"conformance-kit" = "own"\n'
    verifier = roles.instance("verifier") + mlc_node + kit_objects + '[verifier]\nmodel = "tiny"\n' + trust
    roles.start("verifier", "verifier", verifier)
    drafter = '[drafter]\nmodel = "ngram"\ntarget = "tiny"\n'
    roles.start("drafter", "drafter", roles.instance("drafter") + mlc_node + drafter + trust)
    roles.start("router", "router", roles.instance("router") + mlc_node + trust)
    try:
        roles.wait_listening(["mlc", "verifier", "drafter", "router"])
        yield roles
    finally:
        roles.stop()


@pytest.fixture(scope="module")
def tiny_digests() -> tuple[str, str, int]:
    target = TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")
    return target.weights_digest.hex(), target.tokenizer_digest.hex(), target.vocab_size


def conformance(roles: OwnRoles, role: str, *args: str) -> str:
    """`sdcp conformance ROLE URL ...` against the project's instance; its output, all checks passed."""
    command = [sys.executable, "-m", "sdcp", "conformance", role, roles.uris[role], "--ca", str(roles.ca), *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=400)
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr + roles.log(role)[-3000:]
    assert "FAIL" not in run.stdout
    return run.stdout


def _digests(digests: tuple[str, str, int], roles: OwnRoles, rows: bool = True) -> list[str]:
    target, tokenizer, vocab = digests
    rule_2 = ["--mlc", roles.uris["mlc"], "--vocab", str(vocab)] if rows else []
    return ["--target", target, "--tokenizer", tokenizer, *rule_2]


def test_the_kit_passes_against_the_projects_verifier(roles: OwnRoles, tiny_digests: tuple[str, str, int]) -> None:
    played = [*roles.played("kit-router", "router"), *roles.played("kit-drafter", "drafter")]
    assert conformance(roles, "verifier", *played, *_digests(tiny_digests, roles)).count("PASS") == 20


def test_the_kit_passes_against_the_projects_drafter(roles: OwnRoles, tiny_digests: tuple[str, str, int]) -> None:
    played = [*roles.played("kit-router", "router"), *roles.played("kit-verifier", "verifier")]
    assert conformance(roles, "drafter", *played, *_digests(tiny_digests, roles)).count("PASS") == 9


def test_the_kit_passes_against_the_projects_router(roles: OwnRoles, tiny_digests: tuple[str, str, int]) -> None:
    played = [
        *roles.played("kit-front-end", "front-end"),
        *roles.played("kit-verifier", "verifier"),
        *roles.played("kit-drafter", "drafter"),
        *roles.played("kit-drafter2", "drafter2"),
    ]
    assert conformance(roles, "router", *played, *_digests(tiny_digests, roles, rows=False)).count("PASS") == 7


def _wrong_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    def little_endian_chain(digest: bytes, tokens: Iterable[int]) -> bytes:
        for token in tokens:
            digest = hashlib.sha256(digest + token.to_bytes(4, "little")).digest()
        return digest

    monkeypatch.setattr(verifier_core, "extend_digest", little_endian_chain)


def _missing_403(monkeypatch: pytest.MonkeyPatch) -> None:
    begin_round = verifier_core.VerifierSession.begin_round
    monkeypatch.setattr(
        verifier_core.VerifierSession,
        "begin_round",
        lambda self, proposal, peer: begin_round(self, proposal, self.drafter),
    )


def _reused_randomness(monkeypatch: pytest.MonkeyPatch) -> None:
    derive = rules.verifier_random
    monkeypatch.setattr(
        rules, "verifier_random", lambda seed, session, round, i, purpose: derive(seed, bytes(16), 1, i, purpose)
    )


@pytest.mark.parametrize(
    ("plant", "caught_by"),
    [
        (_wrong_digest, "a verdict extends the digest chain over exactly the emitted tokens"),
        (_missing_403, "a proposal from anyone but the assigned drafter is refused"),
        (_reused_randomness, "seeded acceptance follows the HMAC randomness, and the residual excludes x"),
    ],
    ids=["wrong digest", "missing 403", "reused randomness"],
)
async def test_the_kit_fails_a_verifier_with_a_planted_bug(
    roles: OwnRoles,
    tiny_digests: tuple[str, str, int],
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[pytest.MonkeyPatch], None],
    caught_by: str,
) -> None:
    target, tokenizer, vocab = tiny_digests
    cert, key = roles.certs["kit-verifier"]
    config = ServiceConfig(
        instance=InstanceConfig(uri=roles.uris["kit-verifier"], cert=cert, key=key, ca=roles.ca),
        mlc=MLCConfig(mlc_url=roles.uris["mlc"], authorities={"conformance-kit": "own"}),
        verifier=VerifierConfig(model="tiny"),
        trust=TrustConfig(routers=(roles.uris["kit-router"],)),
    )
    throwaway = VerifierNode(config, target=TargetModel(tiny_model(), tiny_tokenizer(), name="tiny"))
    plant(monkeypatch)
    await throwaway.start()
    try:
        under_test = VerifierUnderTest(
            url=roles.uris["kit-verifier"],
            ca=roles.ca,
            router=Identity.from_files(*roles.certs["kit-router"]),
            drafter=Identity.from_files(*roles.certs["kit-drafter"]),
            target=bytes.fromhex(target),
            tokenizer=bytes.fromhex(tokenizer),
            mlc=roles.uris["mlc"],
            vocab=vocab,
        )
        report = await check_verifier(under_test, Report())
    finally:
        await throwaway.stop()
    assert caught_by in report.failed(), [result.line() for result in report.results]
    assert not report.passed
