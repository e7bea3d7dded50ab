"""The authorization table (docs/security.md), row by row, over real mTLS servers.

For every endpoint: each identity the row admits succeeds; every other role's certificate, all
issued by the same CA, gets 403 with a problem detail, and the state the endpoint guards is unchanged.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import cbor2
import httpx
import pytest
from tests.waiting import eventually

from sdcp.cache import CommitLog, build_uri
from sdcp.config import DrafterConfig, InstanceConfig, MLCConfig, ServiceConfig, TrustConfig, VerifierConfig
from sdcp.localhost import free_port
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol.codec import MEDIA_TYPE
from sdcp.protocol.messages import (
    Action,
    Assignment,
    Contract,
    Event,
    Policy,
    Proposal,
    Role,
    Sampling,
    SelfDecodeRequest,
    SessionOpen,
    SessionState,
    Status,
    instance_path_id,
    session_path_id,
)
from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.services.authz import TABLE, markdown_table
from sdcp.services.drafter import DrafterNode
from sdcp.services.mlc import MLCNode
from sdcp.services.router import RouterNode
from sdcp.services.verifier import VerifierNode
from sdcp.transport import SDCPClient, client_context, make_certs

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
NAMES = (
    "router",
    "verifier",
    "other_verifier",
    "drafter",
    "other_drafter",
    "owner",
    "other_front_end",
    "operator",
    "stranger",
)
PROMPT = (5, 17, 42, 9, 100, 3)


@dataclass
class World:
    uris: dict[str, str]
    certs: dict[str, tuple[Path, Path]]
    ca: Path
    target: TargetModel
    router: RouterNode
    verifier: VerifierNode
    clients: list[SDCPClient] = field(default_factory=list)

    def client(self, identity: str, peer: str) -> SDCPClient:
        cert, key = self.certs[identity]
        client = SDCPClient(self.uris[peer], cert, key, self.ca)
        self.clients.append(client)
        return client

    def contract(self, *, self_decode: bool = False) -> Contract:
        """A contract that keeps its session open for the test; the router may let the verifier
        decode it alone only if ``self_decode``."""
        allowed = {"self_load": 100, "self_max": 1} if self_decode else {}
        return Contract.from_obj(
            {
                "target": self.target.weights_digest,
                "tokenizer": self.target.tokenizer_digest,
                "rule": 1,
                "m_max": 4,
                "max_new": 64,
                "stop": [],
                "low_rounds": 1000,
                "fallback": [Action.REDUCE, Action.FAIL],
                **allowed,
            }
        )


def config(world_uris: dict[str, str], certs: dict[str, tuple[Path, Path]], ca: Path, name: str) -> ServiceConfig:
    cert, key = certs[name]
    router = None if name == "router" else world_uris["router"]
    return ServiceConfig(
        instance=InstanceConfig(uri=world_uris[name], cert=cert, key=key, ca=ca, router=router, ttl_ms=60_000),
        mlc=MLCConfig(disk_dir=ca.parent.parent / "mlc"),
        verifier=VerifierConfig(model="tiny", output_wait_s=0.1),
        drafter=DrafterConfig(target="tiny"),
        trust=TrustConfig(
            verifiers=(world_uris["verifier"],),
            drafters=(world_uris["drafter"], world_uris["other_drafter"]),
            front_ends=(world_uris["owner"], world_uris["other_front_end"]),
            operators=(world_uris["operator"],),
        ),
    )


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    uris = {name: f"https://127.0.0.1:{free_port()}" for name in NAMES}
    issued = make_certs(tmp_path / "certs", list(uris.values()))
    certs = {name: (issued[uri].cert_path, issued[uri].key_path) for name, uri in uris.items()}
    ca = tmp_path / "certs" / "ca.pem"
    target = TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")
    router = RouterNode(config(uris, certs, ca, "router"))
    verifier = VerifierNode(config(uris, certs, ca, "verifier"), target=target)
    await router.start()
    await verifier.start()
    world = World(uris, certs, ca, target, router, verifier)
    try:
        yield world
    finally:
        for client in world.clients:
            await client.aclose()
        await verifier.stop()
        await router.stop()


async def registered(world: World) -> None:
    """The verifier reports itself (and so becomes a target); the played drafter reports too."""
    await world.verifier.report_status(world.uris["router"])
    status = Status(instance=world.uris["drafter"], role=Role.DRAFTER, load=0, queue=0, ttl_ms=60_000)
    path = f"instances/{instance_path_id(world.uris['drafter'])}/status"
    await world.client("drafter", "router").put_cbor(path, status.to_obj())


async def opened(world: World, *, self_decode: bool = False) -> bytes:
    """A session the owner opened, at the verifier, with the played drafter assigned there."""
    await registered(world)
    request = {"prompt": list(PROMPT), "contract": world.contract(self_decode=self_decode).to_obj()}
    _, body = await world.client("owner", "router").post_cbor("sessions", request)
    assert isinstance(body, dict)
    session = body["session"]
    assert isinstance(session, bytes)
    state = world.verifier.engine.state(session)
    assignment = assignment_for(world, session, state, self_decode=self_decode)
    await world.client("router", "verifier").put_cbor(
        f"sessions/{session_path_id(session)}/drafter", assignment.to_obj()
    )
    return session


def assignment_for(world: World, session: bytes, state: SessionState, *, self_decode: bool = False) -> Assignment:
    return Assignment(
        session=session,
        epoch=state.epoch,
        contract=world.contract(self_decode=self_decode),
        verifier=world.uris["verifier"],
        drafter=world.uris["drafter"],
        prompt=PROMPT,
        round=state.round,
        committed=state.committed,
        digest=state.digest,
        m_init=4,
    )


Call = Callable[[SDCPClient], Awaitable[object]]


async def check_row(
    world: World | Callable[[str], SDCPClient],
    peer: str,
    call: Call,
    admitted: set[str],
    state: Callable[[], object],
    *,
    refusal: ProblemType | None = None,
) -> None:
    """Every identity outside ``admitted`` is refused with 403 and changes nothing; then each admitted
    identity succeeds."""

    def client(identity: str) -> SDCPClient:
        return world.client(identity, peer) if isinstance(world, World) else world(identity)

    for identity in sorted(set(NAMES) - admitted):
        before = state()
        with pytest.raises(ProtocolError) as refused:
            await call(client(identity))
        assert refused.value.status == 403, (identity, refused.value)
        assert refused.value.problem is refusal and refused.value.detail, identity
        assert state() == before, identity
    for identity in sorted(admitted):
        await call(client(identity))


def test_the_table_in_docs_is_the_table_in_the_code() -> None:
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- authorization table:.*?-->\n(.*?)<!-- end of the authorization table -->", text, re.S)
    assert block is not None and block.group(1) == markdown_table()


def test_every_route_of_every_role_is_in_the_table(tmp_path: Path) -> None:
    uris = {name: f"https://127.0.0.1:{1000 + index}" for index, name in enumerate(NAMES)}
    issued = make_certs(tmp_path / "certs", [uris["router"]])
    certs = {name: (issued[uris["router"]].cert_path, issued[uris["router"]].key_path) for name in NAMES}
    ca = tmp_path / "certs" / "ca.pem"
    target = TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")
    nodes = [
        RouterNode(config(uris, certs, ca, "router")),
        VerifierNode(config(uris, certs, ca, "verifier"), target=target),
        DrafterNode(config(uris, certs, ca, "drafter")),
    ]
    mlc = config(uris, certs, ca, "router")
    nodes.append(MLCNode(replace(mlc, instance=replace(mlc.instance, router=None))))
    for node in nodes:
        endpoints = set()
        for route in node.app().routes:
            methods = set(getattr(route, "methods", None) or ())
            # Starlette answers HEAD wherever GET is routed; only a HEAD route of its own counts.
            for method in methods if methods == {"HEAD"} else methods - {"HEAD"}:
                endpoints.add(f"{method} {route.path.lstrip('/')}")
        assert endpoints == set(TABLE[node.role]), node.role
    nodes[1].engine.scorer.close()


# -- the router ---------------------------------------------------------------------------------------


async def test_router_status_reports(world: World) -> None:
    router = world.router
    await registered(world)
    uri = world.uris["verifier"]
    status = replace(world.verifier.engine.status(), load=50)
    path = f"instances/{instance_path_id(uri)}/status"

    def reported() -> object:
        view = router.registry.get(uri)
        return view.status if view is not None else None

    await check_row(world, "router", lambda c: c.put_cbor(path, status.to_obj()), {"verifier"}, reported)
    assert reported() == status
    # Its own path, a trusted drafter, but a verifier's role: a drafter cannot register as a verifier.
    drafter = world.uris["drafter"]
    claim = Status(instance=drafter, role=Role.VERIFIER, load=0, queue=0, ttl_ms=60_000, model=status.model)
    with pytest.raises(ProtocolError) as refused:
        await world.client("drafter", "router").put_cbor(
            f"instances/{instance_path_id(drafter)}/status", claim.to_obj()
        )
    view = router.registry.get(drafter)
    assert refused.value.status == 403 and view is not None and view.status.role == Role.DRAFTER


async def test_router_events(world: World) -> None:
    session = await opened(world)
    state = world.verifier.engine.state(session)
    event = Event(session=session, epoch=1, kind=Action.CONTINUE, committed=state.committed, digest=state.digest)
    tracked = world.router.sessions[session]
    await check_row(
        world, "router", lambda c: c.post_cbor("events", event.to_obj()), {"verifier"}, lambda: tracked.ended
    )
    ending = Event(session=session, epoch=1, kind=Action.FAIL, committed=state.committed, digest=state.digest)
    with pytest.raises(ProtocolError):
        await world.client("drafter", "router").post_cbor("events", ending.to_obj())
    assert not tracked.ended


async def test_router_targets_and_metrics(world: World) -> None:
    await registered(world)
    await check_row(world, "router", lambda c: c.get_cbor("targets"), {"owner", "other_front_end", "operator"}, dict)
    await check_row(world, "router", lambda c: c.get_bytes("metrics"), {"operator"}, dict)


async def test_router_session_requests(world: World) -> None:
    await registered(world)
    request = {"prompt": list(PROMPT), "contract": world.contract().to_obj()}
    await check_row(
        world,
        "router",
        lambda c: c.post_cbor("sessions", request),
        {"owner", "other_front_end"},
        lambda: len(world.router.sessions),
    )


async def test_router_session_lookup_and_policy(world: World) -> None:
    session = await opened(world)
    path = f"sessions/{session_path_id(session)}"
    await check_row(world, "router", lambda c: c.get_cbor(path), {"owner", "operator"}, dict)
    policy = Policy(session=session, from_round=1, sampling=Sampling(temperature_milli=500))
    machine = world.verifier.engine.sessions[session].machine
    await check_row(
        world,
        "router",
        lambda c: c.post_cbor(f"{path}/policy", policy.to_obj()),
        {"owner"},
        lambda: (machine.sampling_for(1), world.router.sessions[session].plan.sampling),
    )


# -- the verifier -------------------------------------------------------------------------------------


async def test_verifier_session_open(world: World) -> None:
    await registered(world)
    session = b"\x07" * 16
    message = SessionOpen(
        session=session, epoch=1, contract=world.contract(), prompt=PROMPT, commit_log="mlc://local/-/log/authz"
    )
    await check_row(
        world,
        "verifier",
        lambda c: c.post_cbor("sessions", message.to_obj()),
        {"router"},
        lambda: session in world.verifier.engine.sessions,
    )


async def opened_at_verifier(world: World) -> bytes:
    """A session the router would let the verifier decode alone, opened at the verifier directly so
    that nothing advances it while the test looks."""
    session = b"\x09" * 16
    contract = world.contract(self_decode=True)
    message = SessionOpen(session=session, epoch=1, contract=contract, prompt=PROMPT, commit_log="mlc://local/-/log/x")
    await world.client("router", "verifier").post_cbor("sessions", message.to_obj())
    assignment = assignment_for(world, session, world.verifier.engine.state(session), self_decode=True)
    path = f"sessions/{session_path_id(session)}/drafter"
    await world.client("router", "verifier").put_cbor(path, assignment.to_obj())
    return session


async def test_verifier_router_messages(world: World) -> None:
    session = await opened_at_verifier(world)
    engine = world.verifier.engine
    path = f"sessions/{session_path_id(session)}"
    machine = engine.sessions[session].machine
    other = assignment_for(world, session, engine.state(session), self_decode=True)
    await check_row(
        world,
        "verifier",
        lambda c: c.put_cbor(f"{path}/drafter", other.to_obj()),
        {"router"},
        lambda: machine.drafter,
    )
    policy = Policy(session=session, from_round=1, sampling=Sampling(temperature_milli=700))
    await check_row(
        world,
        "verifier",
        lambda c: c.post_cbor(f"{path}/policy", policy.to_obj()),
        {"router"},
        lambda: machine.sampling_for(1),
    )
    request = SelfDecodeRequest(session=session, epoch=1)
    await check_row(
        world,
        "verifier",
        lambda c: c.post_cbor(f"{path}/self-decode", request.to_obj()),
        {"router"},
        lambda: (machine.self_decoding, machine.committed),
    )


async def test_verifier_proposals_only_from_the_assigned_drafter(world: World) -> None:
    session = await opened(world)
    engine = world.verifier.engine
    state = engine.state(session)
    proposal = Proposal(
        session=session,
        epoch=1,
        round=state.round + 1,
        drafter=world.uris["drafter"],
        base=state.committed,
        base_digest=state.digest,
        tokens=(1,),
        status=Status(instance=world.uris["drafter"], role=Role.DRAFTER, load=0, queue=0, ttl_ms=60_000),
    )
    await check_row(
        world,
        "verifier",
        lambda c: c.post_cbor("proposals", proposal.to_obj(), idempotent=True),
        {"drafter"},
        lambda: engine.state(session),
        refusal=ProblemType.NOT_ASSIGNED,
    )


async def test_verifier_output_stats_and_metrics(world: World) -> None:
    session = await opened(world)
    path = f"sessions/{session_path_id(session)}"
    await check_row(
        world,
        "verifier",
        lambda c: c.get_cbor(f"{path}/output", {"from": "0"}),
        {"router", "owner", "drafter", "operator"},
        dict,
    )
    await check_row(world, "verifier", lambda c: c.get_cbor(f"{path}/stats"), {"router", "owner", "operator"}, dict)
    await check_row(world, "verifier", lambda c: c.get_cbor(f"{path}/trace"), {"router", "owner", "operator"}, dict)
    await check_row(world, "verifier", lambda c: c.get_bytes("metrics"), {"operator"}, dict)


# -- the drafter --------------------------------------------------------------------------------------


async def test_drafter_assignments_and_metrics(world: World) -> None:
    session = await opened(world)
    drafter = DrafterNode(config(world.uris, world.certs, world.ca, "drafter"))
    await drafter.start()
    try:
        assignment = assignment_for(world, session, world.verifier.engine.state(session))
        await check_row(
            world,
            "drafter",
            lambda c: c.post_cbor("assignments", assignment.to_obj()),
            {"router"},
            lambda: set(drafter.engine.runs),
        )
        await check_row(world, "drafter", lambda c: c.get_bytes("metrics"), {"operator"}, dict)
    finally:
        await drafter.stop()


# -- an MLC node ----------------------------------------------------------------------------------------

MLCFixture = tuple[MLCNode, Callable[[str], SDCPClient]]
OCTETS = {"content-type": "application/octet-stream"}
LOG_READERS = {"router", "verifier", "other_verifier", "operator"}


@pytest.fixture
async def mlc_node(world: World, tmp_path: Path) -> AsyncIterator[MLCFixture]:
    uri = f"https://127.0.0.1:{free_port()}"
    issued = make_certs(world.ca.parent, [uri])[uri]
    u = world.uris
    node = MLCNode(
        ServiceConfig(
            instance=InstanceConfig(uri=uri, cert=issued.cert_path, key=issued.key_path, ca=world.ca),
            mlc=MLCConfig(disk_dir=tmp_path / "mlc-node"),
            trust=TrustConfig(
                routers=(u["router"],),
                verifiers=(u["verifier"], u["other_verifier"]),
                drafters=(u["drafter"], u["other_drafter"]),
                operators=(u["operator"],),
            ),
        )
    )
    await node.start()

    def client(identity: str) -> SDCPClient:
        cert, key = world.certs[identity]
        made = SDCPClient(uri, cert, key, world.ca)
        world.clients.append(made)
        return made

    try:
        yield node, client
    finally:
        await node.stop()


ROWS = build_uri("mlc.test", None, "q-rows", "s-e1-r1")
TOKENS = build_uri("mlc.test", None, "tokens", "s-3")
LOG = build_uri("mlc.test", None, "log", "s")
READERS = {"router", "verifier", "other_verifier", "drafter", "other_drafter", "operator"}
ROLES = {"router", "verifier", "other_verifier", "drafter", "other_drafter"}


async def append_as(client: SDCPClient, log: CommitLog, entry: dict[str, object]) -> object:
    """A conditional append through the MLC node, on the log's current version."""
    etag = (await log.read()).etag
    return await client.post_cbor("logs/append", entry, params={"uri": LOG}, headers={"if-match": etag})


