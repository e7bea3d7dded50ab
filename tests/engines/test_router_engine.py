"""The router engine without sockets: its sessions in the shared tier, so that a restarted router or
a second one fails over a session it did not open (docs/reliability.md, "Routers").

Real verifier and drafter engines (the tiny random target, the n-gram drafter) over one host-memory
MLC, joined to the routers by the bench's in-memory links; the routers' clock is the test's, so an
instance "fails" when the test stops reporting its status and moves the clock past its TTL. Rule 1's
output must be the target's greedy decoding, whichever router moved the session where.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import pytest
from tests.waiting import eventually, eventually_async

from sdcp.bench.inprocess import InMemoryRouterLink, InMemoryVerifierLink
from sdcp.cache import MLC, ObjectInfo, StoreUnavailable
from sdcp.cache.prefix import SHARE_TOKENS, shared_hashes, tenant_scope
from sdcp.config import DrafterConfig, RouterConfig, VerifierConfig
from sdcp.engines.drafter import DrafterEngine
from sdcp.engines.errors import SessionNotFound, Unanswered, Unavailable
from sdcp.engines.router import RouterEngine, TrackedSession
from sdcp.engines.router.store import MAX_STATE_BYTES
from sdcp.engines.verifier import VerifierEngine
from sdcp.models.hf.target import TargetModel
from sdcp.models.lookup.ngram import NgramDrafter
from sdcp.models.registry import LoadedModel
from sdcp.protocol import codec
from sdcp.protocol.messages import (
    Action,
    Contract,
    Event,
    Output,
    Policy,
    Proposal,
    Sampling,
    SelfDecodeRequest,
    SessionOpen,
    SessionRequest,
    SessionState,
    Verdict,
)
from sdcp.protocol.problems import BadMessage
from sdcp.protocol.records import replay_commit_log
from sdcp.protocol.router import OPEN_MS_PER_PROMPT_TOKEN, RouterSession, open_deadline_s
from sdcp.protocol.router_life import RouterPhase
from sdcp.protocol.rules import GREEDY

pytestmark = pytest.mark.timeout(120)

ROUTER_A, ROUTER_B = "https://router-a.test", "https://router-b.test"
V1, V2, DRAFTER = "https://verifier1.test", "https://verifier2.test", "https://drafter.test"
FRONT_END = "https://frontend.test"
PROMPT = (5, 17, 42, 9, 100, 3)
MAX_NEW = 120
TTL_MS = 1000


class ByVerifier:
    """The drafter's way to whichever verifier an assignment names (a ``VerifierLink``); a verifier
    in ``cut`` answers nothing, after the time a request takes to time out here."""

    def __init__(self, links: dict[str, InMemoryVerifierLink], cut: set[str]) -> None:
        self._links = links
        self._cut = cut

    async def propose(self, verifier: str, proposal: Proposal) -> Verdict:
        await self._reach(verifier)
        return await self._links[verifier].propose(verifier, proposal)

    async def output(self, verifier: str, session: bytes, start: int) -> Output:
        await self._reach(verifier)
        return await self._links[verifier].output(verifier, session, start)

    async def _reach(self, verifier: str) -> None:
        if verifier in self._cut:
            await asyncio.sleep(0.05)
            raise Unanswered(f"{verifier} is cut off")


@dataclass
class World:
    mlc: MLC
    verifiers: dict[str, VerifierEngine]
    drafter: DrafterEngine
    contract: Contract
    # The verifiers whose links are cut: they report nothing, and nothing reaches them or leaves them.
    cut: set[str]
    now: list[float] = field(default_factory=lambda: [0.0])
    routers: list[RouterEngine] = field(default_factory=list)
    # Where the verifiers' events go: the router a verifier can reach.
    events_to: list[RouterEngine] = field(default_factory=list)

    def router(self, uri: str, **settings: int) -> RouterEngine:
        router = RouterEngine(
            uri=uri,
            settings=lambda: RouterConfig(m_init=4, **settings),
            mlc=self.mlc,
            link=InMemoryRouterLink(self.verifiers, {DRAFTER: self.drafter}),
            record_check=None,
            # The periodic task runs when the test calls maintain() (and once at the start).
            interval_s=3600.0,
            grace_s=TTL_MS / 1000,
            clock=lambda: self.now[0],
        )
        self.routers.append(router)
        return router

    def report(self, *, quiet: tuple[str, ...] = (), to: tuple[RouterEngine, ...] | None = None) -> None:
        """Every instance neither cut nor ``quiet`` reports its status to every router (``to``)."""
        for router in self.routers if to is None else to:
            for uri, verifier in self.verifiers.items():
                if uri not in self.cut and uri not in quiet:
                    router.report(verifier.status())
            router.report(self.drafter.status())

    def advance(self, seconds: float, *, to: tuple[RouterEngine, ...] | None = None) -> None:
        """The clock moves on; the instances report (to ``to``, else every router). A report after
        an expiry wakes the router's periodic task, which then runs beside the test's own passes."""
        self.now[0] += seconds
        self.report(to=to)

    def sink(self, verifier: str) -> Callable[[Event], Awaitable[None]]:
        """Where ``verifier``'s events go: the router it can reach."""

        async def send(event: Event) -> None:
            if verifier in self.cut:
                raise Unanswered(f"{verifier} is cut off")
            router = self.events_to[-1]
            await router.event(await router.contact(event.session), event)

        return send


