"""Store access per role, enforced by a real redis-server's ACLs (sdcp.cache.redis_acl, #29).

Each test creates the four role users for a key prefix of its own on the session's redis-server
(whose default user may administer ACLs) and acts with one role's credentials at a time, through
the MLC as the services do and straight with redis commands as a compromised host would.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from sdcp.bench.redis_process import RedisTLS, local_redis_server
from sdcp.cache import MLC, AccessDenied, CacheFull, build_uri, target_kv_uri
from sdcp.cache.commitlog import EMPTY_LOG_ETAG
from sdcp.cache.redis_acl import (
    ADMIN,
    ROLES,
    RedisAccess,
    UsersNotPersisted,
    acl_file_text,
    create_users,
    default_user_open,
    ensure_passwords,
    lock_default_user,
    persist_users,
)
from sdcp.cache.uri import HISTORY_KIND, LOG_KIND, PREFIX_KV_KIND, Q_ROWS_KIND, TOKENS_KIND
from sdcp.transport.certs import make_certs

SCOPE = bytes(range(16))
SESSION = bytes(8)
LOG = build_uri("local", SCOPE, LOG_KIND, SESSION.hex())
Q_ROWS = build_uri("local", SCOPE, Q_ROWS_KIND, f"{SESSION.hex()}-e1-r1")
TOKENS = build_uri("local", SCOPE, TOKENS_KIND, f"{SESSION.hex()}-3")
HISTORY = build_uri("local", SCOPE, HISTORY_KIND, "ab" * 16)
TARGET_KV = str(target_kv_uri(LOG, SESSION, 1))
PREFIX_KV = build_uri("local", None, PREFIX_KV_KIND, "cd" * 32)


@dataclass
class Roles:
    """One prefix's users on the server: MLCs and raw clients acting as each role."""

    url: str
    prefix: str
    users: dict[str, str]
    passwords: dict[str, str]
    opened: list[MLC]
    clients: list[aioredis.Redis]

    def access(self, role: str) -> RedisAccess:
        return RedisAccess(role=role, username=self.users[role], password=self.passwords[role])

    def mlc(self, role: str, *, redis_bytes: int | None = None) -> MLC:
        mlc = MLC.from_config(
            redis_url=self.url,
            redis_prefix=self.prefix,
            redis_bytes=redis_bytes,
            redis_access=self.access(role),
            memory_bytes=0,
        )
        self.opened.append(mlc)
        return mlc

    def raw(self, role: str) -> aioredis.Redis:
        client = aioredis.Redis.from_url(self.url, username=self.users[role], password=self.passwords[role])
        self.clients.append(client)
        return client


@pytest.fixture
async def roles(redis_url: str) -> AsyncIterator[Roles]:
    tag = uuid.uuid4().hex[:12]
    prefix = f"test:{tag}:"
    users = {role: f"{tag}-{role}" for role in ROLES}
    passwords = {role: secrets.token_urlsafe(16) for role in ROLES}
    admin = redis.Redis.from_url(redis_url)
    create_users(admin, passwords, prefix, users)
    found = Roles(redis_url, prefix, users, passwords, [], [])
    yield found
    for mlc in found.opened:
        await mlc.close()
    for client in found.clients:
        await client.aclose()
    for user in users.values():
        admin.execute_command("ACL", "DELUSER", user)
    admin.close()


async def refused(call: Callable[[], Awaitable[object]]) -> None:
    """The server refused the call for the caller's ACL user."""
    with pytest.raises(AccessDenied):
        await call()