def record(epoch: int, round_: int, writer: str) -> dict[str, object]:
    return {"epoch": epoch, "round": round_, "emitted": [7], "committed": round_, "digest": bytes(32), "writer": writer}


async def test_mlc_objects_by_role_and_kind(
    world: World, mlc_node: tuple[MLCNode, Callable[[str], SDCPClient]]
) -> None:
    node, client = mlc_node
    store = node.mlc

    async def stored(uri: str) -> bytes | None:
        return await store.get(uri) if await store.exists(uri) else None

    contents: dict[str, bytes | None] = {}

    async def snapshot() -> None:
        contents.update({uri: await stored(uri) for uri in (ROWS, TOKENS, LOG)})

    def put(uri: str, data: bytes) -> Call:
        return lambda c: c.put_bytes(
            "objects", data, {"uri": uri}, headers={"content-type": "application/octet-stream"}
        )

    # Draft rows: drafters only. Committed tokens: routers only. Logs: never through objects.
    await check_row(client, "mlc", put(ROWS, b"rows"), {"drafter", "other_drafter"}, lambda: None)
    await check_row(client, "mlc", put(TOKENS, b"tokens"), {"router"}, lambda: None)
    for identity in ROLES:
        with pytest.raises(ProtocolError) as refused:
            await put(LOG, b"forged")(client(identity))
        assert refused.value.status == 403
    assert await stored(LOG) is None
    # Reads: the deployment's roles and operators, not front ends or strangers.
    await check_row(client, "mlc", lambda c: c.get_bytes("objects", {"uri": ROWS}), READERS, lambda: None)
    await check_row(
        client,
        "mlc",
        lambda c: c.get_cbor("logs", {"uri": LOG}),
        {"router", "verifier", "other_verifier", "operator"},
        lambda: None,
    )
    # While the drafter holds a lease on its rows, no other drafter may replace or delete them.
    lease = {"uri": ROWS, "holder": world.uris["drafter"], "ttl_ms": 60_000}
    await client("drafter").post_cbor("leases", lease)
    await snapshot()
    for call in (put(ROWS, b"biased"), lambda c: c.delete("objects", {"uri": ROWS})):
        with pytest.raises(ProtocolError) as refused:
            await call(client("other_drafter"))
        assert refused.value.status == 403
    assert await stored(ROWS) == contents[ROWS] == b"rows"
    await put(ROWS, b"rows again")(client("drafter"))
    assert await stored(ROWS) == b"rows again"
    # Who holds leases: the deployment's roles may ask, nobody else.
    await check_row(client, "mlc", lambda c: c.get_cbor("leases", {"uri": ROWS}), ROLES, lambda: None)
    assert (await client("other_drafter").get_cbor("leases", {"uri": ROWS}))[1] == {"holders": [world.uris["drafter"]]}
    # Leases only in the caller's own name, and only for the deployment's roles.
    for identity in ("owner", "stranger", "operator"):
        own = {"uri": ROWS, "holder": world.uris[identity], "ttl_ms": 1000}
        with pytest.raises(ProtocolError) as refused:
            await client(identity).post_cbor("leases", own)
        assert refused.value.status == 403


