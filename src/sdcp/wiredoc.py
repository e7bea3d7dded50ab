"""docs/wire.md, generated from the code that reads and writes each shared object.

`python -m sdcp.wiredoc docs/wire.md` writes it; tests/test_wiredoc.py fails when the file and this
output differ, so the document cannot drift from the encodings. Every example is produced by the
function that produces the object in service (records, token lists, URIs, problems, status).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import LOG_KIND, MAX_REF_LENGTH, TOKENS_KIND
from sdcp.protocol import codec
from sdcp.protocol.messages import (
    Action,
    Alternative,
    Assignment,
    Contract,
    HistoryStatus,
    Output,
    OutputBatch,
    OutputRead,
    OutputReads,
    PassCost,
    ReadRefusal,
    Role,
    SelfDecodeRequest,
    SessionOpen,
    SessionState,
    Status,
    TokenLogprob,
    instance_path_id,
    session_path_id,
)
from sdcp.protocol.problems import BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import CommitRecord, FenceRecord, bind_record, encode_token_list, session_terms

__all__ = ["diagnostic", "render"]

# The members the draft's CDDL defines (SDCP 5.2); any other member we send is an extension.
DRAFT_MEMBERS = {
    "status": {"instance", "role", "load", "queue", "accept_milli", "cache_mbps", "ttl_ms"},
    "session-open": {"session", "epoch", "contract", "prompt", "prompt_kv", "commit_log", "resume"},
    "output": {"session", "epoch", "from", "tokens", "final", "finish"},
}
SESSION = bytes.fromhex("5f0e3a2b9c1d4e6f8a7b6c5d4e3f2a1b")
DIGEST = hashlib.sha256(b"d[5] of the example session").digest()
VERIFIER = "https://verifier-a.example:8443"
DRAFTER = "https://drafter-1.example:8443"


def diagnostic(value: Any) -> str:
    """CBOR diagnostic notation (RFC 8949 Section 8) of a value of SDCP's data model."""
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, bytes):
        return f"h'{value.hex()}'"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(diagnostic(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{diagnostic(k)}: {diagnostic(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no diagnostic notation for {type(value).__name__}")


def _example(value: Any) -> str:
    encoded = codec.encode(value)
    ordered = codec.decode(encoded)  # the map order of the deterministic encoding
    return f"```\n{diagnostic(ordered)}\n```\n\nEncoded ({len(encoded)} octets): `{encoded.hex()}`\n"


def _contract() -> Contract:
    return Contract.from_obj(
        {
            "target": hashlib.sha256(b"target weights").digest(),
            "tokenizer": hashlib.sha256(b"tokenizer").digest(),
            "rule": 1,
            "m_max": 8,
            "max_new": 128,
            "stop": [2],
            "low_rounds": 4,
            "fallback": [Action.REDUCE, Action.SWITCH, Action.FAIL],
        }
    )


def _commit_records() -> str:
    record = CommitRecord(epoch=1, round=3, emitted=(42, 7), committed=5, digest=DIGEST)
    # The verifier adds its identity, which an MLC node checks against the caller (docs/security.md),
    # and the session and its terms, which bind the record to one log (signed commit records).
    written = bind_record(record, writer=VERIFIER, session=SESSION, terms=session_terms(constraint=None, min_new=None))
    return (
        "## Commit records and fence records (SDCP 6.8)\n\n"
        "A commit log is a sequence of CBOR maps in deterministic encoding, appended conditionally "
        "(an append names the ETag of the log it last read). A commit record carries the session's "
        "epoch, the round, the tokens emitted in it, the committed length n after it and d[n]; we add "
        "`writer`, the base URI of the verifier that wrote it, `session`, the session id, and `terms`, "
        "the digest of what decides the session's tokens besides its contract and prompt "
        '(docs/interpretations.md, "Records bound to their place"); ours are signed besides (`sig`, '
        "`cert`). Replaying a log concatenates `emitted` "
        "of every commit record in order, each checked against its `committed` and `digest`; epochs "
        "never decrease along a log.\n\n" + _example(written) + "\nA fence record holds only `epoch`; after it, "
        "appends with a lower epoch fail (SDCP 6.8, 6.9):\n\n" + _example(FenceRecord(epoch=2).to_obj())
    )


def _token_lists() -> str:
    return (
        "## Token lists (SDCP 5.2 `prompt` by reference, `committed_tokens`)\n\n"
        "An MLC object holding token ids is a CBOR array of uints (each below 2^32):\n\n"
        + _example(codec.decode(encode_token_list([1, 2, 3, 4294967295])))
    )


def _q_rows() -> str:
    rows = np.array([[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 1.0, 0.0]], dtype="<f4")
    return (
        "## Draft rows (`q_rows`, SDCP 5.2)\n\n"
        "Raw octets, no CBOR: for each proposed position in order, V IEEE 754 binary32 values in "
        "little-endian order, V the target's vocabulary size. Two rows of a vocabulary of 4:\n\n"
        f"```\n{rows.tobytes().hex()}\n```\n\n"
        "We normalise each row before use (docs/interpretations.md) and refuse a proposal whose "
        "token has q = 0 in its row with `sdcp-bad-proposal`.\n"
    )


def _kv() -> str:
    import torch

    from sdcp.models.hf.kvblob import encode_kv

    layer = (torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    blob = encode_kv(hashlib.sha256(b"target weights").digest(), [5, 6, 7], [layer])
    length = int.from_bytes(blob[:4], "big")
    header = codec.decode(blob[4 : 4 + length])
    return (
        "## Target KV (`prompt_kv`, `resume.target_kv`) and draft KV (`draft_kv`)\n\n"
        "A published target KV is `uint32 big-endian header length || header || safetensors "
        "payload`; the header is a deterministic CBOR map, the payload holds `layer.<i>.keys` and "
        "`layer.<i>.values` as float32 (kv_heads, cached, head_dim). A header:\n\n"
        f"```\n{diagnostic(header)}\n```\n\n"
        "A blob that does not match the loaded model or the committed tokens is not used: the "
        "verifier prefills instead. We publish no `draft_kv` and ignore it on receipt.\n"
    )


def _uris() -> str:
    mlc = MLC.from_config(authority="cache.example:7000")
    assignment = Assignment(
        session=SESSION,
        epoch=1,
        contract=_contract(),
        verifier=VERIFIER,
        drafter=DRAFTER,
        prompt=(1, 2, 3),
        round=0,
        committed=0,
        digest=DIGEST,
        m_init=4,
    )
    from sdcp.engines.drafter import q_rows_uri

    examples = [
        ("commit log (the router)", build_uri(mlc.authority, None, LOG_KIND, SESSION.hex())),
        ("committed tokens (the router)", build_uri(mlc.authority, None, TOKENS_KIND, f"{SESSION.hex()}-5")),
        ("draft rows of round 4 (the drafter)", q_rows_uri(mlc, assignment, 4)),
    ]
    listed = "\n".join(f"- {what}: `{uri}`" for what, uri in examples)
    return (
        "## Object names (`cache-ref`, SDCP 5.2)\n\n"
        f"On receipt, any absolute URI (RFC 3986) of at most {MAX_REF_LENGTH} characters names an "
        "object; its authority picks the MLC that serves it (`[mlc.authorities]`, docs/deploy.md). "
        "The names we create are `mlc://<authority>/<scope>/<kind>/<name>`: scope is the contract's "
        "16-byte `scope` as 32 lowercase hex digits or `-`, kind `[a-z0-9][a-z0-9_-]*`, name "
        "`[A-Za-z0-9._~-]+`.\n\n" + listed + "\n"
    )


def _problems() -> str:
    state = SessionState(session=SESSION, epoch=1, round=3, committed=5, digest=DIGEST, state=Action.CONTINUE)
    stale = ProtocolError(ProblemType.STALE_BASE, "base 3 is not the committed length 5", state=state)
    malformed = BadMessage("proposal: member 'tokens' must be an array of uint")
    return (
        "## Problem bodies (SDCP 5.1, Table 2, RFC 9457)\n\n"
        "`application/problem+json`. The type is `urn:ietf:params:sdcp:problem:<suffix>`; on receipt "
        "a type ending in `:<suffix>` or `/<suffix>` is recognised. `sdcp-stale-base` carries the "
        "session-state as `session_state`, the unpadded base64url of its CBOR encoding; we accept "
        "its absence (docs/interpretations.md).\n\n"
        f"```json\n{json.dumps(stale.to_problem(), indent=1)}\n```\n\n"
        "whose `session_state` decodes to\n\n" + _example(state.to_obj()) + "\nA malformed message:\n\n"
        f"```json\n{json.dumps(malformed.to_problem(), indent=1)}\n```\n"
    )


def _members(title: str, cddl: str, examples: list[Any]) -> str:
    draft = DRAFT_MEMBERS[cddl]
    sent = sorted({member for example in examples for member in example.to_obj()})
    extensions = [member for member in sent if member not in draft]
    text = (
        f"## {title}\n\n"
        f"Members of the draft: {', '.join(f'`{m}`' for m in sorted(draft))}. Extensions we send "
        f"(ignored by receivers that do not know them, SDCP 5.2; each optional on receipt): "
        f"{', '.join(f'`{m}`' for m in extensions) or 'none'}.\n\n"
    )
    return text + "\n".join(_example(example.to_obj()) for example in examples)


def _status() -> str:
    verifier = Status(
        instance=VERIFIER,
        role=Role.VERIFIER,
        load=35,
        queue=2,
        ttl_ms=3000,
        model=hashlib.sha256(b"target weights").digest(),
        tokenizer=hashlib.sha256(b"tokenizer").digest(),
        self_us=16000,
        pass_us=tuple(
            PassCost(rows=rows, us=us)
            for rows, us in ((1, 6600), (2, 13500), (4, 18800), (8, 28100), (16, 47600), (32, 89500))
        ),
        pass_sessions=3,
        pass_apart=True,
    )
    drafter = Status(
        instance=DRAFTER,
        role=Role.DRAFTER,
        load=10,
        queue=0,
        accept_milli=640,
        cache_mbps=900,
        ttl_ms=3000,
        model=hashlib.sha256(b"drafter weights").digest(),
        alpha_milli=720,
        alpha_constrained_milli=930,
        draft_us=900,
        verify_us=61000,
        history=HistoryStatus(sessions=371, tokens=130543, max_tokens=131072),
    )
    paths = (
        f"`PUT instances/{{id}}/status`: we send `{{id}}` = the unpadded base64url of the instance's base "
        f"URI (`{instance_path_id(VERIFIER)}`) and accept any other id; session paths use the "
        f"base64url of the session id (`sessions/{session_path_id(SESSION)}`, SDCP 5.1).\n\n"
    )
    return _members("Status reports (SDCP 5.2)", "status", [verifier, drafter]) + "\n" + paths


def _session_open() -> str:
    opened = SessionOpen(
        session=SESSION,
        epoch=1,
        contract=_contract(),
        prompt=(1, 2, 3),
        commit_log=build_uri("cache.example:7000", None, LOG_KIND, SESSION.hex()),
        owner="https://gateway.example:8443",
        logprobs=1,
        min_new=4,
    )
    request = SelfDecodeRequest(session=SESSION, epoch=1)
    return (
        _members("Session-open (SDCP 5.2)", "session-open", [opened])
        + "\n`POST sessions/{id}/self-decode` (not in Table 1) is our router's request that the verifier "
        "decode alone; another router never sends it:\n\n" + _example(request.to_obj())
    )


def _output() -> str:
    output = Output(
        session=SESSION,
        epoch=2,
        from_=7,
        tokens=(791, 2),
        final=True,
        finish=Action.FINISH,
        logprobs=(
            TokenLogprob(),
            TokenLogprob(logprob=-105360, top=(Alternative(token=2, logprob=-105360),)),
        ),
    )
    other = bytes(range(16, 32))
    reads = OutputReads(reads=(OutputRead(session=SESSION, from_=7), OutputRead(session=other, from_=0)))
    refusal = ProtocolError(ProblemType.STALE_EPOCH, "session epoch is 3, not 2").to_problem()
    batch = OutputBatch(
        outputs=(replace(output, logprobs=None),),
        refused=(ReadRefusal(session=other, type=refusal["type"], status=refusal["status"], detail=refusal["detail"]),),
    )
    return (
        _members("Output (SDCP 5.2, 6.7)", "output", [output])
        + "\n`logprobs`, sent when the session-open asked for it, holds one map per token: its natural "
        "log-probability under the target's unprocessed distribution in millionths (`logprob`) and the "
        "session-open's `logprobs` most probable tokens (`top`), both absent for a token committed "
        "before a failover.\n\n"
        "`POST outputs` (not in Table 1, docs/interpretations.md) reads several sessions' output in one "
        "request; our front ends send it to our verifiers, and read another's one GET a session:\n\n"
        + _example(reads.to_obj())
        + "\nanswered with the reads that have news, each output as its GET would answer it, each refusal "
        "with its GET's problem:\n\n" + _example(batch.to_obj())
    )


def render() -> str:
    sections = [
        _commit_records(),
        _token_lists(),
        _q_rows(),
        _kv(),
        _uris(),
        _problems(),
        _status(),
        _session_open(),
        _output(),
    ]
    head = (
        "# Wire formats\n\n"
        "The encodings two SDCP implementations must share beyond the draft's CDDL, each with an "
        "example in CBOR diagnostic notation (RFC 8949 Section 8) and its deterministic encoding. "
        "Generated by `python -m sdcp.wiredoc docs/wire.md` from the code that writes each object; "
        "a test fails when this file differs. Choices behind them: docs/interpretations.md.\n\n"
    )
    return head + "\n".join(sections)


if __name__ == "__main__":
    output = render()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(output, encoding="utf-8")
    else:
        sys.stdout.write(output)
