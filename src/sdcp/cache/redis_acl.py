"""Who may touch which Redis keys: one Redis ACL user per role, enforced by the server.

The Redis store (`sdcp.cache.redis`) keeps each object kind in a namespace of its own and splits a
commit log into the verifiers' keys (commit records) and the routers' keys (fences), so that key
patterns alone say what a role's credentials reach (docs/cache.md "Redis layout", docs/security.md
"Store credentials per role"). Redis >= 7.0 checks every command, also each one a Lua script runs,
against the calling user's commands and key patterns (`%R~` read-only, `~` read-write) and refuses
the rest with NOPERM, whatever the client's code says.

- router: writes `tokens`, `router-session` (sessions' durable facts, sdcp.engines.router.store)
  and the logs' fences; reads the logs' commit records and `target-kv` objects, and deletes
  `target-kv` objects (a selector: DEL and the delete script, no write);
- verifier: writes `target-kv`, `prefix-kv`, `history` and the logs' commit records (no other role
  reads `prefix-kv`: prompts' KV); reads `q-rows`, `tokens`,
  `other` and the logs' fences;
- drafter: writes `q-rows`; reads `tokens`, `history` and `other`; no commit log at all;
- mlc: every key under the prefix (an MLC node, which checks its callers itself);
- admin: every key and command (for `sdcp redis-acl --url` and operators).

The default user is switched off in the ACL file this module writes, without any password: no
connection can be it. A server whose default user stays open (no `requirepass`) gives every client
the admin's rights, whatever the roles' users say. Its own rights are every command and key
(`DEFAULT_USER`): they are what Redis replays the append-only file with. Redis 7.0 to 8.0 (until
redis/redis#14545; Valkey likewise, valkey-io/valkey#3983) runs the file's EXECs as the default
user and checks each queued command against that user's rules again; every script of the store
that writes more than one command is in the file as a MULTI/EXEC of its effects, so a default user
without rights loses them all at a restart (NOPERM in the server's log, the commit logs empty).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from sdcp.cache.uri import (
    HISTORY_KIND,
    PREFIX_KV_KIND,
    Q_ROWS_KIND,
    ROUTER_SESSION_KIND,
    TARGET_KV_KIND,
    TOKENS_KIND,
)

if TYPE_CHECKING:
    import redis

__all__ = [
    "ADMIN",
    "DEFAULT_USER",
    "ROLES",
    "ROLE_USERS",
    "RedisAccess",
    "UsersNotPersisted",
    "acl_file_text",
    "acl_rules",
    "create_users",
    "default_user_open",
    "ensure_passwords",
    "lock_default_user",
    "namespace_of_kind",
    "persist_users",
    "redact_url",
    "writes",
]

# The default user of the ACL file: off and without any password (`resetpass` also drops `nopass`), so
# that no connection authenticates as it, on or off; with every command and key, because Redis
# replays the append-only file's transactions as this user and refuses each queued command it may
# not run (the EXEC re-check of redis/redis#14541), which would drop every multi-key script's writes
# at a restart.
DEFAULT_USER = "user default off resetpass resetkeys resetchannels ~* &* +@all"

# Namespaces of objects: one per kind this implementation names its objects with, and `other` for
# every other name (another implementation's URIs, kinds we do not create). Commit logs are not
# objects: their keys are `log:c:`, `log:cm:` (the verifiers') and `log:f:`, `log:fm:` (the routers').
Q_ROWS = Q_ROWS_KIND
TOKENS = TOKENS_KIND
TARGET_KV = TARGET_KV_KIND
PREFIX_KV = PREFIX_KV_KIND
HISTORY = HISTORY_KIND
ROUTER_SESSIONS = ROUTER_SESSION_KIND
OTHER = "other"
NAMESPACES = (Q_ROWS, TOKENS, TARGET_KV, PREFIX_KV, HISTORY, ROUTER_SESSIONS, OTHER)
COMMITS, COMMITS_META, FENCES, FENCES_META = "log:c", "log:cm", "log:f", "log:fm"

ROLES = ("router", "verifier", "drafter", "mlc")
ADMIN = "admin"
ROLE_USERS = {role: f"sdcp-{role}" for role in (*ROLES, ADMIN)}

# Every command the store sends (the scripts' own included: Redis checks each against the user).
_COMMANDS = (
    "ping", "evalsha", "eval", "script|load", "multi", "exec", "discard", "time",
    "exists", "del", "get", "set", "decrby", "hget", "hmget", "hgetall", "hstrlen", "hset", "hdel",
    "zadd", "zrange", "zrem", "pttl", "pexpire", "rpush", "lrange", "llen",
)  # fmt: skip
# What the router may do to another role's object it must clean up: the delete script's commands.
_DELETE_COMMANDS = ("evalsha", "eval", "script|load", "exists", "hstrlen", "decrby", "del", "zrem")

_WRITES: dict[str, frozenset[str]] = {
    "router": frozenset({TOKENS, ROUTER_SESSIONS, FENCES, FENCES_META}),
    "verifier": frozenset({TARGET_KV, PREFIX_KV, HISTORY, COMMITS, COMMITS_META}),
    "drafter": frozenset({Q_ROWS}),
}
_READS: dict[str, frozenset[str]] = {
    "router": frozenset({TARGET_KV, COMMITS, COMMITS_META}),
    "verifier": frozenset({Q_ROWS, TOKENS, OTHER, FENCES, FENCES_META}),
    "drafter": frozenset({TOKENS, HISTORY, OTHER}),
}
# Namespaces whose objects a role deletes but never writes (a Redis selector grants DEL, not HSET).
_DELETES: dict[str, frozenset[str]] = {"router": frozenset({TARGET_KV})}


@dataclass(frozen=True, slots=True)
class RedisAccess:
    """How a process reaches Redis besides the URL: its user and password (AUTH; the URL may carry
    them instead), TLS files for a `rediss://` URL, and the role whose user it is, which says the
    namespaces whose recency its reads may refresh (None: a user that may write every key)."""

    role: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


_KIND_NAMESPACES = {
    Q_ROWS_KIND: Q_ROWS,
    TOKENS_KIND: TOKENS,
    TARGET_KV_KIND: TARGET_KV,
    PREFIX_KV_KIND: PREFIX_KV,
    HISTORY_KIND: HISTORY,
    ROUTER_SESSION_KIND: ROUTER_SESSIONS,
}


def namespace_of_kind(kind: str | None) -> str:
    """The namespace of an object of `kind` (None: a name outside our grammar)."""
    return _KIND_NAMESPACES.get(kind or "", OTHER)


def writes(role: str | None, namespace: str) -> bool:
    """Whether `role`'s user may write the namespace; None (no role: one user for all) may."""
    if role is None or role not in _WRITES:
        return True
    return namespace in _WRITES[role]


