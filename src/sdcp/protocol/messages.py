"""SDCP messages (SDCP 4.1, 5.2): one frozen dataclass per CDDL type.

Fields carry the CDDL member names (`Output.from_` stands for the key "from", a Python keyword);
`None` means "absent". Every instance is validated on construction, whether built from decoded CBOR
or directly, and every violation raises a `ProtocolError`: `BadContract` for anything inside a
contract, `BadMessage` elsewhere.
"""

from __future__ import annotations

import contextvars
import enum
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

from sdcp.protocol import codec
from sdcp.protocol.contract import digest_of_encoded_contract
from sdcp.protocol.problems import BadContract, BadMessage, ProtocolError

__all__ = [
    "CancelRequest",
    "LADDER_ACTIONS",
    "LOAD_MAX",
    "TOKEN_MAX",
    "UINT_MAX",
    "MAX_LOGIT_BIAS",
    "MAX_REPORTED_PREFIXES",
    "MAX_TOP_LOGPROBS",
    "Action",
    "Alternative",
    "Assignment",
    "CONSTRAINT_KINDS",
    "Constraint",
    "Contract",
    "Event",
    "HistoryStatus",
    "PassCost",
    "Output",
    "MAX_OUTPUT_READS",
    "OutputBatch",
    "OutputRead",
    "OutputReads",
    "ReadRefusal",
    "Policy",
    "Proposal",
    "SelfDecodeRequest",
    "Resume",
    "Role",
    "Sampling",
    "SessionOpen",
    "SessionRequest",
    "SessionState",
    "Status",
    "TokenLogprob",
    "Verdict",
    "parse_session_path_id",
    "session_path_id",
]

UINT_MAX = 2**64 - 1
# A load (a status's, a verdict's, a contract's self_load) is a percentage (SDCP 5.2).
LOAD_MAX = 100
# Token ids enter the digest chain as uint32 (SDCP 4.2).
TOKEN_MAX = 2**32 - 1
HASH_SIZE = 32
SESSION_ID_SIZE = 16
SCOPE_SIZE = 16
# The most alternatives per token an output's log-probabilities carry (as vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20
# The languages a session-open's constraint may name (docs/interpretations.md, "Structured output"),
# and the longest text that defines one (a JSON schema, a regular expression, a grammar).
CONSTRAINT_KINDS = frozenset({"json_schema", "regex", "choice", "lark"})
MAX_CONSTRAINT_TEXT = 128 * 1024
# The sampling profile's extension members that shape p (docs/interpretations.md, "Penalties,
# logit_bias and min_p"): OpenAI's ranges, in thousandths as the draft's own members.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_MILLI = 100_000
PENALTY_MILLI = 2000

ErrorFactory = Callable[[str], ProtocolError]


class Action(enum.IntEnum):
    """The action values of SDCP 4.1."""

    CONTINUE = 0
    REDUCE = 1
    SWITCH = 2
    SELF_DECODE = 3
    FINISH = 4
    FAIL = 5

    @classmethod
    def parse(cls, value: int) -> Action:
        """The action `value` names; an unknown value reads as FAIL (SDCP 5.2)."""
        try:
            return cls(value)
        except ValueError:
            return cls.FAIL


# SDCP 6.5.2: the fallback list contains only reduce, switch, self_decode and fail.
LADDER_ACTIONS = frozenset({Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FAIL})


class Role(enum.IntEnum):
    """The role member of a status message (SDCP 5.2)."""

    DRAFTER = 1
    VERIFIER = 2


_MEMBERS: dict[type, tuple[tuple[str, str, _Kind, bool], ...]] = {}


def _members_of(cls: type) -> tuple[tuple[str, str, _Kind, bool], ...]:
    # A message is built for every round and every output read: its members are read once a class.
    members = _MEMBERS.get(cls)
    if members is None:
        members = _MEMBERS[cls] = tuple(
            (f.name, f.metadata["key"] or f.name, f.metadata["kind"], f.metadata["required"])
            for f in fields(cls)
            if "kind" in f.metadata
        )
    return members


@dataclass(frozen=True)
class _Context:
    """How a member is judged: which error it raises and whether unknown keys are refused."""

    error: ErrorFactory
    strict: bool


class _Kind(ABC):
    """The CDDL type of one member: validates a value and renders it in the CBOR data model."""

    @abstractmethod
    def parse(self, value: object, ctx: _Context, where: str) -> Any: ...

    def dump(self, value: Any) -> object:
        return value


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python but a distinct CBOR type.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class _UInt(_Kind):
    low: int = 0
    high: int = UINT_MAX

    def parse(self, value: object, ctx: _Context, where: str) -> int:
        if not _is_int(value):
            raise ctx.error(f"{where} must be an unsigned integer, not {type(value).__name__}")
        assert isinstance(value, int)
        if not self.low <= value <= self.high:
            raise ctx.error(f"{where} = {value} is outside [{self.low}, {self.high}]")
        return int(value)

    def dump(self, value: Any) -> object:
        return int(value)

    def holds_every(self, values: Sequence[object]) -> bool:
        """Whether every one of ``values`` is a plain integer in range (what parse accepts as it is)."""
        return codec.integers_within(values, self.low, self.high)


