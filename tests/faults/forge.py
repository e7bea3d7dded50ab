"""A test host's program that writes into a session's commit log in Redis directly, as someone
holding some role's store credentials would, bypassing every SDCP endpoint (issue #29). Prints one
JSON object.

`try` (a drafter's credentials): a forged commit record and a fence, each through the store's own
scripts and as plain Redis commands on the log's keys; says for each whether Redis refused it.

`append`: one commit record that extends the log's last commit record with tokens that are not
the reference's (each reference token with its lowest bit flipped), at the last record's epoch plus
`--epoch-ahead`, in `--writer`'s name, signed with `--cert` and `--key` where given (their
certificate on the record, as a verifier's first record of an epoch carries it).

python -m tests.faults.forge try|append --redis URL --user U --password-file F --session HEX
    [--writer URI --reference JSON --epoch-ahead N --cert F --key F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from sdcp.cache import MLC, AccessDenied, PreconditionFailed
from sdcp.cache.redis_acl import COMMITS, FENCES_META, RedisAccess
from sdcp.cache.uri import build_uri
from sdcp.protocol.digest import extend_digest
from sdcp.transport.signing import RecordSigner

PREFIX = "sdcp:mlc:"
FORGED_TOKENS = 5
# The session's verifier commits a round every few milliseconds; each try reads the log again.
APPEND_TRIES = 200


def _forged(last: dict[str, Any], reference: list[int], epoch_ahead: int, writer: str) -> dict[str, Any]:
    n = last["committed"]
    tokens = [reference[n + i] ^ 1 for i in range(FORGED_TOKENS)]
    return {
        "epoch": last["epoch"] + epoch_ahead,
        "round": last["round"] + 1,
        "emitted": tokens,
        "committed": n + len(tokens),
        "digest": extend_digest(last["digest"], tokens),
        "writer": writer,
    }


async def _refused(call: Any) -> str | None:
    """What Redis answered a refused write, or None where the write went through."""
    try:
        await call()
    except (AccessDenied, NoPermissionError) as exc:
        return str(exc)
    except ResponseError as exc:
        if "NOPERM" in str(exc) or "can't" in str(exc):
            return str(exc)
        raise
    return None


async def main(args: argparse.Namespace) -> None:
    password = args.password_file.read_text(encoding="utf-8").strip()
    access = RedisAccess(username=args.user, password=password)
    uri = build_uri("local", None, "log", args.session)
    async with MLC.from_config(redis_url=args.redis, redis_access=access) as mlc:
        log = mlc.commit_log(uri)
        if args.action == "try":
            record = {
                "epoch": 1,
                "round": 1,
                "emitted": [1],
                "committed": 1,
                "digest": b"\0" * 32,
                "writer": args.writer,
            }
            raw = aioredis.Redis.from_url(args.redis, username=args.user, password=password)
            try:
                refusals = {
                    "append": await _refused(lambda: log.append(record, '"0"')),
                    "fence": await _refused(lambda: log.fence(99)),
                    "rpush": await _refused(lambda: raw.rpush(f"{PREFIX}{COMMITS}:{uri}", b"forged")),
                    "hset": await _refused(lambda: raw.hset(f"{PREFIX}{FENCES_META}:{uri}", "fence", 99)),
                }
            finally:
                await raw.aclose()
            print(json.dumps(refusals))
            return
        sign = RecordSigner.load(args.cert, args.key).sign if args.cert is not None else None
        for _ in range(APPEND_TRIES):
            snapshot = await log.read()
            last = [record for record in snapshot.records if "emitted" in record][-1]
            forged = _forged(last, json.loads(args.reference), args.epoch_ahead, args.writer)
            body = sign(forged, True) if sign is not None else forged
            try:
                await log.append(body, snapshot.etag)
            except PreconditionFailed:
                continue  # the verifier committed a round meanwhile: forge after it
            print(json.dumps({k: forged[k] for k in ("epoch", "round", "committed", "emitted")}))
            return
        raise RuntimeError(f"no append in {APPEND_TRIES} tries")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=("try", "append"))
    parser.add_argument("--redis", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("--password-file", type=Path, required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--writer", required=True)
    parser.add_argument("--reference", default="[]")
    parser.add_argument("--epoch-ahead", type=int, default=0)
    parser.add_argument("--cert", type=Path)
    parser.add_argument("--key", type=Path)
    asyncio.run(main(parser.parse_args()))