def redact_url(url: str) -> str:
    """`url` without its user and password: for messages, and for configurations that name the
    user and the password file apart (a password in a URL is a secret wherever it is written)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, parts.query, parts.fragment))


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _pattern(prefix: str, namespace: str) -> str:
    return f"{_glob_escape(prefix)}{namespace}:*"


def acl_rules(role: str, prefix: str) -> list[str]:
    """The ACL rules of `role`'s user for the keys under `prefix` (without user name or password)."""
    base = ["resetkeys", "resetchannels", "-@all"]
    if role == ADMIN:
        return [*base, "~*", "&*", "+@all"]
    commands = [f"+{command}" for command in _COMMANDS]
    if role == "mlc":
        return [*base, *commands, f"~{_glob_escape(prefix)}*"]
    if role not in _WRITES:
        raise ValueError(f"no Redis user for role {role!r}; roles are {', '.join((*ROLES, ADMIN))}")
    keys = [f"~{_pattern(prefix, name)}" for name in sorted(_WRITES[role])]
    keys += [f"%R~{_pattern(prefix, name)}" for name in sorted(_READS[role])]
    selectors = [
        "(" + " ".join([f"~{_pattern(prefix, name)}", *(f"+{c}" for c in _DELETE_COMMANDS)]) + ")"
        for name in sorted(_DELETES.get(role, ()))
    ]
    return [*base, *commands, *keys, *selectors]