async def test_mlc_logs_take_records_only_from_the_verifier_they_name(world: World, mlc_node: MLCFixture) -> None:
    node, client = mlc_node
    log = node.mlc.commit_log(LOG)

    def append(identity: str, entry: dict[str, object]) -> Awaitable[object]:
        return append_as(client(identity), log, entry)

    mine = record(1, 1, world.uris["verifier"])
    # A forged record, in the verifier's name or the forger's own: refused, the log unchanged.
    for identity in sorted(set(NAMES) - {"verifier"}):
        with pytest.raises(ProtocolError) as refused:
            await append(identity, mine)
        assert refused.value.status == 403, identity
        if identity != "other_verifier":
            with pytest.raises(ProtocolError) as forged:
                await append(identity, record(1, 1, world.uris[identity]))
            assert forged.value.status == 403, identity
    assert (await log.read()).records == []
    await append("verifier", mine)
    assert (await log.read()).records == [mine]


async def test_mlc_fences_and_epoch_claims(world: World, mlc_node: MLCFixture) -> None:
    node, client = mlc_node
    log = node.mlc.commit_log(LOG)

    def append(identity: str, entry: dict[str, object]) -> Awaitable[object]:
        return append_as(client(identity), log, entry)

    await append("verifier", record(1, 1, world.uris["verifier"]))
    # Epoch 1 belongs to the verifier that wrote its first record: another trusted verifier cannot
    # extend it, and a drafter cannot fence the session away.
    with pytest.raises(ProtocolError) as claimed:
        await append("other_verifier", record(1, 2, world.uris["other_verifier"]))
    assert claimed.value.status == 403
    await check_row(
        client,
        "mlc",
        lambda c: c.post_cbor("logs/fence", {"epoch": 2}, params={"uri": LOG}),
        {"router"},
        lambda: None,
    )
    # After the router's fence, the new verifier takes epoch 2; the old one is fenced (409).
    await append("other_verifier", record(2, 2, world.uris["other_verifier"]))
    with pytest.raises(ProtocolError) as fenced:
        await append("verifier", record(1, 3, world.uris["verifier"]))
    assert fenced.value.status == 409
    writers = [r["writer"] for r in (await log.read()).records if "writer" in r]
    assert writers == [world.uris["verifier"], world.uris["other_verifier"]]
    # A record without `writer` (another implementation's verifier) is stored naming its caller,
    # and claims the epoch all the same.
    anonymous = {key: value for key, value in record(3, 3, "").items() if key != "writer"}
    await check_row(
        client,
        "mlc",
        lambda c: c.post_cbor("logs/fence", {"epoch": 3}, params={"uri": LOG}),
        {"router"},
        lambda: None,
    )
    await append("verifier", anonymous)
    assert (await log.read()).records[-1] == {**anonymous, "writer": world.uris["verifier"]}
    with pytest.raises(ProtocolError) as taken:
        await append("other_verifier", {**anonymous, "round": 4})
    assert taken.value.status == 403


