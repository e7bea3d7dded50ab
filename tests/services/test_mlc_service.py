"""The MLC node over HTTP/2 + mTLS and `RemoteStore` (SDCP 1.4, 6.8).

An `MLCNode` serves an MLC on 127.0.0.1 whose shared store is a disk directory (or, for the core
cases, a real redis-server from tests/redis_fixture.py); the instances under test are MLCs built with
`remote=` (a memory cache in front of the remote store), each with its own certificate, so that
every operation is a real request from an authenticated peer. The cases are those of the embedded
suite (tests/cache) that a remote store must keep: same results, same exceptions.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import struct
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from tests.cache.racing import race_appenders

from sdcp.cache import (
    MLC,
    AccessDenied,
    CacheFull,
    CommitLog,
    CorruptRecord,
    Fenced,
    InvalidArgument,
    InvalidRecord,
    LeaseNotHeld,
    ObjectNotFound,
    ObjectTooLarge,
    PreconditionFailed,
    build_uri,
    content_etag,
)
from sdcp.cache.commitlog import EMPTY_LOG_ETAG
from sdcp.config import ConfigError, InstanceConfig, MLCConfig, ServiceConfig, TrustConfig
from sdcp.localhost import free_port
from sdcp.protocol.problems import ProtocolError
from sdcp.services.mlc import MLCNode
from sdcp.services.mlc_client import RemoteStore
from sdcp.services.node import build_mlc
from sdcp.transport.certs import instance_name, make_certs
from sdcp.transport.client import SDCPClient
from sdcp.transport.errors import PeerClientError

pytestmark = pytest.mark.timeout(60)

KB = 1024
DRAFTER_A = "https://127.0.0.1:9701"
DRAFTER_B = "https://127.0.0.1:9702"
LOG = build_uri("mlc.test", bytes(16), "log", "session-1")


def uri(name: str, kind: str = "q-rows") -> str:
    return build_uri("mlc.test", bytes(16), kind, name)


def commit(epoch: int, round_: int, writer: str = DRAFTER_A) -> dict[str, object]:
    record = {"epoch": epoch, "round": round_, "emitted": [round_], "committed": round_, "digest": bytes(32)}
    return {**record, "writer": writer}


class Cluster:
    """One running MLC node and the remote MLCs and raw clients created against it."""

    def __init__(self, certs: Path, node: MLCNode) -> None:
        self.certs, self.node = certs, node
        self._mlcs: list[MLC] = []
        self._clients: list[SDCPClient] = []

    def credentials(self, identity: str) -> dict[str, Path]:
        name = instance_name(identity)
        return {"cert": self.certs / f"{name}.pem", "key": self.certs / f"{name}.key", "ca": self.certs / "ca.pem"}

    def remote(self, identity: str = DRAFTER_A, *, memory_bytes: int = 1 << 20) -> MLC:
        remote = RemoteStore(self.node.uri, **self.credentials(identity))
        mlc = MLC.from_config(remote=remote, memory_bytes=memory_bytes)
        self._mlcs.append(mlc)
        return mlc

    def client(self, identity: str = DRAFTER_A) -> SDCPClient:
        creds = self.credentials(identity)
        client = SDCPClient(self.node.uri, creds["cert"], creds["key"], creds["ca"])
        self._clients.append(client)
        return client

    async def close(self) -> None:
        await asyncio.gather(*(mlc.close() for mlc in self._mlcs), *(c.aclose() for c in self._clients))


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    make_certs(directory, [DRAFTER_A, DRAFTER_B])
    return directory


@pytest.fixture(params=["disk", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def start_node(
    certs_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[..., object]]:
    """`await start_node(backend=..., store_bytes=..., max_object_bytes=...)` -> a running `Cluster`."""
    clusters: list[Cluster] = []

    async def start(*, backend: str = "disk", store_bytes: int = 64 << 20, max_object_bytes: int = 64 << 20) -> Cluster:
        node_uri = f"https://127.0.0.1:{free_port()}"
        cert = make_certs(certs_dir, [node_uri])[node_uri]
        # Both test identities may play every role here; tests/services/test_authz.py separates them.
        both = (DRAFTER_A, DRAFTER_B)
        config = ServiceConfig(
            instance=InstanceConfig(node_uri, cert.cert_path, cert.key_path, certs_dir / "ca.pem"),
            trust=TrustConfig(routers=both, verifiers=both, drafters=both),
        )
        if backend == "redis":
            shared: dict[str, object] = {
                "redis_url": request.getfixturevalue("redis_url"),
                "redis_bytes": store_bytes,
                "redis_prefix": f"test:{uuid.uuid4().hex}:",
            }
        else:
            shared = {"disk_dir": tmp_path / f"store-{len(clusters)}", "disk_bytes": store_bytes}
        store = MLC.from_config(memory_bytes=0, max_object_bytes=max_object_bytes, **shared)  # type: ignore[arg-type]
        node = MLCNode(config, mlc=store)
        await node.start()
        cluster = Cluster(certs_dir, node)
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        await cluster.close()
        await cluster.node.stop()


async def test_objects_round_trip_through_the_node(start_node, backend: str) -> None:
    cluster: Cluster = await start_node(backend=backend)
    mlc, other = cluster.remote(DRAFTER_A), cluster.remote(DRAFTER_B)
    row = bytes(range(256)) * (196 * KB // 256)
    info = await mlc.put(uri("row"), row)
    assert info.etag == content_etag(row) and info.size == len(row)
    assert await other.get(uri("row")) == row
    assert await mlc.exists(uri("row")) and await other.locate(uri("row")) == ["memory", "remote"]
    await mlc.put(uri("empty"), b"")
    assert await other.get(uri("empty")) == b""
    await mlc.put(uri("row"), b"replaced")
    assert await other.get(uri("row")) == b"replaced"  # the reader's cached copy is not served
    assert await mlc.delete(uri("row"))
    assert not await other.exists(uri("row")) and not await mlc.delete(uri("row"))
    with pytest.raises(ObjectNotFound):
        await other.get(uri("row"))


async def test_put_answers_created_then_replaced_with_etags(start_node) -> None:
    cluster: Cluster = await start_node()
    client = cluster.client()
    first = await client.put_bytes("objects", b"v1", {"uri": uri("p")})
    second = await client.put_bytes("objects", b"v2", {"uri": uri("p")})
    assert (first.status, first.headers["etag"]) == (201, content_etag(b"v1"))
    assert (second.status, second.headers["etag"]) == (204, content_etag(b"v2"))
    head = await client.head("objects", {"uri": uri("p")})
    got = await client.get_bytes("objects", {"uri": uri("p")})
    assert head.headers["etag"] == got.headers["etag"] == content_etag(b"v2") and got.content == b"v2"
    assert head.content == b"" and "content-length" not in head.headers
    with pytest.raises(PeerClientError) as missing:
        await client.head("objects", {"uri": uri("absent")})
    assert missing.value.status == 404


async def test_if_match_mismatch_is_precondition_failed(start_node) -> None:
    cluster: Cluster = await start_node()
    mlc = cluster.remote()
    first = await mlc.put(uri("c"), b"v1")
    second = await mlc.put(uri("c"), b"v2", if_match=first.etag)
    with pytest.raises(PreconditionFailed):
        await mlc.put(uri("c"), b"v3", if_match=first.etag)
    with pytest.raises(PreconditionFailed):
        await mlc.put(uri("missing"), b"x", if_match=first.etag)
    data, info = await mlc.fetch(uri("c"))
    assert data == b"v2" and info.etag == second.etag


async def test_node_limits_map_to_cache_errors(start_node) -> None:
    cluster: Cluster = await start_node(max_object_bytes=10 * KB)
    mlc = cluster.remote()  # its own limit is 64 MiB: the node's 10 KB applies
    with pytest.raises(ObjectTooLarge):
        await mlc.put(uri("big"), bytes(10 * KB + 1))
    assert not await mlc.exists(uri("big"))
    client = cluster.client()
    for params in ({}, {"uri": "bucket/key"}):
        with pytest.raises(ProtocolError) as bad:
            await client.get_bytes("objects", params)
        assert bad.value.status == 400
    # Another implementation's name is a name like any other (SDCP 5.2 cache-ref): not found here.
    with pytest.raises(ProtocolError) as missing:
        await client.get_bytes("objects", {"uri": "s3://bucket/key"})
    assert missing.value.status == 404
    with pytest.raises(ProtocolError) as unconditional:
        await client.post_cbor("logs/append", commit(1, 1), params={"uri": LOG})
    assert unconditional.value.status == 428
    assert (await mlc.commit_log(LOG).read()).records == []


async def test_leases_protect_and_only_the_holder_releases(start_node, backend: str) -> None:
    cluster: Cluster = await start_node(backend=backend, store_bytes=3 * KB)
    holder, other = cluster.remote(DRAFTER_A), cluster.remote(DRAFTER_B)
    for name in ("a", "b", "c"):
        await holder.put(uri(name), bytes(KB))
    lease = await holder.lease(uri("a"), DRAFTER_A, 30.0)
    assert lease.holder == DRAFTER_A and time.time() + 25 < lease.expires_at < time.time() + 35
    await other.put(uri("d"), bytes(KB))  # pressure: the LRU object "a" is leased, "b" goes
    assert await other.exists(uri("a")) and not await other.exists(uri("b"))
    await holder.lease(uri("c"), DRAFTER_A, 30.0)
    await other.lease(uri("d"), DRAFTER_B, 30.0)
    with pytest.raises(CacheFull):
        await other.put(uri("e"), bytes(KB))
    with pytest.raises(AccessDenied):  # a peer cannot release another's lease ...
        await other.release(uri("c"), DRAFTER_A)
    assert not await other.release(uri("c"), DRAFTER_B)  # ... and holds none of its own there
    assert await holder.release(uri("c"), DRAFTER_A)
    assert not await holder.release(uri("c"), DRAFTER_A)
    with pytest.raises(LeaseNotHeld):
        await holder.renew(uri("c"), DRAFTER_A, 1.0)
    with pytest.raises(ObjectNotFound):
        await holder.lease(uri("missing"), DRAFTER_A, 1.0)
    await other.put(uri("e"), bytes(KB))
    assert not await other.exists(uri("c"))
    assert await other.exists(uri("a")) and await other.exists(uri("d"))


async def test_16_concurrent_appenders_one_winner_per_version(start_node, backend: str) -> None:
    cluster: Cluster = await start_node(backend=backend)
    mlcs = [cluster.remote(DRAFTER_A) for _ in range(4)]
    logs: list[CommitLog] = [mlcs[i % 4].commit_log(LOG) for i in range(16)]
    await race_appenders(logs, lambda writer: commit(1, writer))


async def test_fence_stops_stale_epochs(start_node, backend: str) -> None:
    cluster: Cluster = await start_node(backend=backend)
    verifier_log = cluster.remote(DRAFTER_A).commit_log(LOG)
    router_log = cluster.remote(DRAFTER_B).commit_log(LOG)
    assert (await verifier_log.read()).etag == EMPTY_LOG_ETAG
    etag = await verifier_log.append(commit(1, 1), if_match=EMPTY_LOG_ETAG)
    fenced = await router_log.fence(2)
    with pytest.raises(Fenced):  # the old verifier raced the fence with the etag it had
        await verifier_log.append(commit(1, 2), if_match=etag)
    with pytest.raises(Fenced):  # and cannot get in with the current etag either
        await verifier_log.append(commit(1, 2), if_match=fenced)
    after = await router_log.append(commit(2, 2, DRAFTER_B), if_match=fenced)
    assert await router_log.fence(2) == after  # a retried fence appends nothing
    with pytest.raises(Fenced):
        await router_log.fence(1)
    with pytest.raises(InvalidRecord):
        await verifier_log.append({"round": 3}, if_match=after)
    snapshot = await verifier_log.read()
    assert snapshot.records == [commit(1, 1), {"epoch": 2}, commit(2, 2, DRAFTER_B)] and snapshot.etag == after
    assert await verifier_log.last_commit() == commit(2, 2, DRAFTER_B)


async def test_corrupt_log_reads_as_corrupt_record(start_node, tmp_path: Path) -> None:
    cluster: Cluster = await start_node()
    log = cluster.remote().commit_log(LOG)
    await log.append(commit(1, 1), if_match=EMPTY_LOG_ETAG)
    # A complete frame whose checksum is wrong: the embedded log refuses to skip it.
    path = tmp_path / "store-0" / "logs" / f"{hashlib.sha256(LOG.encode()).hexdigest()[:40]}.log"
    payload = b"\xa1eepoch\x01"
    with path.open("ab") as handle:
        handle.write(struct.pack(">II", len(payload), zlib.crc32(payload) ^ 1) + payload)
    with pytest.raises(CorruptRecord):
        await log.read()


async def test_client_without_certificate_is_refused(start_node) -> None:
    cluster: Cluster = await start_node()
    anonymous = ssl.create_default_context(cafile=str(cluster.certs / "ca.pem"))
    params = {"uri": uri("x")}
    async with httpx.AsyncClient(http2=True, http1=False, verify=anonymous, base_url=cluster.node.uri) as client:
        with pytest.raises(httpx.TransportError):
            await client.head("/objects", params=params)
    with pytest.raises(PeerClientError) as authenticated:  # the same request with a certificate
        await cluster.client().head("objects", params)
    assert authenticated.value.status == 404


async def test_configuration_is_checked(certs_dir: Path, tmp_path: Path) -> None:
    ca = certs_dir / "ca.pem"
    creds = {"cert": certs_dir / "127.0.0.1_9701.pem", "key": certs_dir / "127.0.0.1_9701.key", "ca": ca}
    with pytest.raises(InvalidArgument):
        MLC.from_config(remote=RemoteStore("https://127.0.0.1:9", **creds), redis_url="redis://127.0.0.1:6379/0")
    with pytest.raises(InvalidArgument):
        RemoteStore("http://127.0.0.1:9", **creds)
    instance = InstanceConfig(DRAFTER_A, creds["cert"], creds["key"], ca)
    remote = build_mlc(ServiceConfig(instance=instance, mlc=MLCConfig(mlc_url="https://127.0.0.1:9")))
    assert isinstance(remote.shared, RemoteStore) and [tier.name for tier in remote.caches] == ["memory"]
    await remote.close()
    with pytest.raises(ConfigError):
        MLCNode(ServiceConfig(instance=InstanceConfig(DRAFTER_A, creds["cert"], creds["key"], ca, router=DRAFTER_B)))
    with pytest.raises(ConfigError):
        MLCNode(ServiceConfig(instance=instance, mlc=MLCConfig(mlc_url=DRAFTER_A + "/")))


async def test_a_log_is_read_from_a_record_on_through_the_node(start_node, backend: str) -> None:
    """GET logs?from=n: a router's replay reads only the records it has not read."""
    cluster: Cluster = await start_node(backend=backend)
    verifier_log = cluster.remote(DRAFTER_A).commit_log(LOG)
    router_log = cluster.remote(DRAFTER_B).commit_log(LOG)
    etag = await verifier_log.append(commit(1, 1), if_match=EMPTY_LOG_ETAG)
    await verifier_log.append(commit(1, 2), if_match=etag)
    fenced = await router_log.fence(2)
    await router_log.append(commit(2, 3, DRAFTER_B), if_match=fenced)
    whole = await verifier_log.read()
    for start in range(len(whole.records) + 1):
        tail = await verifier_log.read_from(start)
        assert (tail.records, tail.etag) == (whole.records[start:], whole.etag)