def ensure_passwords(directory: Path, roles: Iterable[str] = (*ROLES, ADMIN)) -> dict[str, str]:
    """Each role's password from `<directory>/<role>.password`, created (random, mode 0600) where
    missing, so that running `sdcp redis-acl` again keeps the instances' credentials valid."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    passwords = {}
    for role in roles:
        path = directory / f"{role}.password"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as handle:
                handle.write(secrets.token_urlsafe(32) + "\n")
        passwords[role] = path.read_text(encoding="ascii").strip()
    return passwords


def acl_file_text(passwords: Mapping[str, str], prefix: str, users: Mapping[str, str] = ROLE_USERS) -> str:
    """An ACL file (`redis-server --aclfile`) with one user per role given, named by `users`; the
    default user off and without password (`DEFAULT_USER`). Passwords are stored as their SHA-256
    (`#<hex>`), never in clear."""
    lines = [DEFAULT_USER]
    for role, password in passwords.items():
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(" ".join(["user", users[role], "on", f"#{digest}", *acl_rules(role, prefix)]))
    return "\n".join(lines) + "\n"


class UsersNotPersisted(RuntimeError):
    """The server keeps its ACL users neither in an ACL file nor in a configuration file: users
    created with ACL SETUSER are gone at its next restart."""


def create_users(
    client: redis.Redis, passwords: Mapping[str, str], prefix: str, users: Mapping[str, str] = ROLE_USERS
) -> None:
    """Create or reset each role's user on a running server with `ACL SETUSER`; `client` is a
    `redis.Redis` whose user may administer ACLs. The default user is left as it is; nothing is
    persisted (``persist_users``)."""
    for role, password in passwords.items():
        rules = acl_rules(role, prefix)
        client.execute_command("ACL", "SETUSER", users[role], "reset", "on", f">{password}", *rules)  # type: ignore[no-untyped-call]


def persist_users(client: redis.Redis) -> str:
    """Write the server's ACL users where its next start reads them: `ACL SAVE` into the ACL file of
    a server started with `aclfile`, else `CONFIG REWRITE` into its configuration file. Returns
    which ("ACL file" or "configuration file"); raises UsersNotPersisted where the server has
    neither (started with command-line options only), so that its users would not survive a restart."""
    from redis.exceptions import ResponseError

    try:
        client.execute_command("ACL", "SAVE")  # type: ignore[no-untyped-call]
        return "ACL file"
    except ResponseError:
        try:
            client.execute_command("CONFIG", "REWRITE")  # type: ignore[no-untyped-call]
            return "configuration file"
        except ResponseError as no_config_file:
            raise UsersNotPersisted(
                "the server keeps its ACL users in no file (it has neither --aclfile nor a configuration "
                "file), so they would be gone at its next restart: start redis-server with --aclfile FILE "
                "(sdcp redis-acl --acl-file writes one) or with a configuration file"
            ) from no_config_file


def default_user_open(client: redis.Redis) -> bool:
    """Whether anyone who reaches the server is its default user: the user is on and needs no password."""
    described = client.execute_command("ACL", "GETUSER", "default")  # type: ignore[no-untyped-call]
    if not described:
        return False
    # redis-py answers ACL GETUSER as a map, its keys bytes (or text with decode_responses).
    raw = described.get(b"flags", described.get("flags", []))
    flags = {flag.decode() if isinstance(flag, bytes) else flag for flag in raw}
    return "on" in flags and "nopass" in flags


def lock_default_user(client: redis.Redis) -> None:
    """Turn the default user off, without password (`DEFAULT_USER`): no connection authenticates as
    it any more. The caller must be another user: `client`'s connection is not the default user's."""
    whoami = client.execute_command("ACL", "WHOAMI")  # type: ignore[no-untyped-call]
    if (whoami.decode() if isinstance(whoami, bytes) else whoami) == "default":
        raise ValueError("the URL's user is the default user, which this would lock out: give the admin's URL")
    client.execute_command("ACL", "SETUSER", *DEFAULT_USER.split()[1:])  # type: ignore[no-untyped-call]