# -- quotas ---------------------------------------------------------------------------------------------


async def raw_status(
    world: World, identity: str, peer: str, method: str, path: str, body: bytes = b""
) -> tuple[int, str | None]:
    """Status and Retry-After of one request, over HTTP/2 + mTLS with httpx (which shows headers)."""
    cert, key = world.certs[identity]
    context = client_context(cert, key, world.ca)
    async with httpx.AsyncClient(http1=False, http2=True, verify=context, timeout=20) as client:
        response = await client.request(
            method, world.uris[peer] + "/" + path, content=body or None, headers={"content-type": MEDIA_TYPE}
        )
    return response.status_code, response.headers.get("retry-after")


async def test_a_verifier_takes_max_sessions_then_answers_503_with_retry_after(world: World) -> None:
    engine = world.verifier.engine
    engine.settings = replace(engine.settings, max_sessions=1)
    await opened(world)

    def open_message(session: bytes) -> bytes:
        message = SessionOpen(
            session=session, epoch=1, contract=world.contract(), prompt=PROMPT, commit_log="mlc://local/-/log/q"
        )
        return message.to_cbor()

    status, retry_after = await raw_status(world, "router", "verifier", "POST", "sessions", open_message(b"\x0a" * 16))
    assert (status, retry_after) == (503, "5") and b"\x0a" * 16 not in engine.sessions


