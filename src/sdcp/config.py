"""Configuration of one SDCP instance: a TOML file per role (docs/deploy.md).

```toml
[instance]
uri = "https://127.0.0.1:9101"      # base URI: the identity in the certificate's URI SAN
listen = "127.0.0.1:9101"           # optional; host:port of the URI by default
cert = "certs/127.0.0.1_9101.pem"
key = "certs/127.0.0.1_9101.key"
ca = "certs/ca.pem"
router = "https://127.0.0.1:9100"   # where status reports and events go (not for the router);
                                    # a list names several routers, each able to take over
                                    # the others' sessions (docs/reliability.md, "Routers")
ttl_ms = 3000

[mlc]
disk_dir = "/var/tmp/sdcp/mlc"      # shared by the instances of one host
redis_url = "redis://127.0.0.1:6379/0"
redis_username = "sdcp-verifier"    # this role's Redis ACL user (`sdcp redis-acl`)
redis_password_file = "redis/verifier.password"

[verifier]                          # or [drafter], [router]
model = "smollm2"
```

The sections are pydantic dataclasses: every key is checked for its type and range when a file is
loaded and when a section is built in code. An unknown key is an error naming it, so that a typo
never silently falls back to a default; ``load_config`` turns the first problem into one line
naming the file and the key (``ConfigError``).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails

from sdcp.cache.redis_acl import RedisAccess
from sdcp.models.backend import BackendSetting
from sdcp.threads import usable_cores

__all__ = [
    "ConfigError",
    "DrafterConfig",
    "GatewayConfig",
    "InstanceConfig",
    "MLCConfig",
    "OWN_MLC",
    "RouterConfig",
    "ServiceConfig",
    "TrustConfig",
    "VerifierConfig",
    "load_config",
    "thread_budget",
]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and key."""


def _relative_to_file(value: object, info: ValidationInfo) -> object:
    """A relative path in a file is relative to the file's directory (``load_config``'s context)."""
    if not isinstance(value, (str, Path)):
        return value
    path = Path(value).expanduser()
    base = info.context.get("base") if isinstance(info.context, dict) else None
    return base / path if base is not None and not path.is_absolute() else path


def _https_uri(value: object) -> object:
    if isinstance(value, str):
        parts = urlsplit(value)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"must be an https URI with a host, got {value!r}")
    return value


def _trust_entry(value: object) -> object:
    """An identity, or a pattern of identities: ``*`` in the leftmost label of the host stands for
    one or more letters, digits or hyphens (``https://verifier-*.verifier.sdcp.svc.cluster.local:8443``),
    so that a new instance of a role joins with a certificate alone (docs/security.md, "Trust
    patterns"). Scheme, further labels, port and path match exactly."""
    if not isinstance(value, str) or "*" not in value:
        return _https_uri(value)
    parts = urlsplit(value)
    host = parts.hostname or ""
    leftmost, dot, rest = host.partition(".")
    if (
        parts.scheme != "https"
        or value.count("*") != 1
        or "*" not in leftmost
        or not dot
        or "*" in rest
        or not _PATTERN_LABEL.fullmatch(leftmost.replace("*", "x"))
    ):
        raise ValueError(
            f"a pattern is an https URI with one * in the leftmost label of its host, followed by another label, "
            f"got {value!r}"
        )
    return value


_PATTERN_LABEL = re.compile(r"[A-Za-z0-9-]+")


def _host_port(value: object) -> object:
    if isinstance(value, str):
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"must be host:port, got {value!r}")
    return value