async def test_a_drafters_credentials_reach_only_draft_state(roles: Roles) -> None:
    router, verifier, drafter = roles.mlc("router"), roles.mlc("verifier"), roles.mlc("drafter")
    # What the other roles legitimately write, for the drafter to read.
    await router.put(TOKENS, b"tokens")
    await verifier.put(HISTORY, b"history")
    await verifier.commit_log(LOG).append({"epoch": 1, "round": 1, "writer": "v"}, EMPTY_LOG_ETAG)

    # The drafter's own work: draft rows written, leased, read, released, deleted; what it drafts from.
    await drafter.put(Q_ROWS, b"rows")
    await drafter.lease(Q_ROWS, "drafter-1", 5.0)
    await drafter.renew(Q_ROWS, "drafter-1", 5.0)
    assert await drafter.lease_holders(Q_ROWS) == {"drafter-1"}
    assert await drafter.get(Q_ROWS) == b"rows"
    assert await drafter.release(Q_ROWS, "drafter-1")
    assert await drafter.get(TOKENS) == b"tokens"
    assert await drafter.get(HISTORY) == b"history"
    assert await verifier.get(Q_ROWS) == b"rows"  # the verifier reads the drafter's rows
    assert await drafter.delete(Q_ROWS)

    # Through the store's own scripts: nothing but draft rows.
    log = drafter.commit_log(LOG)
    await refused(lambda: log.append({"epoch": 1, "round": 2, "writer": "d"}, '"1-x"'))
    await refused(lambda: log.fence(9, "https://drafter"))
    await refused(lambda: log.read())
    for uri in (HISTORY, TARGET_KV, TOKENS):
        await refused(lambda uri=uri: drafter.put(uri, b"forged"))
    await refused(lambda: drafter.delete(HISTORY))
    await refused(lambda: drafter.get(TARGET_KV))

    # Straight commands, as a compromised drafter host would send them: NOPERM from the server.
    raw, p = roles.raw("drafter"), roles.prefix
    writes = [
        lambda: raw.rpush(f"{p}log:c:{LOG}", b"forged commit record"),
        lambda: raw.hset(f"{p}log:cm:{LOG}", "n", 0),
        lambda: raw.rpush(f"{p}log:f:{LOG}", b"0:forged fence"),
        lambda: raw.hset(f"{p}log:fm:{LOG}", "fence", 99),
        lambda: raw.hset(f"{p}history:o:{HISTORY}", mapping={"d": b"forged", "e": '"x"'}),
        lambda: raw.hset(f"{p}target-kv:o:{TARGET_KV}", mapping={"d": b"forged", "e": '"x"'}),
        lambda: raw.hset(f"{p}tokens:o:{TOKENS}", mapping={"d": b"forged", "e": '"x"'}),
        lambda: raw.delete(f"{p}log:c:{LOG}"),
        lambda: raw.lrange(f"{p}log:c:{LOG}", 0, -1),
        lambda: raw.set("unprefixed", 1),
        lambda: raw.execute_command("CONFIG", "GET", "*"),
        lambda: raw.execute_command("FLUSHALL"),
        # A script of its own runs with the drafter's rights too.
        lambda: raw.eval("return redis.call('RPUSH', ARGV[1], 'x')", 0, f"{p}log:c:{LOG}"),
    ]
    for write in writes:
        with pytest.raises((NoPermissionError, ResponseError)) as refusal:
            await write()
        assert "NOPERM" in str(refusal.value) or "permission" in str(refusal.value) or "can't" in str(refusal.value)
    assert (await router.commit_log(LOG).read()).records == [{"epoch": 1, "round": 1, "writer": "v"}]
    assert await drafter.get(HISTORY) == b"history" and await drafter.get(TOKENS) == b"tokens"