@pytest.fixture
async def world(tiny_loaded: LoadedModel) -> AsyncIterator[World]:
    mlc = MLC.from_config(authority="routers.test")
    holder: list[World] = []
    cut: set[str] = set()

    def sink(verifier: str) -> Callable[[Event], Awaitable[None]]:
        async def send(event: Event) -> None:
            await holder[0].sink(verifier)(event)

        return send

    verifiers = {
        uri: VerifierEngine(
            uri=uri,
            settings=VerifierConfig(),
            target=TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny"),
            mlc=mlc,
            ttl_ms=TTL_MS,
            events=sink(uri),
        )
        for uri in (V1, V2)
    }
    links = {uri: InMemoryVerifierLink(engine, DRAFTER) for uri, engine in verifiers.items()}
    vocab = next(iter(verifiers.values())).target.vocab_size
    drafter = DrafterEngine(
        uri=DRAFTER,
        settings=DrafterConfig(),
        drafter=NgramDrafter(vocab),
        mlc=mlc,
        link=ByVerifier(links, cut),
        ttl_ms=TTL_MS,
    )
    target = verifiers[V1].target
    contract = Contract.from_obj(
        {
            "target": target.weights_digest,
            "tokenizer": target.tokenizer_digest,
            "rule": GREEDY.id,
            "m_max": 4,
            "max_new": MAX_NEW,
            "stop": [],
            # The drafter drives every round: rejections never escalate.
            "low_rounds": 1_000_000,
            "fallback": [int(Action.REDUCE), int(Action.FAIL)],
        }
    )
    world = World(mlc, verifiers, drafter, contract, cut)
    holder.append(world)
    for verifier in verifiers.values():
        await verifier.start()
    await drafter.start()
    yield world
    for router in world.routers:
        await router.stop()
    await drafter.stop()
    for engine in verifiers.values():
        await engine.stop()
    await mlc.close()


def greedy(loaded: LoadedModel, count: int) -> tuple[int, ...]:
    """The tiny target's greedy continuation of PROMPT, one token per pass (SDCP 6.4 rule 1)."""
    target = TargetModel(loaded.model, loaded.tokenizer, name="tiny")
    session = bytes(16)
    target.open_session(session, PROMPT)
    tokens: list[int] = []
    for _ in range(count):
        (rows,) = target.score([(session, ())])
        tokens.append(int(rows[0].argmax()))
        target.commit(session, 0, tokens[-1:])
    return tuple(tokens)


async def committed(world: World, tracked: TrackedSession) -> tuple[int, ...]:
    """The session's committed output, as its commit log holds it."""
    records = (await world.mlc.commit_log(tracked.plan.commit_log).read()).records
    return replay_commit_log(records, tracked.plan.contract.digest, PROMPT).tokens


async def open_on_v1(world: World, router: RouterEngine) -> TrackedSession:
    """A session opened at V1 (V2 reports later), driven by the drafter, with tokens committed;
    then V1 is cut off mid-session, the session left unfinished there."""
    world.report(quiet=(V2,))
    tracked = await router.open_session(FRONT_END, SessionRequest(prompt=PROMPT, contract=world.contract))
    assert tracked.plan.verifier == V1 and tracked.plan.drafter == DRAFTER
    machine = world.verifiers[V1].sessions[tracked.session].machine
    await eventually(lambda: machine.committed >= 10)
    world.cut.add(V1)
    assert not machine.ended
    world.report()
    return tracked