async def test_output_long_polls_are_limited(world: World) -> None:
    session = await opened(world)
    engine = world.verifier.engine
    engine.settings = replace(engine.settings, max_long_polls=2, output_wait_s=5.0)
    path = f"sessions/{session_path_id(session)}/output"
    state = engine.state(session)
    waiting = [
        asyncio.create_task(world.client("owner", "verifier").get_cbor(path, {"from": str(state.committed)}))
        for _ in range(2)
    ]
    await eventually(lambda: engine._long_polls == 2)
    status, retry_after = await raw_status(world, "owner", "verifier", "GET", f"{path}?from={state.committed}")
    assert (status, retry_after) == (503, "1")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_front_end_holds_at_most_its_quota_of_sessions(world: World) -> None:
    router = world.router
    router.config = replace(router.config, router=replace(router.config.router, max_sessions_per_front_end=1))
    await opened(world)
    request = cbor2.dumps({"prompt": list(PROMPT), "contract": world.contract().to_obj()})
    status, retry_after = await raw_status(world, "owner", "router", "POST", "sessions", request)
    assert (status, retry_after) == (429, "5") and len(router.sessions) == 1
    status, _ = await raw_status(world, "other_front_end", "router", "POST", "sessions", request)
    assert status == 201 and len(router.sessions) == 2