async def test_only_verifiers_append_and_only_routers_fence(roles: Roles) -> None:
    router, verifier = roles.mlc("router"), roles.mlc("verifier")
    appended = await verifier.commit_log(LOG).append({"epoch": 1, "round": 1, "writer": "v"}, EMPTY_LOG_ETAG)
    await refused(lambda: verifier.commit_log(LOG).fence(2, "https://other"))
    # A fence-shaped record is a fence: appended by a verifier it is refused, and changes nothing.
    await refused(lambda: verifier.commit_log(LOG).append({"epoch": 5}, appended))
    await refused(lambda: router.commit_log(LOG).append({"epoch": 1, "round": 2, "writer": "r"}, appended))
    fenced = await router.commit_log(LOG).fence(2, "https://verifier-2")
    after = await verifier.commit_log(LOG).append({"epoch": 2, "round": 2, "writer": "v2"}, fenced)

    for mlc in (router, verifier):  # both read the one sequence, with the same ETag
        snapshot = await mlc.commit_log(LOG).read()
        assert snapshot.etag == after
        assert snapshot.records == [
            {"epoch": 1, "round": 1, "writer": "v"},
            {"epoch": 2, "verifier": "https://verifier-2"},
            {"epoch": 2, "round": 2, "writer": "v2"},
        ]
    v, r, p = roles.raw("verifier"), roles.raw("router"), roles.prefix
    for call in (
        lambda: v.hset(f"{p}log:fm:{LOG}", "fence", 0),
        lambda: v.rpush(f"{p}log:f:{LOG}", b"0:x"),
        lambda: r.rpush(f"{p}log:c:{LOG}", b"forged"),
        lambda: r.hset(f"{p}log:cm:{LOG}", "n", 9),
    ):
        with pytest.raises(NoPermissionError):
            await call()


async def test_history_and_target_kv_are_the_verifiers_and_a_router_may_only_delete_target_kv(roles: Roles) -> None:
    router, verifier = roles.mlc("router"), roles.mlc("verifier")
    await verifier.put(TARGET_KV, b"kv")
    await verifier.put(HISTORY, b"entry")
    for uri in (TARGET_KV, HISTORY, Q_ROWS):
        await refused(lambda uri=uri: router.put(uri, b"forged"))
    await refused(lambda: verifier.put(TOKENS, b"forged"))
    await refused(lambda: verifier.put(Q_ROWS, b"forged"))
    await refused(lambda: router.delete(HISTORY))
    assert await router.exists(TARGET_KV)
    assert await router.delete(TARGET_KV)  # the failover's clean-up (SDCP 6.9)
    assert not await verifier.exists(TARGET_KV)
    with pytest.raises(NoPermissionError):
        await roles.raw("router").hset(f"{roles.prefix}target-kv:o:{TARGET_KV}", "d", b"forged")
    await router.put(TOKENS, b"committed")
    assert await verifier.get(TOKENS) == b"committed"


async def test_a_drafters_puts_never_evict_another_roles_objects(roles: Roles) -> None:
    verifier, drafter = roles.mlc("verifier", redis_bytes=1000), roles.mlc("drafter", redis_bytes=1000)
    await verifier.put(TARGET_KV, bytes(600))
    first, second = Q_ROWS, Q_ROWS.replace("-r1", "-r2")
    await drafter.put(first, bytes(600))
    await drafter.put(second, bytes(600))  # evicts the drafter's own first rows, nothing else
    assert await verifier.exists(TARGET_KV) and not await drafter.exists(first)
    await drafter.lease(second, "drafter-1", 5.0)
    with pytest.raises(CacheFull):  # only its own leased rows could make room
        await drafter.put(Q_ROWS.replace("-r1", "-r3"), bytes(600))
    assert await verifier.exists(TARGET_KV)