async def test_a_restarted_router_loads_the_session_and_fails_it_over(world: World, tiny_loaded: LoadedModel) -> None:
    """Router kill -9 and restart, then the verifier cut: the restarted router (same identity, empty
    memory) loads the session on the front end's first question and moves it to V2."""
    before = world.router(ROUTER_A)
    await before.start()
    world.events_to.append(before)
    tracked = await open_on_v1(world, before)
    session = tracked.session
    await before.stop()  # killed: its memory is gone, the shared tier keeps the session
    after = world.router(ROUTER_A)
    world.routers.remove(before)
    await after.start()
    world.events_to.append(after)
    # V1 reports no more: the restarted router waits out its grace for it, then fails it over.
    world.advance(2 * TTL_MS / 1000)
    loaded = await after.contact(session)  # GET sessions/{id} from the front end
    assert loaded.plan.epoch == 1 and loaded.plan.verifier == V1 and loaded.plan.drafter == DRAFTER
    await after.maintain()
    await eventually(lambda: loaded.plan.epoch == 2)
    assert loaded.plan.verifier == V2
    resumed = world.verifiers[V2].sessions[session].machine
    await eventually(lambda: resumed.ended)
    assert await committed(world, loaded) == greedy(tiny_loaded, MAX_NEW)
    # Ended: the session's facts have left the shared tier.
    await eventually(lambda: loaded.ended)
    assert await after.store.load(session) is None


async def test_the_session_of_a_router_that_is_gone_is_taken_over_by_another(
    world: World, tiny_loaded: LoadedModel
) -> None:
    """Two routers: the verifier's event reaches B (A is unreachable), B takes the session over, and
    A, which still holds it in memory, lets it go at its next change instead of undoing B's."""
    a, b = world.router(ROUTER_A), world.router(ROUTER_B)
    for router in (a, b):
        await router.start()
    world.events_to.append(a)
    tracked = await open_on_v1(world, a)
    session = tracked.session
    taken = await b.contact(session)
    assert taken.router == ROUTER_A and session in b.sessions
    world.events_to.append(b)
    # A hears from nobody now (its periodic task sleeps): the test runs its only pass below.
    world.advance(2 * TTL_MS / 1000, to=(b,))
    await b.maintain()  # B fails the session over: its claim is on the version it read
    await eventually(lambda: taken.plan.epoch == 2)
    assert taken.plan.verifier == V2
    stored = await b.store.load(session)
    assert stored is not None and stored.router == ROUTER_B and stored.plan.epoch == 2
    await a.maintain()  # A's claim is on the version before B's: A lets the session go
    assert session not in a.sessions
    assert world.verifiers[V2].sessions[session].machine.epoch == 2
    resumed = world.verifiers[V2].sessions[session].machine
    await eventually(lambda: resumed.ended)
    assert await committed(world, taken) == greedy(tiny_loaded, MAX_NEW)
    await eventually(lambda: taken.ended)
    assert await b.store.load(session) is None