# Counts, sizes and durations: a negative one is a typo, never a setting; a bool is never a number.
Count = Annotated[int, Strict(), Field(ge=0)]
AtLeastOne = Annotated[int, Strict(), Field(ge=1)]
Seconds = Annotated[float, Field(ge=0), BeforeValidator(lambda v: _number(v))]
PositiveSeconds = Annotated[float, Field(gt=0), BeforeValidator(lambda v: _number(v))]
Text = Annotated[str, Strict()]
# A switch is true or false: a string or a number that pydantic would read as one is a mistake.
Flag = Annotated[bool, Strict()]
FilePath = Annotated[Path, BeforeValidator(_relative_to_file)]
HttpsURI = Annotated[str, Strict(), BeforeValidator(_https_uri)]
TrustEntry = Annotated[str, Strict(), BeforeValidator(_trust_entry)]
HostPort = Annotated[str, Strict(), BeforeValidator(_host_port)]
# `[instance] router`: one https URI, or a non-empty list of distinct ones (kept as a tuple).
Routers = Annotated[str | tuple[str, ...], BeforeValidator(lambda v: _routers(v))]
Device = Annotated[str, Strict(), StringConstraints(pattern=r"^(cpu|mps|cuda(:\d+)?)$")]
ModelDtype = Literal["float32", "bfloat16", "float16"]
# Whose finished output a suffix drafter may draft from (sdcp.engines.history, docs/security.md).
HistoryScope = Literal["owner", "target"]
OWN_MLC = "own"
MLCRoute = Annotated[str, Strict(), BeforeValidator(lambda v: v if v == OWN_MLC else _https_uri(v))]


def _routers(value: object) -> object:
    if isinstance(value, str):
        return _https_uri(value)
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError("must be an https URI or a non-empty list of them")
    if len(set(value)) != len(value):
        raise ValueError("names a router twice")
    return tuple(_https_uri(v) for v in value)


def _number(value: object) -> object:
    # TOML has integers and floats; a string or a bool that pydantic would read as one is a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    return value


# Unknown keys are errors, so that a typo never silently falls back to a default.
_SECTION = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_SECTION)
class InstanceConfig:
    uri: HttpsURI
    cert: FilePath
    key: FilePath
    ca: FilePath
    listen: HostPort | None = None
    # One router, or several (the first preferred): see ``routers``.
    router: Routers | None = None
    # At least 1: reports go every ttl_ms / 3, and a zero would send them without pause.
    ttl_ms: AtLeastOne = 3000
    # Threads for the instance's model work (docs/deploy.md, "Threads and cores"); 0: every usable
    # core for the roles that run a model (the verifier, model drafters), one for the others.
    threads: Count = 0

    @property
    def routers(self) -> tuple[str, ...]:
        """The routers this instance reports its status to, all of them, and sends a session's
        events to (the session's own router first, the others where it does not answer); a front
        end opens sessions at the first that answers."""
        if self.router is None:
            return ()
        return (self.router,) if isinstance(self.router, str) else self.router

    @property
    def host(self) -> str:
        return self._listen_parts()[0]

    @property
    def port(self) -> int:
        return self._listen_parts()[1]

    def _listen_parts(self) -> tuple[str, int]:
        if self.listen is not None:
            host, _, port = self.listen.rpartition(":")
            return host.strip("[]"), int(port)
        parts = urlsplit(self.uri)
        return parts.hostname or "127.0.0.1", parts.port or 443