async def test_an_acl_file_with_the_default_user_off_over_tls(tmp_path: Path) -> None:
    prefix = "sdcp:mlc:"
    passwords = ensure_passwords(tmp_path / "secrets")
    assert {path.name for path in (tmp_path / "secrets").iterdir()} == {f"{r}.password" for r in (*ROLES, ADMIN)}
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in (tmp_path / "secrets").iterdir())
    assert ensure_passwords(tmp_path / "secrets") == passwords  # a second run keeps them
    aclfile = tmp_path / "users.acl"
    aclfile.write_text(acl_file_text(passwords, prefix))
    assert not any(password in aclfile.read_text() for password in passwords.values())
    server, client = "https://127.0.0.1:1", "https://localhost/redis-client"
    certs = make_certs(tmp_path / "certs", [server, client])
    ca = tmp_path / "certs" / "ca.pem"
    tls = RedisTLS(certs[server].cert_path, certs[server].key_path, ca)
    client_files = (certs[client].cert_path, certs[client].key_path)
    admin = ("sdcp-admin", passwords[ADMIN])
    with local_redis_server(tmp_path / "redis", aclfile=aclfile, admin=admin, tls=tls, client_tls=client_files) as url:
        assert url.startswith("rediss://")

        def access(role: str | None, password: str | None) -> RedisAccess:
            user = None if role is None else f"sdcp-{role}"
            return RedisAccess(role, user, password, str(ca), str(client_files[0]), str(client_files[1]))

        def mlc(role: str) -> MLC:
            return MLC.from_config(redis_url=url, redis_access=access(role, passwords[role]), memory_bytes=0)

        async with mlc("verifier") as verifier, mlc("drafter") as drafter, mlc("router") as router:
            etag = await verifier.commit_log(LOG).append({"epoch": 1, "round": 1, "writer": "v"}, EMPTY_LOG_ETAG)
            assert (await router.commit_log(LOG).read()).etag == etag
            await drafter.put(Q_ROWS, b"rows")
            await refused(lambda: drafter.commit_log(LOG).append({"epoch": 1, "round": 2}, etag))
        # Without credentials (the default user, off) or with a wrong password: nothing at all.
        for who in (access(None, None), access("drafter", "wrong")):
            async with MLC.from_config(redis_url=url, redis_access=who, memory_bytes=0) as anonymous:
                await refused(lambda anonymous=anonymous: anonymous.put(Q_ROWS, b"x"))


def test_users_are_kept_where_the_server_keeps_them_and_the_default_user_locked(tmp_path: Path) -> None:
    """Issue #36: users made with ACL SETUSER are kept with ACL SAVE in the server's ACL file; a
    server started without one keeps them nowhere (UsersNotPersisted); the open default user is
    seen and locked, but never through the default user's own connection."""
    with local_redis_server(tmp_path / "plain") as url:
        client = redis.Redis.from_url(url)
        try:
            assert default_user_open(client)
            with pytest.raises(UsersNotPersisted, match="--aclfile"):
                persist_users(client)
            with pytest.raises(ValueError, match="default user"):
                lock_default_user(client)
            assert default_user_open(client)
        finally:
            client.close()
    passwords = ensure_passwords(tmp_path / "secrets", (ADMIN,))
    acl_file = tmp_path / "users.acl"
    acl_file.write_text(
        "user default on nopass ~* &* +@all\n" + acl_file_text(passwords, "sdcp:mlc:").split("\n", 1)[1]
    )
    admin = ("sdcp-admin", passwords[ADMIN])
    with local_redis_server(tmp_path / "acl", aclfile=acl_file, admin=admin) as url:
        client = redis.Redis.from_url(url, username=admin[0], password=admin[1])
        try:
            assert default_user_open(client)
            lock_default_user(client)
            create_users(client, ensure_passwords(tmp_path / "secrets", ("drafter",)), "sdcp:mlc:")
            assert persist_users(client) == "ACL file"
            assert not default_user_open(client)
        finally:
            client.close()
    kept = acl_file.read_text()
    assert "user sdcp-drafter on" in kept and "user default off" in kept


async def test_only_verifiers_write_or_read_prompt_prefixes_kv(roles: Roles) -> None:
    router, verifier, drafter = roles.mlc("router"), roles.mlc("verifier"), roles.mlc("drafter")
    await verifier.put(PREFIX_KV, b"signed prefix kv")
    assert await verifier.get(PREFIX_KV) == b"signed prefix kv"
    for other in (router, drafter):
        await refused(lambda other=other: other.put(PREFIX_KV, b"forged"))
        await refused(lambda other=other: other.get(PREFIX_KV))