async def test_a_session_that_ends_while_its_facts_are_written_stays_answerable(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session ends (its verifier's finish event deletes its facts from the shared tier) while
    the router writes the drafter its open assigned: that write fails on the deleted version, and
    the router keeps the ended session, which it ended itself, for the front end's next question."""
    router = world.router(ROUTER_A)
    await router.start()
    world.events_to.append(router)
    world.report(quiet=(V2,))
    put = world.mlc.put

    async def put_after_the_end(uri: str, data: bytes, *, if_match: str | None = None) -> ObjectInfo:
        facts = codec.decode(data)
        if isinstance(facts, dict) and "drafter" in facts:
            session = SessionOpen.from_obj(facts["open"]).session
            tracked = router.sessions[session]
            await eventually(lambda: tracked.ended)
            await eventually_async(lambda: _gone(router, session))
        return await put(uri, data, if_match=if_match)

    monkeypatch.setattr(world.mlc, "put", put_after_the_end)
    tracked = await router.open_session(FRONT_END, SessionRequest(prompt=PROMPT, contract=world.contract))
    assert tracked.ended
    assert await router.contact(tracked.session) is tracked
    assert await router.store.load(tracked.session) is None


async def _gone(router: RouterEngine, session: bytes) -> bool:
    return await router.store.load(session) is None


async def test_a_router_holds_what_its_limits_allow(world: World) -> None:
    a = world.router(ROUTER_A)
    b = world.router(ROUTER_B, max_sessions=1)
    for router in (a, b):
        await router.start()
    world.events_to.append(a)
    world.report(quiet=(V2,))
    request = SessionRequest(prompt=PROMPT, contract=world.contract)
    first, second = [await a.open_session(FRONT_END, request) for _ in range(2)]
    at_b = await b.contact(first.session)
    # B changes the session (a policy, SDCP 6.6); A, asked about it next, takes B's facts over.
    policy = Policy(session=first.session, from_round=1_000_000, sampling=Sampling.from_obj({"top_k": 5}))
    await b.change_policy(at_b, policy)
    assert (await a.contact(first.session)).plan.sampling == policy.sampling
    with pytest.raises(Unavailable):
        await b.contact(second.session)  # B holds one session already
    with pytest.raises(SessionNotFound):
        await b.contact(bytes(16))
    # A state larger than a session-open is refused unread.
    await world.mlc.put(a.store.uri(second.session), b"\x00" * (MAX_STATE_BYTES + 1))
    with pytest.raises(BadMessage):
        await a.store.load(second.session)


async def test_a_store_outage_leaves_the_sessions_a_router_holds_answerable(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared tier out of reach (Redis cut off, tests/faults): a front end following its session
    is answered from the router's memory; a session the router does not hold cannot be loaded."""
    router = world.router(ROUTER_A)
    await router.start()
    world.events_to.append(router)
    world.report(quiet=(V2,))
    tracked = await router.open_session(FRONT_END, SessionRequest(prompt=PROMPT, contract=world.contract))

    async def unreachable(*_args: object, **_kwargs: object) -> None:
        raise StoreUnavailable("redis: Timeout reading")

    with monkeypatch.context() as outage:
        outage.setattr(world.mlc, "fetch", unreachable)
        assert await router.contact(tracked.session) is tracked
        with pytest.raises(StoreUnavailable):
            await router.contact(bytes(16))
    assert await router.contact(tracked.session) is tracked


def test_the_durable_facts_round_trip() -> None:
    contract = Contract.from_obj(
        {
            "target": bytes(32),
            "tokenizer": bytes(32),
            "rule": 1,
            "m_max": 4,
            "max_new": 8,
            "stop": [],
            "low_rounds": 2,
            "fallback": [int(Action.FAIL)],
        }
    )
    plan = RouterSession(
        session=bytes(range(16)),
        epoch=3,
        contract=contract,
        prompt=PROMPT,
        commit_log="mlc://routers.test/-/log/00",
        verifier=V2,
        drafter=DRAFTER,
        sampling=Sampling.from_obj({"temperature_milli": 700}),
        owner=FRONT_END,
        request="req-1",
        self_decode_group_ms=0,
    )
    tracked = TrackedSession(plan, PROMPT, first_verifier=V1, phase=RouterPhase.MOVING, failover_to=V2)
    back = TrackedSession.from_durable(codec.decode(codec.encode(tracked.durable(ROUTER_A))))
    assert back.plan == plan and back.router == ROUTER_A
    assert (back.first_verifier, back.failover_to, back.phase) == (V1, V2, RouterPhase.MOVING)
    # Every phase a router holds a session in reads back as that phase (version 1's form: a
    # self_decoding flag, and failover_to while moving).
    for phase in (RouterPhase.WAITING, RouterPhase.DRAFTING, RouterPhase.SELF_DECODING):
        held = TrackedSession(
            replace(plan, drafter=None if phase is RouterPhase.WAITING else DRAFTER), PROMPT, phase=phase
        )
        assert TrackedSession.from_durable(codec.decode(codec.encode(held.durable(ROUTER_A)))).phase is phase
    with pytest.raises(BadMessage):
        TrackedSession.from_durable({**tracked.durable(ROUTER_A), "v": 99})


async def test_a_front_ends_self_decode_group_ms_goes_with_the_session_open(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The front end's bound on how far apart the session's self-decoded rounds come (an extension
    of POST sessions) reaches the verifier in session-open; a request without it sends none."""
    router = world.router(ROUTER_A)
    world.events_to.append(router)
    world.report()
    opens: list[SessionOpen] = []
    opening = router.link.open_session

    async def recorded(verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        opens.append(message)
        return await opening(verifier, message, timeout=timeout)

    monkeypatch.setattr(router.link, "open_session", recorded)
    for asked in (0, None):
        request = SessionRequest(prompt=PROMPT, contract=world.contract, self_decode_group_ms=asked)
        tracked = await router.open_session(FRONT_END, request)
        assert opens[-1].self_decode_group_ms == asked and tracked.plan.self_decode_group_ms == asked
        live = world.verifiers[tracked.plan.verifier].sessions[tracked.session]
        assert live.self_decode_group_ms == asked
        await router.cancel(tracked)


async def test_a_session_opens_deadline_grows_with_its_prefill(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #37: a fixed 30 s for a session-open made long prompts fail on a loaded machine. The
    router waits open_timeout_s plus open_timeout_per_token_ms for each token the verifier prefills:
    the prompt at the open, the prompt and the committed output at a failover."""
    router = world.router("https://router.example", open_timeout_per_token_ms=40)
    world.events_to.append(router)
    world.report()
    deadlines: list[tuple[int, float]] = []
    opening = router.link.open_session

    async def timed(verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        committed = 0 if message.resume is None else message.resume.committed
        deadlines.append((len(message.prompt) + committed, timeout))
        return await opening(verifier, message, timeout=timeout)

    monkeypatch.setattr(router.link, "open_session", timed)
    prompt = tuple(range(1, 201))
    tracked = await router.open_session(FRONT_END, SessionRequest(prompt=prompt, contract=world.contract))
    assert deadlines == [(200, 30.0 + 200 * 0.040)]
    assert open_deadline_s(30.0, 2150) == 30.0 + 2150 * OPEN_MS_PER_PROMPT_TOKEN / 1000
    await router.cancel(tracked)


async def test_a_failovers_open_waits_for_the_new_verifiers_queue_of_prefills(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier prefills one session at a time: a failover's session-open, as a new session's,
    waits for the queue the verifier last reported, and counts among the router's opens there."""
    router = world.router(ROUTER_A, open_timeout_per_token_ms=40)
    await router.start()
    world.events_to.append(router)
    tracked = await open_on_v1(world, router)
    deadlines: list[tuple[str, int, float, int]] = []
    opening = router.link.open_session

    async def timed(verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        committed = 0 if message.resume is None else message.resume.committed
        deadlines.append(
            (verifier, len(message.prompt) + committed, timeout, router.placement._opening.get(verifier, 0))
        )
        return await opening(verifier, message, timeout=timeout)

    monkeypatch.setattr(router.link, "open_session", timed)
    world.advance(2 * TTL_MS / 1000)
    router.report(replace(world.verifiers[V2].status(), prefill_tokens=1000))
    await router.maintain()
    await eventually(lambda: tracked.plan.epoch == 2)
    ((verifier, tokens, timeout, counted),) = deadlines
    assert verifier == V2 and tokens > len(PROMPT)
    assert timeout == pytest.approx(30.0 + (tokens + 1000) * 0.040)
    # While it was in flight it counted among the router's opens at V2, and not after.
    assert counted == tokens and V2 not in router.placement._opening
    await router.stop()


async def test_a_session_goes_where_its_prompts_prefix_is_held_while_that_verifier_has_room(world: World) -> None:
    """Verifiers report the prefixes whose KV they hold (Status.prefixes): the router opens a session
    at the one holding the longest prefix of its prompt, for its tenant, though it is the busier,
    and by load where that one is full or holds another tenant's prefixes (SGLang's cache-aware routing)."""
    router = world.router("https://router.test")
    world.events_to.append(router)
    prompt = tuple((7 * i + 3) % 200 + 1 for i in range(2 * SHARE_TOKENS + 20))
    salt = world.contract.target + world.contract.tokenizer
    names = shared_hashes(prompt[:-1], salt=salt, scope=tenant_scope("tenant-a"))
    assert len(names) == 2

    async def opened_at(v2_load: int, v2_prefixes: tuple[bytes, ...], tenant: str) -> str:
        router.report(replace(world.verifiers[V1].status(), load=0, queue=0))
        router.report(replace(world.verifiers[V2].status(), load=v2_load, prefixes=v2_prefixes))
        tracked = await router.open_session(
            FRONT_END, SessionRequest(prompt=prompt, contract=world.contract, tenant=tenant)
        )
        await router.cancel(tracked)
        return tracked.plan.verifier

    assert await opened_at(60, names[:1], "tenant-a") == V2
    assert await opened_at(60, (), "tenant-a") == V1
    assert await opened_at(100, names, "tenant-a") == V1
    assert await opened_at(60, names, "tenant-b") == V1


def alone_contract(world: World, **members: int) -> Contract:
    """The world's contract with self-decoding permitted at any load (self_load), no self_max."""
    return Contract.from_obj({**world.contract.to_obj(), "self_load": 100, **members})


async def test_a_session_decoded_alone_starts_decoding_with_its_open(
    world: World, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the router's choice is the verifier alone, the session-open asks for it (extension
    ``self_decode``, docs/interpretations.md "Self-decoding from the open"): the verifier starts
    the period right after the prefill, and no self-decode request follows the open."""
    router = world.router(ROUTER_A)
    world.events_to.append(router)
    world.report(quiet=(V2,))
    opens: list[SessionOpen] = []
    asked: list[bytes] = []
    opening, self_decode = router.link.open_session, router.link.self_decode

    async def open_session(verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        opens.append(message)
        return await opening(verifier, message, timeout=timeout)

    async def asked_alone(verifier: str, request: SelfDecodeRequest) -> SessionState:
        asked.append(request.session)
        return await self_decode(verifier, request)

    written: list[str] = []
    put = router.store._mlc.put

    async def counted_put(uri: str, data: bytes, **kwargs: object) -> ObjectInfo:
        written.append(uri)
        return await put(uri, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(router.link, "open_session", open_session)
    monkeypatch.setattr(router.link, "self_decode", asked_alone)
    monkeypatch.setattr(router.store._mlc, "put", counted_put)
    request = SessionRequest(prompt=PROMPT, contract=alone_contract(world), self_decode_only=True)
    tracked = await router.open_session(FRONT_END, request)
    assert [message.self_decode for message in opens] == [True]
    assert tracked.plan.drafter is None and tracked.self_decoding
    # The session's facts were written once, already saying that the verifier decodes it alone.
    assert written == [router.store.uri(tracked.session)]
    machine = world.verifiers[V1].sessions[tracked.session].machine
    await eventually(lambda: machine.ended)
    assert await committed(world, tracked) == greedy(tiny_loaded, MAX_NEW)
    assert asked == []
    await eventually(lambda: tracked.ended)


async def test_a_session_that_ends_before_its_open_is_answered_ends_at_the_router(
    world: World, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session decoded alone from its open may end (its one token decoded) before the router
    holds it: the verifier's finish event waits for the open to be over instead of finding no such
    session, and the router ends the session it now holds."""
    router = world.router(ROUTER_A)
    world.events_to.append(router)
    world.report(quiet=(V2,))
    contacts: list[bytes] = []
    contact, save = router.contact, router.store.save

    async def contacted(session: bytes) -> TrackedSession:
        contacts.append(session)
        return await contact(session)

    async def saved_late(tracked: TrackedSession, *, force: bool = False) -> None:
        # The session's facts are written only once the verifier's event has reached the router.
        await eventually(lambda: tracked.session in contacts)
        await save(tracked, force=force)

    monkeypatch.setattr(router, "contact", contacted)
    monkeypatch.setattr(router.store, "save", saved_late)
    request = SessionRequest(prompt=PROMPT, contract=alone_contract(world, max_new=1), self_decode_only=True)
    tracked = await router.open_session(FRONT_END, request)
    await eventually(lambda: tracked.ended)
    assert await committed(world, tracked) == greedy(tiny_loaded, 1)


async def test_a_verifier_that_may_not_decode_alone_opens_the_session_all_the_same(world: World) -> None:
    """The self-decode request made with the open is refused as the later one would be (here the
    contract has no self_load): the session opens, active, and the router goes on as after any
    open (the later request, refused too, leaves the session waiting for the router's next try)."""
    router = world.router(ROUTER_A)
    world.events_to.append(router)
    world.report(quiet=(V2,))
    request = SessionRequest(prompt=PROMPT, contract=world.contract, self_decode_only=True)
    tracked = await router.open_session(FRONT_END, request)
    machine = world.verifiers[V1].sessions[tracked.session].machine
    assert not machine.self_decoding and not machine.ended and machine.committed == 0
    assert not tracked.self_decoding and not tracked.ended
    await router.cancel(tracked)