@dataclass(frozen=True, config=_SECTION)
class MLCConfig:
    authority: Text = "local"
    memory_bytes: Count = 256 * 2**20
    disk_dir: FilePath | None = None
    disk_bytes: Count = 4096 * 2**20
    # redis://host:port/db, or rediss:// for TLS. It may carry user:password, but such a URL is a
    # secret wherever it is written: prefer redis_username and redis_password_file.
    redis_url: Text | None = field(default=None, repr=False)
    redis_prefix: Text = "sdcp:mlc:"
    # AUTH as this Redis ACL user (one per role: `sdcp redis-acl`, docs/security.md), with the
    # password read from the first line of a file (mode 0600; a Kubernetes Secret), never logged.
    redis_username: Text | None = None
    redis_password_file: FilePath | None = None
    # TLS to Redis (a rediss:// URL): the CA that issued the server's certificate, and the client
    # certificate and key where the server asks for one (tls-auth-clients).
    redis_ca: FilePath | None = None
    redis_cert: FilePath | None = None
    redis_key: FilePath | None = None
    # Base URI of a remote MLC node (sdcp.services.mlc) to use as the shared store, over mTLS with
    # this instance's certificate; disk_dir then names a local cache (docs/cache.md).
    mlc_url: HttpsURI | None = None
    # Which MLC serves a received cache-ref (SDCP 5.2), by the URI's authority: "own" (this
    # instance's MLC) or the base URI of an MLC node; `authority` itself is always "own". An
    # authority not listed is refused (400 naming the member) unless `unlisted` is "own": a log
    # kept privately here is one that the router, using its own MLC, could never fence (SDCP 6.9).
    authorities: dict[str, MLCRoute] = field(default_factory=dict)
    unlisted: Literal["own", "refuse"] = "refuse"

    def __post_init__(self) -> None:
        tls = (self.redis_ca, self.redis_cert, self.redis_key)
        if any(value is not None for value in tls) and not (self.redis_url or "").startswith("rediss://"):
            raise ValueError("redis_ca, redis_cert and redis_key need a rediss:// redis_url (TLS)")
        if (self.redis_cert is None) != (self.redis_key is None):
            raise ValueError("redis_cert and redis_key go together")

    def redis_access(self, role: str | None) -> RedisAccess:
        """User, password and TLS files for Redis, as the given role's user (None: a user that may
        write every key, such as an MLC node's); the password read from ``redis_password_file``."""
        password = None
        if self.redis_password_file is not None:
            try:
                lines = self.redis_password_file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"mlc.redis_password_file: cannot read {self.redis_password_file}: {exc}") from exc
            password = lines[0].strip() if lines else ""
            if not password:
                raise ConfigError(f"mlc.redis_password_file: {self.redis_password_file} holds no password")

        def text(path: Path | None) -> str | None:
            return None if path is None else str(path)

        return RedisAccess(
            role=role,
            username=self.redis_username,
            password=password,
            ca=text(self.redis_ca),
            cert=text(self.redis_cert),
            key=text(self.redis_key),
        )