@dataclass(frozen=True)
class _Int(_UInt):
    """A signed integer in [low, high]."""

    def parse(self, value: object, ctx: _Context, where: str) -> int:
        if not _is_int(value):
            raise ctx.error(f"{where} must be an integer, not {type(value).__name__}")
        return super().parse(value, ctx, where)


@dataclass(frozen=True)
class _Bytes(_Kind):
    size: int

    def parse(self, value: object, ctx: _Context, where: str) -> bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise ctx.error(f"{where} must be a byte string, not {type(value).__name__}")
        if len(value) != self.size:
            raise ctx.error(f"{where} must be {self.size} bytes, not {len(value)}")
        return bytes(value)


class _Text(_Kind):
    def parse(self, value: object, ctx: _Context, where: str) -> str:
        if not isinstance(value, str):
            raise ctx.error(f"{where} must be a text string, not {type(value).__name__}")
        return value


@dataclass(frozen=True)
class _ShortText(_Text):
    """Printable ASCII text of at most ``most`` characters (it goes into log lines)."""

    most: int

    def parse(self, value: object, ctx: _Context, where: str) -> str:
        text = super().parse(value, ctx, where)
        if not 0 < len(text) <= self.most or not text.isascii() or not text.isprintable():
            raise ctx.error(f"{where} must be 1 to {self.most} printable ASCII characters")
        return text


@dataclass(frozen=True)
class _OneOf(_Text):
    """A text that is one of ``values``."""

    values: frozenset[str]

    def parse(self, value: object, ctx: _Context, where: str) -> str:
        text = super().parse(value, ctx, where)
        if text not in self.values:
            raise ctx.error(f"{where} = {text!r} is not one of {', '.join(sorted(self.values))}")
        return text


@dataclass(frozen=True)
class _BoundedText(_Text):
    """A text of at most ``most`` characters."""

    most: int

    def parse(self, value: object, ctx: _Context, where: str) -> str:
        text = super().parse(value, ctx, where)
        if len(text) > self.most:
            raise ctx.error(f"{where} holds {len(text)} characters, more than {self.most}")
        return text


class _Bool(_Kind):
    def parse(self, value: object, ctx: _Context, where: str) -> bool:
        if not isinstance(value, bool):
            raise ctx.error(f"{where} must be a boolean, not {type(value).__name__}")
        return value


@dataclass(frozen=True)
class _Array(_Kind):
    item: _Kind
    non_empty: bool = False
    max_items: int | None = None

    def parse(self, value: object, ctx: _Context, where: str) -> tuple[Any, ...]:
        if not isinstance(value, (list, tuple)):
            raise ctx.error(f"{where} must be an array, not {type(value).__name__}")
        if self.non_empty and not value:
            raise ctx.error(f"{where} must not be empty")
        if self.max_items is not None and len(value) > self.max_items:
            raise ctx.error(f"{where} holds {len(value)} items, at most {self.max_items}")
        item = self.item
        # Token lists are most of what the roles parse: checked in one go where every item is a
        # plain integer in range, item by item (naming the first bad one) otherwise.
        if isinstance(item, _UInt) and item.holds_every(value):
            return tuple(value)
        return tuple(item.parse(entry, ctx, f"{where}[{i}]") for i, entry in enumerate(value))

    def dump(self, value: Any) -> object:
        return [self.item.dump(item) for item in value]


class _ActionKind(_Kind):
    def parse(self, value: object, ctx: _Context, where: str) -> Action:
        return Action.parse(_UINT.parse(value, ctx, where))

    def dump(self, value: Any) -> object:
        return int(value)


class _LadderEntry(_Kind):
    """A fallback entry; an unknown value is kept as given (it reads as fail) for the round trip."""

    def parse(self, value: object, ctx: _Context, where: str) -> Action | int:
        number = _UINT.parse(value, ctx, where)
        if number not in Action.__members__.values():
            return number
        action = Action(number)
        if action not in LADDER_ACTIONS:
            raise ctx.error(f"{where} = {action.name.lower()} is not allowed in the fallback list")
        return action

    def dump(self, value: Any) -> object:
        return int(value)