async def test_the_router_caps_the_validity_a_status_claims(world: World) -> None:
    router = world.router
    status = replace(world.verifier.engine.status(), ttl_ms=10**9)
    await world.client("verifier", "router").put_cbor(
        f"instances/{instance_path_id(status.instance)}/status", status.to_obj()
    )
    view = router.registry.get(status.instance)
    assert view is not None and view.expires_at <= router.clock() + router.config.router.max_ttl_ms / 1000


async def test_a_trust_pattern_admits_a_new_instance_by_its_certificate_alone(tmp_path: Path) -> None:
    """docs/deploy.md, "Adding instances": the router trusts ``https://verifier-*.sdcp.test:8443``,
    so a verifier issued a certificate later joins without an edit of the router's file; the * never
    reaches past its DNS label, nor into the port, nor lets another role's name in."""
    router_uri = f"https://127.0.0.1:{free_port()}"
    pattern = "https://verifier-*.sdcp.test:8443"
    joining = "https://verifier-7.sdcp.test:8443"
    outside = (
        "https://verifier-7.evil.sdcp.test:8443",  # * spans one label only
        "https://verifier-7.sdcp.test:8444",
        "https://drafter-0.sdcp.test:8443",
        "https://verifier-.sdcp.test:8443",  # * stands for at least one character
    )
    issued = make_certs(tmp_path / "certs", [router_uri, joining, *outside])
    ca = tmp_path / "certs" / "ca.pem"
    instance = InstanceConfig(
        uri=router_uri, cert=issued[router_uri].cert_path, key=issued[router_uri].key_path, ca=ca, ttl_ms=60_000
    )
    router = RouterNode(ServiceConfig(instance=instance, trust=TrustConfig(verifiers=(pattern,))))
    await router.start()
    clients = []
    try:
        for uri in (*outside, joining):
            client = SDCPClient(router_uri, issued[uri].cert_path, issued[uri].key_path, ca)
            clients.append(client)
            status = Status(instance=uri, role=Role.VERIFIER, load=0, queue=0, ttl_ms=60_000, model=b"\x01" * 32)
            path = f"instances/{instance_path_id(uri)}/status"
            if uri != joining:
                with pytest.raises(ProtocolError) as refused:
                    await client.put_cbor(path, status.to_obj())
                assert refused.value.status == 403 and router.registry.get(uri) is None, uri
            else:
                await client.put_cbor(path, status.to_obj())
                view = router.registry.get(uri)
                assert view is not None and view.status.role == Role.VERIFIER
    finally:
        for client in clients:
            await client.aclose()
        await router.stop()