@dataclass(frozen=True, config=_SECTION)
class VerifierConfig:
    model: Text = "smollm2"
    # Who runs the target (docs/models.md): "torch" (a Hugging Face directory), "llamacpp" (the
    # GGUF file as shipped, on the CPU; model is then smollm2 or a path to a .gguf file) or "auto":
    # for smollm2 on the CPU the one measured faster on this host, else the one that can run it.
    backend: BackendSetting = "auto"
    # Where and in which precision the target runs (docs/deploy.md): "cpu", "cuda", "cuda:N" or
    # "mps"; "float32", "bfloat16" or "float16". torch's only: llama.cpp runs the GGUF's types.
    device: Device = "cpu"
    dtype: ModelDtype = "float32"
    batch_window_ms: Seconds = 2.0
    max_batch: AtLeastOne = 16
    # The KV slot pool (docs/models.md): sessions in it (default 32 on torch, 16 on llama.cpp),
    # positions per session (0 = the model's context, at most 4096). On a CPU torch's unused slots
    # cost address space only, on a GPU memory; llama.cpp's are memory from the start.
    kv_slots: Count | None = None
    kv_capacity: Count = 0
    # The prefix cache (docs/models.md, "Prefix cache"; both backends): bytes of prompt-prefix KV
    # kept in host memory, so that a prompt that shares a prefix with an earlier one prefills only
    # the rest (0: off; on torch, off also means a prefill in one pass instead of 64-token chunks).
    prefix_cache_bytes: Count = 256 * 1024 * 1024
    output_wait_s: Seconds = 10.0
    # A reader waiting at the end of a session's output gets the tokens committed within this long
    # of the first new one in one answer (up to 16; 0 = each at once). The first answer never waits.
    # At 16 streams on 2 cores a round takes about 100 ms: at 50 ms each read got one round's token,
    # and the reads' work beside the passes made them a fifth longer (docs/performance.md).
    output_linger_ms: Seconds = 200.0
    # A self-decoding session's greedy run hands its rounds to the event loop (decided, appended,
    # released: the reader's next burst) 16 at a time, then, past its first 16, where no guess of
    # the lookahead pays and its class of match has been judged, in groups at least this far apart,
    # of up to 64 rounds: each group costs the loop a wake, a decision, an append and a release
    # beside the model's passes (docs/performance.md, session 43); 0 = 16 at a time.
    self_decode_group_ms: Seconds = 500.0
    # While every prompt waiting for its prefill is short (at most 256 tokens), a self-decoding
    # session that has its tokens waits for them before its next pass, at most this long at a time
    # (docs/models.md, "Prefill in steps"); 0 = never: the passes go on between the prefills.
    admission_hold_ms: Seconds = 1000.0
    # How long an ended or fenced session stays readable (output, stats) before it is forgotten.
    ended_retention_s: Seconds = 600.0
    # A session that nothing drives for this long (no proposal, commit or router message) is closed
    # and forgotten; 0 = never.
    idle_timeout_s: Seconds = 900.0
    # A session no drafter has proposed for in this long is reported to the router with a switch
    # event, on which it assigns a drafter again; 0 = never.
    drafter_silence_s: Seconds = 10.0
    # A session whose event no router has answered for this long, or that no router holds (404),
    # is an orphan and ends (failed) here rather than waiting for idle_timeout_s (docs/reliability.md).
    orphan_timeout_s: PositiveSeconds = 60.0
    # Quotas (docs/security.md): sessions being decoded here, and output reads waiting for tokens;
    # past them, 503 with Retry-After.
    max_sessions: AtLeastOne = 256
    max_long_polls: AtLeastOne = 1024
    # Target KV published to the MLC for failover (draft-li-sdcp 6.9; docs/reliability.md): once a
    # session's committed prefix (prompt and output) holds this many tokens, its KV is published,
    # and again every kv_publish_every tokens committed since (0 = once). 0 = never publish.
    kv_publish_min_tokens: Count = 1024
    kv_publish_every: Count = 1024
    # Finished sessions' output published to the MLC for the suffix drafters' shared history
    # (docs/models.md): whose sessions share it ("owner": the front end that opened them, the
    # default; "target": every session of the contract's target, tokenizer and scope; the drafters'
    # history_scope must say the same), and the newest entries a scope keeps (0 = publish none).
    # The lookahead reads the same scopes (docs/interpretations.md, "Self-decoding with
    # lookahead"): the newest history_entries of a scope when a session of it opens, a scope at
    # most once per history_refresh_s (0 entries: none).
    history_scope: HistoryScope = "owner"
    history_entries: Count = 256
    history_refresh_s: Seconds = 5.0


NGRAM_DRAFTER = "ngram"
SUFFIX_DRAFTER = "suffix"
# Drafters that run no model: prompt lookup and the suffix drafter (every other is sdcp.models.registry's).
MODEL_FREE_DRAFTERS = (NGRAM_DRAFTER, SUFFIX_DRAFTER)


@dataclass(frozen=True, config=_SECTION)
class DrafterConfig:
    model: Text = NGRAM_DRAFTER
    # For a model drafter (hf:NAME), as the verifier's.
    device: Device = "cpu"
    dtype: ModelDtype = "float32"
    # The target whose vocabulary the drafter's rows must match (SDCP 5.2 q_rows).
    target: Text = "smollm2"
    # Draft rows are leased this long (SDCP 6.2); a lease of no time would never hold.
    lease_s: PositiveSeconds = 30.0
    # The suffix drafter's shared history (docs/models.md): whose finished sessions it drafts from
    # (as the verifiers' history_scope), the newest entries of a scope it reads at a time (0 =
    # none), and how often it looks for new ones (at an assignment of the scope, at most this often).
    history_scope: HistoryScope = "owner"
    history_entries: Count = 256
    history_refresh_s: Seconds = 5.0
    # Warming at start: a new instance reads, before its first status report, the history scopes
    # of these front ends (the sessions' owners; under history_scope "target" those of every front
    # end), for at most history_warm_s (0 = not at start, only at each scope's first assignment).
    history_warm_owners: tuple[HttpsURI, ...] = ()
    history_warm_s: Seconds = 5.0
    # Prepare the next proposal while one is at the verifier (SDCP 6.2, docs/performance.md);
    # off for measurement, or where drafting competes with the verifier for cores.
    predraft: Flag = True

    @property
    def runs_model(self) -> bool:
        """Every drafter but prompt lookup and the suffix drafter runs a model
        (sdcp.models.registry.load_drafter)."""
        return self.model not in MODEL_FREE_DRAFTERS