@dataclass(frozen=True)
class _IntEnumKind(_Kind):
    enum_type: type[enum.IntEnum]

    def parse(self, value: object, ctx: _Context, where: str) -> enum.IntEnum:
        number = _UINT.parse(value, ctx, where)
        try:
            return self.enum_type(number)
        except ValueError:
            allowed = ", ".join(str(int(m)) for m in self.enum_type)
            raise ctx.error(f"{where} = {number} is not one of {allowed}") from None

    def dump(self, value: Any) -> object:
        return int(value)


class _Prompt(_Kind):
    """`[* uint] / cache-ref`: a token list or the URI of an MLC object."""

    def parse(self, value: object, ctx: _Context, where: str) -> tuple[int, ...] | str:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)):
            return _TOKENS.parse(value, ctx, where)
        raise ctx.error(f"{where} must be a token array or a cache-ref, not {type(value).__name__}")

    def dump(self, value: Any) -> object:
        return value if isinstance(value, str) else list(value)


@dataclass(frozen=True)
class _Nested(_Kind):
    message_type: type[_Message]

    def parse(self, value: object, ctx: _Context, where: str) -> _Message:
        if isinstance(value, self.message_type):
            return value
        return self.message_type._parse(value, ctx, where)

    def dump(self, value: Any) -> object:
        return value.to_obj()


@dataclass(frozen=True)
class _Ignorable(_Kind):
    """An extension member that a receiver reads as absent where it is not in our form: the draft
    does not define it, so another implementation may send a member of that name meaning something
    else, and SDCP 5.2 has unknown map keys ignored, not refused (docs/interpretations.md)."""

    kind: _Kind

    def parse(self, value: object, ctx: _Context, where: str) -> Any:
        try:
            return self.kind.parse(value, ctx, where)
        except ProtocolError:
            return None

    def dump(self, value: Any) -> object:
        return self.kind.dump(value)


@dataclass(frozen=True)
class _LogitBias(_Kind):
    """``[* [token: uint, bias_milli: int]]``, tokens in ascending order, each once: one encoding
    per bias, so that every party computes the same contract digest."""

    def parse(self, value: object, ctx: _Context, where: str) -> tuple[tuple[int, int], ...]:
        if not isinstance(value, (list, tuple)):
            raise ctx.error(f"{where} must be an array, not {type(value).__name__}")
        if len(value) > MAX_LOGIT_BIAS:
            raise ctx.error(f"{where} holds {len(value)} entries, more than {MAX_LOGIT_BIAS}")
        entries: list[tuple[int, int]] = []
        for index, entry in enumerate(value):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise ctx.error(f"{where}[{index}] must be [token, bias_milli]")
            token = _TOKEN.parse(entry[0], ctx, f"{where}[{index}][0]")
            bias = _BIAS.parse(entry[1], ctx, f"{where}[{index}][1]")
            if entries and token <= entries[-1][0]:
                raise ctx.error(f"{where} must list each token once, in ascending order")
            entries.append((token, bias))
        return tuple(entries)

    def dump(self, value: Any) -> object:
        return [[token, bias] for token, bias in value]


_UINT = _UInt()
_TOKEN = _UInt(high=TOKEN_MAX)
_TOKENS = _Array(_TOKEN)
_TEXT = _Text()
_HASH = _Bytes(HASH_SIZE)
# Prefix names a verifier's status report carries at most (Status.prefixes).
MAX_REPORTED_PREFIXES = 64
# A verifier's pass costs (Status.pass_us): points at most, and the rows of a point at most.
MAX_PASS_POINTS = 16
MAX_PASS_ROWS = 4096
_SESSION = _Bytes(SESSION_ID_SIZE)
_ACTION = _ActionKind()
_REQUEST_ID = _ShortText(128)
# Extension: whose history a session shares (docs/interpretations.md, "Tenants"): opaque to roles.
_TENANT = _ShortText(128)
_BIAS = _Int(low=-LOGIT_BIAS_MILLI, high=LOGIT_BIAS_MILLI)
# A natural logarithm of a probability in millionths (SDCP bodies carry no floats).
_LOGPROB = _Int(low=-(2**63), high=0)


def _required(kind: _Kind, *, key: str | None = None) -> Any:
    return field(metadata={"kind": kind, "required": True, "key": key})


def _optional(kind: _Kind, *, key: str | None = None) -> Any:
    return field(default=None, metadata={"kind": kind, "required": False, "key": key})


# Set while `_Message._parse` makes a message of members it has parsed (per thread and task).
_MEMBERS_PARSED: contextvars.ContextVar[bool] = contextvars.ContextVar("members_parsed", default=False)


