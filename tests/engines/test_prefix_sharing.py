"""Prefix KV shared through the MLC (issue #37; sdcp.engines.verifier.prefixshare): a prefix one
verifier computed starts another verifier's prefill, only the tenant's own, and a forged object
(untrusted writer, another CA, a tampered blob, other tokens) is refused and never changes a row."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from tests.waiting import eventually, eventually_async

from sdcp.cache import MLC, ObjectNotFound, build_uri
from sdcp.cache.prefix import SHARE_TOKENS
from sdcp.cache.uri import LOG_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.verifier import VerifierEngine, prefixshare
from sdcp.engines.verifier.prefixshare import prefix_object_uri
from sdcp.frontend.client import build_contract
from sdcp.home import sdcp_home
from sdcp.models.llamacpp.target import LlamaCppTarget
from sdcp.models.registry import load_target, load_tokenizer
from sdcp.models.weights.fetch import FetchResult, fetch_smollm2
from sdcp.protocol import codec
from sdcp.protocol.messages import CancelRequest, SelfDecodeRequest, SessionOpen
from sdcp.transport.certs import CA_CERT_FILE, make_certs
from sdcp.transport.signing import RecordCheck, RecordSigner

pytestmark = pytest.mark.timeout(600)

AUTHORITY = "mlc.test"
V1, V2, OUTSIDER = "https://verifier1.test", "https://verifier2.test", "https://outsider.test"
CAPACITY = 1024


def llama_target(cache_bytes: int) -> LlamaCppTarget:
    target = load_target(
        "smollm2", backend="llamacpp", kv_slots=2, kv_capacity=CAPACITY, threads=2, prefix_cache_bytes=cache_bytes
    )
    assert isinstance(target, LlamaCppTarget)
    return target


@pytest.fixture(scope="module")
def smollm2() -> FetchResult:
    return fetch_smollm2(sdcp_home())


@pytest.fixture(scope="module")
def cold(smollm2: FetchResult) -> LlamaCppTarget:
    return llama_target(0)


@pytest.fixture(scope="module")
def text(smollm2: FetchResult) -> list[int]:
    tokenizer = load_tokenizer("smollm2")
    words = " ".join(f"Tool {n} books room {n * 7} and reports the fare in euros." for n in range(90))
    tokens = list(tokenizer(words)["input_ids"])
    assert len(tokens) > 3 * SHARE_TOKENS
    return tokens


class Signers:
    def __init__(self, directory: Path, other: Path) -> None:
        issued = make_certs(directory, [V1, V2, OUTSIDER])
        self.check = RecordCheck.load(directory / CA_CERT_FILE)
        self.by_uri = {uri: RecordSigner.load(cert.cert_path, cert.key_path) for uri, cert in issued.items()}
        foreign = make_certs(other, [V1])[V1]
        # V1's name on a certificate of another CA.
        self.foreign = RecordSigner.load(foreign.cert_path, foreign.key_path)


@pytest.fixture
async def engines(tmp_path: Path, smollm2: FetchResult) -> AsyncIterator[tuple[MLC, Signers, list[VerifierEngine]]]:
    signers = Signers(tmp_path / "ca", tmp_path / "other-ca")
    mlc = MLC.from_config(authority=AUTHORITY)
    made = [
        VerifierEngine(
            uri=uri,
            settings=VerifierConfig(),
            target=llama_target(256 << 20),
            mlc=mlc,
            ttl_ms=1000,
            sign=signers.by_uri[uri].sign,
            record_check=signers.check,
            trusted_verifier=lambda peer: peer in (V1, V2),
        )
        for uri in (V1, V2)
    ]
    for engine in made:
        await engine.start()
    yield mlc, signers, made
    for engine in made:
        await engine.stop()
    await mlc.close()


def open_message(engine: VerifierEngine, session: bytes, prompt: list[int], tenant: str | None) -> SessionOpen:
    contract = build_contract(
        target=engine.target.weights_digest, tokenizer=engine.target.tokenizer_digest, max_new=8, stop=[]
    )
    log = build_uri(AUTHORITY, None, LOG_KIND, session.hex())
    return SessionOpen(session=session, epoch=1, contract=contract, prompt=tuple(prompt), commit_log=log, tenant=tenant)


def first_row(target: LlamaCppTarget, session: bytes) -> np.ndarray:
    (rows,) = target.score([(session, ())])
    return rows[0].copy()


def cold_row(cold: LlamaCppTarget, prompt: list[int]) -> np.ndarray:
    cold.open_session(b"cold", prompt)
    try:
        return first_row(cold, b"cold")
    finally:
        cold.close_session(b"cold")


async def published(mlc: MLC, name: bytes) -> None:
    """Wait until the prefix object of that name is in the MLC (the verifier writes it in a task)."""

    async def there() -> bool:
        try:
            await mlc.get(prefix_object_uri(AUTHORITY, name))
        except ObjectNotFound:
            return False
        return True

    await eventually_async(there)


def hits(engine: VerifierEngine) -> int:
    prefixes = engine.target.prefixes
    assert prefixes is not None
    return prefixes.hits


async def cancel(engine: VerifierEngine, session: bytes) -> None:
    """End the session: a prefix object is made once no session runs."""
    await engine.cancel(CancelRequest(session=session, epoch=1))


async def test_a_prefix_one_verifier_computed_starts_anothers_prefill_for_the_same_tenant_only(
    engines: tuple[MLC, Signers, list[VerifierEngine]],
    cold: LlamaCppTarget,
    text: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mlc, _, (first, second) = engines
    # The object is made once no session runs (PUBLISH_WAIT_S at the latest, longer than the test):
    # not while the session that computed it runs, whose first passes keep the cores.
    monkeypatch.setattr(prefixshare, "PUBLISH_WAIT_S", 3600.0)
    shared = text[: 2 * SHARE_TOKENS + 40]
    await first.open_session(open_message(first, b"s" * 16, [*shared, *text[-30:]], "tenant-a"))
    prefixes = first.target.prefixes
    assert prefixes is not None
    name = prefixes.hashes(shared, b"tenant-a")[2 * SHARE_TOKENS // prefixes.block - 1]
    sharing = first._prefix_sharing
    await eventually(lambda: sharing.waiting == 1)
    with pytest.raises(ObjectNotFound):
        await mlc.get(prefix_object_uri(AUTHORITY, name))

    await cancel(first, b"s" * 16)
    await published(mlc, name)
    assert sharing.waiting == 0
    # Another tenant's prompt with the same prefix computes it all.
    other_tenant = [*shared, *text[-60:-40]]
    await second.open_session(open_message(second, b"b" * 16, other_tenant, "tenant-b"))
    assert hits(second) == 0
    assert np.array_equal(first_row(second.target, b"b" * 16), cold_row(cold, other_tenant))
    # The same tenant's starts from the first verifier's KV of the shared prefix.
    same_tenant = [*shared, *text[-20:]]
    await second.open_session(open_message(second, b"a" * 16, same_tenant, "tenant-a"))
    assert hits(second) >= 2 * SHARE_TOKENS
    assert np.array_equal(first_row(second.target, b"a" * 16), cold_row(cold, same_tenant))


@pytest.mark.parametrize("forgery", ["untrusted writer", "another CA", "tampered blob", "other tokens"])
async def test_a_forged_prefix_object_is_refused_and_changes_no_row(
    engines: tuple[MLC, Signers, list[VerifierEngine]], cold: LlamaCppTarget, text: list[int], forgery: str
) -> None:
    mlc, signers, (first, second) = engines
    prompt = [*text[: SHARE_TOKENS + 30], *text[-12:]]
    # A real object of the first verifier over other tokens: the material of the forgeries.
    donor = [*text[SHARE_TOKENS : 2 * SHARE_TOKENS + 30], 42]
    await first.open_session(open_message(first, b"d" * 16, donor, None))
    donor_prefixes = first.target.prefixes
    assert donor_prefixes is not None
    donor_name = donor_prefixes.hashes(donor[:-1])[SHARE_TOKENS // donor_prefixes.block - 1]

    await cancel(first, b"d" * 16)
    await published(mlc, donor_name)
    genuine = codec.decode(await mlc.get(prefix_object_uri(AUTHORITY, donor_name)), max_size=1 << 30)
    assert isinstance(genuine, dict)
    body = {key: value for key, value in genuine.items() if key not in ("sig", "cert")}
    # Forgeries under the name the second verifier reads for the prompt, each claiming its tokens.
    claimed = {**body, "tokens": prompt[: SHARE_TOKENS + 16]}
    if forgery == "untrusted writer":
        forged = signers.by_uri[OUTSIDER].sign({**claimed, "writer": OUTSIDER}, True)
    elif forgery == "another CA":
        forged = signers.foreign.sign({**claimed, "writer": V1}, True)
    elif forgery == "tampered blob":
        forged = {**signers.by_uri[V1].sign(claimed, True), "kv": bytes(len(body["kv"]))}
    else:
        forged = signers.by_uri[V1].sign(body, True)
    prefixes = second.target.prefixes
    assert prefixes is not None
    name = prefixes.hashes(prompt[:-1])[SHARE_TOKENS // prefixes.block - 1]
    await mlc.put(prefix_object_uri(AUTHORITY, name), codec.encode(forged))
    await second.open_session(open_message(second, b"v" * 16, prompt, None))
    assert hits(second) == 0
    assert np.array_equal(first_row(second.target, b"v" * 16), cold_row(cold, prompt))


async def test_a_prompt_shared_as_a_prefix_is_not_published_again_as_the_sessions_kv(
    engines: tuple[MLC, Signers, list[VerifierEngine]], text: list[int]
) -> None:
    """A session's target KV is published for a failover past the tokens that its prompt's prefix
    objects cover (a failover's prefill fetches them): a verifier that shares prefixes publishes
    none for 8 tokens after a prompt of 2 x SHARE_TOKENS + 40 under a threshold of 100, where one
    that shares none publishes at its first commits."""
    mlc, _, (sharing, _) = engines
    settings = VerifierConfig(kv_publish_min_tokens=100, kv_publish_every=0)
    sharing.settings = settings
    alone = VerifierEngine(uri=V2, settings=settings, target=llama_target(256 << 20), mlc=mlc, ttl_ms=1000)
    await alone.start()
    prompt = text[: 2 * SHARE_TOKENS + 40]
    try:
        for engine, session in ((sharing, b"p" * 16), (alone, b"q" * 16)):
            await engine.open_session(open_message(engine, session, prompt, None))
            await engine.self_decode(SelfDecodeRequest(session=session, epoch=1))
            machine = engine.sessions[session].machine
            await eventually(lambda machine=machine: machine.ended)
        assert sharing.sessions[b"p" * 16].machine.committed == 8
        assert sharing.sessions[b"p" * 16].kv_tried_at == 0
        assert len(prompt) < alone.sessions[b"q" * 16].kv_tried_at <= len(prompt) + 8
    finally:
        await alone.stop()