@dataclass(frozen=True, config=_SECTION)
class RouterConfig:
    # How long an ended session can still be looked up (GET sessions/{id}) before it is forgotten.
    ended_retention_s: Seconds = 600.0
    # Assignments start at the contract's own limit (m_init is clamped to m_max): escalation and
    # load lower it where long proposals do not pay (SDCP 6.5).
    m_init: AtLeastOne = 64
    # Quotas (docs/security.md): open sessions per front end (past it, 429 with Retry-After), and
    # the longest validity a status report may claim (a longer ttl_ms is cut to it).
    max_sessions_per_front_end: AtLeastOne = 256
    max_ttl_ms: AtLeastOne = 60_000
    # The sessions this router holds at once, whoever opened them: past it, opening one and taking
    # one over from the shared tier (another router's, docs/reliability.md) are 503 with Retry-After.
    max_sessions: AtLeastOne = 4096
    # How long a verifier may take to answer a session-open, plus this many milliseconds per token it
    # prefills (the prompt; on a failover, the committed output too); past it the router cancels
    # what the verifier may have opened and tries another.
    open_timeout_s: PositiveSeconds = 30.0
    open_timeout_per_token_ms: Seconds = 25.0


@dataclass(frozen=True, config=_SECTION)
class GatewayConfig:
    """The OpenAI-compatible front end: its own listener, without client certificates."""

    listen: HostPort = "127.0.0.1:8000"
    model: Text = "smollm2"
    # TLS for the front listener; without both, plain HTTP on a loopback address only.
    cert: FilePath | None = None
    key: FilePath | None = None
    # The largest request body read; a larger one is refused with 413 while it is being read.
    max_body_bytes: AtLeastOne = 4 * 1024 * 1024
    # Requests being read or answered at once (streams until their end); past it 429 with
    # Retry-After. With max_body_bytes, it bounds the memory that request bodies take.
    max_requests_in_flight: AtLeastOne = 64
    # When set, every /v1 request must carry "Authorization: Bearer <api_key>" (else 401).
    api_key: Text | None = None
    # The same key read from a file (its first line), so that the key stays out of the TOML, the
    # command line and the environment: `sdcp up --api-key` keeps it there with mode 0600, a
    # Kubernetes Secret mounts it there. `api_key` (or `--api-key`, SDCP_API_KEY) takes precedence.
    api_key_file: FilePath | None = None
    # The model name the OpenAI API reports (/v1/models, responses) and accepts in requests, as
    # vLLM's --served-model-name; by default `model`, which may be a directory's path.
    served_model_name: Annotated[str, Strict(), StringConstraints(min_length=1)] | None = None

    # OpenAI's behaviour: a request member that no parameter reads is a 400. By default it is
    # ignored and named (a warning line, X-SDCP-Ignored-Members), as vLLM does.
    strict: Flag = False
    # A JSON schema's object that names its properties allows no others unless it says so
    # (response_format, guided_json, a forced tool call's arguments), as vLLM's default engine
    # (xgrammar) reads schemas; false reads them as JSON Schema does (open), except strict ones.
    close_json_objects: Flag = True

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the first line of ``api_key_file``, else None (no key required)."""
        if self.api_key is not None or self.api_key_file is None:
            return self.api_key
        try:
            lines = self.api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"gateway.api_key_file: cannot read {self.api_key_file}: {exc}") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            # An empty key would admit "Authorization: Bearer ", i.e. everybody.
            raise ConfigError(f"gateway.api_key_file: {self.api_key_file} holds no key")
        return key


@dataclass(frozen=True, config=_SECTION)
class AdminConfig:
    """The optional operator listener: plain HTTP/1.1 without certificates, serving /health,
    /ready, /metrics and /version, and the router's dashboard (docs/deploy.md). Off unless
    ``listen`` is set (``sdcp up`` sets a loopback address); it serves no session content, and an
    address other than loopback shows load figures to whoever reaches it (docs/security.md)."""

    listen: HostPort | None = None
    # No longer used: the dashboard shows no session text (docs/security.md, "Admin listeners").
    # Still read, so that the files of earlier `sdcp up` clusters load; the router warns of it.
    model: Text | None = None


@dataclass(frozen=True, config=_SECTION)
class TrustConfig:
    """Who may act towards this instance in each role (docs/security.md): a certificate from the CA
    proves an identity, these lists grant it rights. An empty list trusts nobody in that role, except
    ``routers``, which defaults to the instance's own ``[instance] router``."""

    # Each entry is an identity or a pattern of them (``_trust_entry``).
    routers: tuple[TrustEntry, ...] = ()
    # The router admits status reports in these roles from these identities only.
    verifiers: tuple[TrustEntry, ...] = ()
    drafters: tuple[TrustEntry, ...] = ()
    # Who may open sessions at the router (the gateway, the CLI) and then read their own sessions.
    front_ends: tuple[TrustEntry, ...] = ()
    # Who may read any session's state, output and stats, and every instance's metrics.
    operators: tuple[TrustEntry, ...] = ()