class _Message:
    """Shared behaviour of the message dataclasses: validation, CBOR data model, codec."""

    # The error a violation raises and whether unknown keys are refused, when no enclosing
    # message decides (a sampling profile inside a contract is judged as part of the contract).
    _ERROR: ClassVar[ErrorFactory] = BadMessage
    _STRICT: ClassVar[bool] = False
    # True where the class always judges itself by its own rules, whatever encloses it.
    _OWN_RULES: ClassVar[bool] = False

    @classmethod
    def _members(cls) -> tuple[tuple[str, str, _Kind, bool], ...]:
        """(attribute, CBOR key, kind, required) of each member, in CDDL order."""
        return _members_of(cls)

    @classmethod
    def _own_context(cls) -> _Context:
        return _Context(cls._ERROR, cls._STRICT)

    def __post_init__(self) -> None:
        if _MEMBERS_PARSED.get():
            return
        ctx = self._own_context()
        name = type(self).__name__
        for attribute, key, kind, required in self._members():
            value = getattr(self, attribute)
            if value is None:
                if required:
                    raise ctx.error(f"{name} lacks the required member '{key}'")
                continue
            object.__setattr__(self, attribute, kind.parse(value, ctx, f"{name}.{key}"))

    @classmethod
    def _parse(cls, obj: object, ctx: _Context, where: str) -> Self:
        if cls._OWN_RULES:
            ctx = cls._own_context()
        if not isinstance(obj, dict):
            raise ctx.error(f"{where} must be a map, not {type(obj).__name__}")
        members = cls._members()
        if ctx.strict:
            known = {key for _, key, _, _ in members}
            unknown = sorted(repr(key) for key in obj if key not in known)
            if unknown:
                raise ctx.error(f"{where} has unknown members {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for attribute, key, kind, required in members:
            if key in obj:
                values[attribute] = kind.parse(obj[key], ctx, f"{where}.{key}")
            elif required:
                raise ctx.error(f"{where} lacks the required member '{key}'")
        # Each member was parsed just now, under the rules of what encloses it: __post_init__ need
        # not parse it again under the message's own (half of what parsing a message cost).
        parsed = _MEMBERS_PARSED.set(True)
        try:
            return cls(**values)
        finally:
            _MEMBERS_PARSED.reset(parsed)

    @classmethod
    def computed(cls, **values: Any) -> Self:
        """A message whose members its maker computed itself from the state it holds (a verifier's
        verdict of its own round), built without judging each member again: that took a quarter of
        deciding a self-decoded round on the event loop. Never for what a peer or a user sent."""
        if cls.__post_init__ is not _Message.__post_init__:
            raise TypeError(f"{cls.__name__} does more than validate when built: build it as usual")
        trusted = _MEMBERS_PARSED.set(True)
        try:
            return cls(**values)
        finally:
            _MEMBERS_PARSED.reset(trusted)

    @classmethod
    def from_obj(cls, obj: object) -> Self:
        """Validate a decoded CBOR data item; unknown keys are ignored except in a contract."""
        return cls._parse(obj, cls._own_context(), cls.__name__)

    def to_obj(self) -> dict[str, object]:
        """The CBOR data model of this message, absent optional members omitted."""
        return {
            key: kind.dump(getattr(self, attribute))
            for attribute, key, kind, _ in self._members()
            if getattr(self, attribute) is not None
        }

    @classmethod
    def from_cbor(cls, data: bytes) -> Self:
        return cls.from_obj(codec.decode(data))

    def to_cbor(self) -> bytes:
        return codec.encode(self.to_obj())


@dataclass(frozen=True, kw_only=True)
class Sampling(_Message):
    """The sampling profile (SDCP 4.1), and our extension members that shape the target distribution
    further (docs/interpretations.md, "Penalties, logit_bias and min_p"): all in thousandths, as the
    draft's own; a penalty's neutral value is absent."""

    temperature_milli: int | None = _optional(_UINT)
    top_k: int | None = _optional(_UINT)
    top_p_milli: int | None = _optional(_UInt(high=1000))
    seed: int | None = _optional(_UINT)
    # Extensions (sdcp.protocol.shaping): OpenAI's presence and frequency penalties, vLLM's
    # repetition penalty (1000 is none), OpenAI's logit_bias, vLLM's min_p.
    presence_penalty_milli: int | None = _optional(_Int(low=-PENALTY_MILLI, high=PENALTY_MILLI))
    frequency_penalty_milli: int | None = _optional(_Int(low=-PENALTY_MILLI, high=PENALTY_MILLI))
    repetition_penalty_milli: int | None = _optional(_UInt(low=1))
    logit_bias_milli: tuple[tuple[int, int], ...] | None = _optional(_LogitBias())
    min_p_milli: int | None = _optional(_UInt(high=1000))


@dataclass(frozen=True, kw_only=True)
class Contract(_Message):
    """The immutable session contract (SDCP 4.1).

    Its digest is computed over the contract as it was created or received, never over a
    re-serialisation, so that every party hashes the same bytes.
    """

    # SDCP 4.1: anything wrong in a contract, an unknown key included, is sdcp-bad-contract.
    _ERROR: ClassVar[ErrorFactory] = BadContract
    _STRICT: ClassVar[bool] = True
    _OWN_RULES: ClassVar[bool] = True

    target: bytes = _required(_HASH)
    tokenizer: bytes = _required(_HASH)
    drafters: tuple[bytes, ...] | None = _optional(_Array(_HASH, non_empty=True))
    rule: int = _required(_UINT)
    sampling: Sampling | None = _optional(_Nested(Sampling))
    # SDCP 6.5.1 requires 1 <= m_cap <= m_max, so m_max 0 leaves no valid m_cap.
    m_max: int = _required(_UInt(low=1, high=64))
    max_new: int = _required(_UINT)
    stop: tuple[int, ...] = _required(_TOKENS)
    low_rounds: int = _required(_UInt(low=1))
    low_ratio: int | None = _optional(_UInt(high=100))
    fallback: tuple[Action | int, ...] = _required(_Array(_LadderEntry(), non_empty=True))
    self_load: int | None = _optional(_UInt(high=LOAD_MAX))
    self_max: int | None = _optional(_UINT)
    scope: bytes | None = _optional(_Bytes(SCOPE_SIZE))
    _encoded: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _MEMBERS_PARSED.get():
            # A parsed contract keeps the encoding of what it was parsed from (_parse).
            object.__setattr__(self, "_encoded", codec.encode(self.to_obj()))

    @classmethod
    def _parse(cls, obj: object, ctx: _Context, where: str) -> Self:
        contract = super()._parse(obj, ctx, where)
        object.__setattr__(contract, "_encoded", codec.encode(obj))
        return contract

    @classmethod
    def from_cbor(cls, data: bytes) -> Self:
        """Decode a contract that must already be in deterministic encoding."""
        try:
            obj = codec.decode_deterministic(data)
        except BadMessage as exc:
            raise BadContract(f"contract: {exc.detail}") from exc
        return cls.from_obj(obj)

    @property
    def encoded(self) -> bytes:
        """Deterministic CBOR of the contract as created: the input to its digest."""
        return self._encoded

    @functools.cached_property
    def digest(self) -> bytes:
        """contract_digest of SDCP 4.1."""
        return digest_of_encoded_contract(self._encoded)

    @property
    def ladder(self) -> tuple[Action, ...]:
        """The fallback list as actions; an unknown value reads as fail (SDCP 5.2)."""
        return tuple(Action.parse(entry) for entry in self.fallback)


@dataclass(frozen=True, kw_only=True)
class Resume(_Message):
    """The `resume` member of session-open, present on failover (SDCP 5.2, 6.9)."""

    round: int = _required(_UINT)
    committed: int = _required(_UINT)
    digest: bytes = _required(_HASH)
    committed_tokens: str = _required(_TEXT)
    target_kv: str | None = _optional(_TEXT)


@dataclass(frozen=True, kw_only=True)
class Constraint(_Message):
    """Extension (docs/interpretations.md, "Structured output"): the language the output must be a
    prefix of, part of the session's target distribution: every position's distribution is the
    target's restricted to the tokens that keep the output in the language, renormalised."""

    kind: str = _required(_OneOf(CONSTRAINT_KINDS))
    text: str = _required(_BoundedText(MAX_CONSTRAINT_TEXT))


@dataclass(frozen=True, kw_only=True)
class SessionOpen(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    contract: Contract = _required(_Nested(Contract))
    prompt: tuple[int, ...] | str = _required(_Prompt())
    prompt_kv: str | None = _optional(_TEXT)
    commit_log: str = _required(_TEXT)
    resume: Resume | None = _optional(_Nested(Resume))
    # Extension (docs/interpretations.md): the front end that opened the session at the router, which
    # may then read its output and stats at the verifier (docs/security.md).
    owner: str | None = _optional(_TEXT)
    # Extensions (docs/interpretations.md): the output carries log-probabilities with this many
    # alternatives per token; the contract's stop tokens cannot be emitted before output index min_new.
    logprobs: int | None = _optional(_UInt(high=MAX_TOP_LOGPROBS))
    min_new: int | None = _optional(_UINT)
    # Extension: the front end's request id, for the logs of every role (docs/interpretations.md).
    request: str | None = _optional(_REQUEST_ID)
    # Extension: the output's language, part of the target distribution (structured output).
    constraint: Constraint | None = _optional(_Nested(Constraint))
    # Extension: the front end asked for no speculation; the router assigns no drafter and has the
    # verifier decode alone (docs/interpretations.md, "Per-request speculation").
    self_decode_only: bool | None = _optional(_Bool())
    # Extension: the front end's user of the session, within the owner: history never crosses
    # tenants (docs/interpretations.md, "Tenants").
    tenant: str | None = _optional(_TENANT)
    # Extension: the router's self-decode request, made with the open: a self-decoding period
    # starts as soon as the prompt is prefilled (docs/interpretations.md, "Self-decoding from the
    # open").
    self_decode: bool | None = _optional(_Bool())
    # Extension: the most time apart, in ms, the front end takes the session's self-decoded rounds
    # past their first group (0: in the verifier's shortest groups), where it matches stop strings
    # in the text (docs/interpretations.md, "Self-decoded groups a front end asks for"). Any uint:
    # the verifier takes the smaller of it and its own setting.
    self_decode_group_ms: int | None = _optional(_UINT)


@dataclass(frozen=True, kw_only=True)
class SessionRequest(_Message):
    """The body of the router's client API ``POST sessions`` (not in the draft, SDCP 1.4)."""

    prompt: tuple[int, ...] = _required(_Array(_TOKEN, non_empty=True))
    contract: Contract = _required(_Nested(Contract))
    sampling: Sampling | None = _optional(_Nested(Sampling))
    # Passed on in session-open (docs/interpretations.md).
    logprobs: int | None = _optional(_UInt(high=MAX_TOP_LOGPROBS))
    min_new: int | None = _optional(_UINT)
    request: str | None = _optional(_REQUEST_ID)
    constraint: Constraint | None = _optional(_Nested(Constraint))
    self_decode_only: bool | None = _optional(_Bool())
    tenant: str | None = _optional(_TENANT)
    self_decode_group_ms: int | None = _optional(_UINT)


@dataclass(frozen=True, kw_only=True)
class SessionState(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    round: int = _required(_UINT)
    committed: int = _required(_UINT)
    digest: bytes = _required(_HASH)
    state: int | None = _optional(_UINT)


@dataclass(frozen=True, kw_only=True)
class Assignment(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    contract: Contract = _required(_Nested(Contract))
    verifier: str = _required(_TEXT)
    drafter: str = _required(_TEXT)
    prompt: tuple[int, ...] | str = _required(_Prompt())
    round: int = _required(_UINT)
    sampling: Sampling | None = _optional(_Nested(Sampling))
    committed: int = _required(_UINT)
    digest: bytes = _required(_HASH)
    committed_tokens: str | None = _optional(_TEXT)
    m_init: int = _required(_UINT)
    # Extension (docs/interpretations.md): the front end that opened the session, as session-open's
    # owner, so that a suffix drafter drafts from that front end's finished sessions only.
    owner: str | None = _optional(_TEXT)
    # Extension: session-open's constraint, so that a drafter proposes the tokens it forces at full
    # confidence and nothing it disallows (structured output).
    constraint: Constraint | None = _optional(_Nested(Constraint))
    # Extension: session-open's tenant, which with the owner names the history drafts come from.
    tenant: str | None = _optional(_TENANT)


@dataclass(frozen=True, kw_only=True)
class HistoryStatus(_Message):
    """Extension (docs/interpretations.md): what a drafter's shared history of finished sessions'
    output holds, and its bound, in tokens."""

    sessions: int = _required(_UINT)
    tokens: int = _required(_UINT)
    max_tokens: int = _required(_UINT)


@dataclass(frozen=True, kw_only=True)
class PassCost(_Message):
    """Extension (docs/interpretations.md, "Pass costs in status reports"): what a verifier's pass
    of ``rows`` rows costs it, as it measures now, in microseconds."""

    rows: int = _required(_UInt(low=1, high=MAX_PASS_ROWS))
    us: int = _required(_UINT)


@dataclass(frozen=True, kw_only=True)
class Status(_Message):
    instance: str = _required(_TEXT)
    role: Role = _required(_IntEnumKind(Role))
    load: int = _required(_UInt(high=LOAD_MAX))
    queue: int = _required(_UINT)
    accept_milli: int | None = _optional(_UInt(high=1000))
    cache_mbps: int | None = _optional(_UINT)
    ttl_ms: int = _required(_UINT)
    # Extension member (docs/interpretations.md): the drafter's model digest, so that the router
    # can tell which drafters a contract permits (SDCP 6.1). Receivers that do not know it ignore it.
    model: bytes | None = _optional(_HASH)
    # Extension member: a verifier's tokenizer digest, so that the router can tell clients which
    # contract (target, tokenizer) each verifier serves (SDCP 4.1, 6.1). Ignored by other receivers.
    tokenizer: bytes | None = _optional(_HASH)
    # Extension members: the SDCP 6.2 terms the instance measured, so that the router can rank
    # drafters by expected rate (docs/interpretations.md, "Cost terms in status reports"). A
    # drafter's per-token acceptance (thousandths), time to draft one token, and time from
    # proposal to verdict; a verifier's time per self-decoded token (microseconds).
    alpha_milli: int | None = _optional(_UInt(high=1000))
    # Extension member: a drafter's per-token acceptance (thousandths) on constrained sessions
    # (structured output: session-open's `constraint`), measured apart from `alpha_milli`, which
    # then covers the other sessions: a drafter that proposes what a grammar forces is accepted far
    # more often there, one that does not far less (docs/interpretations.md, "Cost terms in status
    # reports").
    alpha_constrained_milli: int | None = _optional(_UInt(high=1000))
    draft_us: int | None = _optional(_UINT)
    verify_us: int | None = _optional(_UINT)
    self_us: int | None = _optional(_UINT)
    # Extension member: the most positions (prompt plus output) a verifier holds for a session, so
    # that a front end sizes its requests to the target it uses (docs/interpretations.md).
    context: int | None = _optional(_UINT)
    # Extension member: a drafter's shared history (HistoryStatus), for operators and capacity
    # planning; no receiver acts on it, and one in another form is read as absent.
    history: HistoryStatus | None = _optional(_Ignorable(_Nested(HistoryStatus)))
    # Extension members (docs/interpretations.md, "A verifier's model and backend"): the model a
    # verifier was configured with and the runtime that computes it, so that a router can tell
    # verifiers of one model whose target digests differ (they cannot take over each other's sessions).
    model_name: str | None = _optional(_Ignorable(_REQUEST_ID))
    backend: str | None = _optional(_Ignorable(_REQUEST_ID))
    # Extension member (docs/interpretations.md, "Prefix-aware routing"): the prefixes whose KV a
    # verifier holds, each named by its chained block hash at a multiple of 256 tokens
    # (sdcp.cache.prefix), the newest first, so that a router sends a session where its prompt's
    # prefix is. Read as absent where malformed or longer than MAX_REPORTED_PREFIXES.
    prefixes: tuple[bytes, ...] | None = _optional(_Ignorable(_Array(_HASH, max_items=MAX_REPORTED_PREFIXES)))
    # Extension member: the prompt tokens of the session-opens a verifier has yet to prefill (queued
    # behind each other, one prefill at a time), so that a router waits for an open as long as the
    # queue ahead of it asks (docs/interpretations.md, "Prefill queue").
    prefill_tokens: int | None = _optional(_Ignorable(_UINT))
    # Extension members (docs/interpretations.md, "Pass costs in status reports"): a verifier's
    # measured cost of a pass by its rows, ascending, and the sessions that share its passes now,
    # so that a router ranks a drafter against the verifier decoding alone as the verifier judges
    # proposals (sdcp.protocol.passcost). Read as absent where malformed.
    pass_us: tuple[PassCost, ...] | None = _optional(
        _Ignorable(_Array(_Nested(PassCost), non_empty=True, max_items=MAX_PASS_POINTS))
    )
    pass_sessions: int | None = _optional(_Ignorable(_UINT))
    # Extension member (same entry): true where a pass that other sessions share runs a session's
    # rows after its first as a pass of their own (llama.cpp with a cache per sequence).
    pass_apart: bool | None = _optional(_Ignorable(_Bool()))


@dataclass(frozen=True, kw_only=True)
class Proposal(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    round: int = _required(_UINT)
    drafter: str = _required(_TEXT)
    base: int = _required(_UINT)
    base_digest: bytes = _required(_HASH)
    tokens: tuple[int, ...] = _required(_Array(_TOKEN, non_empty=True))
    q_rows: str | None = _optional(_TEXT)
    draft_kv: str | None = _optional(_TEXT)
    status: Status = _required(_Nested(Status))


@dataclass(frozen=True, kw_only=True)
class Verdict(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    round: int = _required(_UINT)
    accepted: int = _required(_UINT)
    emitted: tuple[int, ...] = _required(_TOKENS)
    committed: int = _required(_UINT)
    digest: bytes = _required(_HASH)
    action: Action = _required(_ACTION)
    m_cap: int = _required(_UINT)
    low: int = _required(_UINT)
    load: int = _required(_UInt(high=LOAD_MAX))


@dataclass(frozen=True, kw_only=True)
class Alternative(_Message):
    """A token and its log-probability in millionths (extension, docs/interpretations.md)."""

    token: int = _required(_TOKEN)
    logprob: int = _required(_LOGPROB)


@dataclass(frozen=True, kw_only=True)
class TokenLogprob(_Message):
    """Extension (docs/interpretations.md): an output token's log-probability under the target's
    unprocessed distribution, in millionths, and the most probable tokens at its position. Both are
    absent for a token the verifier did not decide (one committed before a failover)."""

    logprob: int | None = _optional(_LOGPROB)
    top: tuple[Alternative, ...] | None = _optional(_Array(_Nested(Alternative)))


@dataclass(frozen=True, kw_only=True)
class Output(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    from_: int = _required(_UINT, key="from")
    tokens: tuple[int, ...] = _required(_TOKENS)
    final: bool = _required(_Bool())
    finish: Action | None = _optional(_ACTION)
    # Extension: one entry per token, when the session-open asked for log-probabilities.
    logprobs: tuple[TokenLogprob, ...] | None = _optional(_Array(_Nested(TokenLogprob)))


@dataclass(frozen=True, kw_only=True)
class Event(_Message):
    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)
    kind: Action = _required(_ACTION)
    committed: int = _required(_UINT)
    digest: bytes = _required(_HASH)
    # Extension member (docs/interpretations.md, "A fenced verifier"): true when the verifier
    # stopped serving the session at this epoch because its commit-log append failed on a record it
    # did not write (SDCP 6.3 Fencing). Sent with kind switch, which a router that ignores the
    # member acts on as for a drafter that stopped; ours checks whether the fence is its own.
    fenced: bool | None = _optional(_Bool())


@dataclass(frozen=True, kw_only=True)
class Policy(_Message):
    session: bytes = _required(_SESSION)
    from_round: int = _required(_UINT)
    sampling: Sampling = _required(_Nested(Sampling))


@dataclass(frozen=True, kw_only=True)
class SelfDecodeRequest(_Message):
    """Extension message (not in Table 1): the router asks the verifier to decode the session
    itself, since no drafter is expected to beat that (docs/interpretations.md)."""

    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)


@dataclass(frozen=True, kw_only=True)
class CancelRequest(_Message):
    """Extension message (not in Table 1): the session's front end, or the router on its behalf,
    ends the session before max_new (docs/interpretations.md)."""

    session: bytes = _required(_SESSION)
    epoch: int = _required(_UINT)


# The most sessions one POST outputs reads (OutputReads).
MAX_OUTPUT_READS = 1024


@dataclass(frozen=True, kw_only=True)
class OutputRead(_Message):
    """One session's read in POST outputs: what GET sessions/{id}/output?from=n asks (SDCP 6.7)."""

    session: bytes = _required(_SESSION)
    from_: int = _required(_UINT, key="from")


@dataclass(frozen=True, kw_only=True)
class OutputReads(_Message):
    """Extension message (not in Table 1): POST outputs, the output reads of several sessions in one
    request, each session once (docs/interpretations.md, "Output reads of many sessions")."""

    reads: tuple[OutputRead, ...] = _required(_Array(_Nested(OutputRead), non_empty=True, max_items=MAX_OUTPUT_READS))

    def __post_init__(self) -> None:
        super().__post_init__()
        if len({read.session for read in self.reads}) != len(self.reads):
            raise BadMessage("reads names a session more than once")


@dataclass(frozen=True, kw_only=True)
class ReadRefusal(_Message):
    """A read of POST outputs that failed: the problem its GET output would have answered."""

    session: bytes = _required(_SESSION)
    type: str = _required(_BoundedText(256))
    status: int = _required(_UInt(low=400, high=599))
    detail: str = _required(_BoundedText(1024))


@dataclass(frozen=True, kw_only=True)
class OutputBatch(_Message):
    """The answer to POST outputs: the reads that have news (tokens, the final output, a refusal);
    the others are left out, for the reader to ask again."""

    outputs: tuple[Output, ...] = _required(_Array(_Nested(Output), max_items=MAX_OUTPUT_READS))
    refused: tuple[ReadRefusal, ...] = _required(_Array(_Nested(ReadRefusal), max_items=MAX_OUTPUT_READS))


def session_path_id(session: bytes) -> str:
    """The {id} of session paths: unpadded base64url of the session id (SDCP 5.1)."""
    return codec.b64url_encode(_SESSION.parse(session, _Context(BadMessage, False), "session"))


def parse_session_path_id(path_id: str) -> bytes:
    """The session id a path {id} names; anything but 16 bytes in base64url raises BadMessage."""
    return _SESSION.parse(codec.b64url_decode(path_id), _Context(BadMessage, False), "session path id")


def instance_path_id(instance: str) -> str:
    """The {id} of instances/{id}/status: unpadded base64url of the instance's base URI in UTF-8
    (docs/interpretations.md; the draft defines {id} for session paths only)."""
    return codec.b64url_encode(instance.encode("utf-8"))


def parse_instance_path_id(path_id: str) -> str | None:
    """The instance base URI a path {id} names when it is our encoding of one, else None.

    Table 1 fixes {id} only for sessions; for instances it is ours to choose (base64url of the
    URI), and another implementation's instance may use any id, which then names nobody: the
    status's `instance` and the caller's certificate identify the reporter.
    """
    try:
        uri = codec.b64url_decode(path_id).decode("utf-8")
    except (BadMessage, UnicodeDecodeError):
        return None
    return uri if uri.startswith("https://") else None