@dataclass(frozen=True, config=_SECTION)
class ServiceConfig:
    instance: InstanceConfig
    mlc: MLCConfig = field(default_factory=MLCConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)


_SERVICE_CONFIG = TypeAdapter(ServiceConfig)


def thread_budget(config: ServiceConfig, role: str) -> int:
    """The instance's ``threads``, or its default: every usable core for a role that runs a
    model, one for a role that runs none (it then starts no thread pool of its own)."""
    if config.instance.threads:
        return config.instance.threads
    runs_model = role == "verifier" or (role == "drafter" and config.drafter.runs_model)
    return usable_cores() if runs_model else 1


def load_config(path: Path | str) -> ServiceConfig:
    """Read and check a TOML configuration; relative paths are relative to the file."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such configuration file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    if "instance" not in document:
        raise ConfigError(f"{path}: the [instance] section is required")
    try:
        return _SERVICE_CONFIG.validate_python(document, context={"base": path.parent})
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_one_line(exc.errors()[0])}") from exc


def _one_line(error: ErrorDetails) -> str:
    """The first problem of a file, naming its key as section.key."""
    location = error["loc"]
    key = ".".join(str(part) for part in location if not isinstance(part, int))
    kind = error["type"]
    context: dict[str, Any] = dict(error.get("ctx") or {})
    if any(isinstance(part, int) for part in location) and kind == "string_type":
        return f"{key} must be a list of strings"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        if len(location) == 1:
            return f"unknown section [{key}] (known: {', '.join(_SERVICE_CONFIG_FIELDS)})"
        return f"unknown key {key}"
    if kind in ("missing", "missing_argument"):
        return f"{key} is required"
    if kind in ("dataclass_type", "dataclass_args_type", "model_type"):
        return f"[{key}] must be a table"
    if kind in ("greater_than_equal", "greater_than"):
        limit = context.get("ge", context.get("gt"))
        if kind == "greater_than":
            return f"{key} must be positive" if limit == 0 else f"{key} must be above {limit}"
        return f"{key} must not be negative" if limit == 0 else f"{key} must be at least {limit}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"{key} must be an integer"
    if kind in ("float_type", "float_parsing"):
        return f"{key} must be a number"
    if kind == "string_type":
        return f"{key} must be a string"
    if kind in ("bool_type", "bool_parsing"):
        return f"{key} must be true or false"
    if kind in ("tuple_type", "list_type"):
        return f"{key} must be a list of strings"
    if kind in ("path_type", "path_parsing"):
        return f"{key} must be a path string"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{key} {message}" if key else message


_SERVICE_CONFIG_FIELDS = ("instance", "mlc", "verifier", "drafter", "router", "gateway", "trust")
