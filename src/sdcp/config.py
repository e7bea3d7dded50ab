"""Configuration of one SDCP instance: a TOML file per role (docs/deploy.md).

```toml
[instance]
uri = "https://127.0.0.1:9101"      # base URI: the identity in the certificate's URI SAN
listen = "127.0.0.1:9101"           # optional; host:port of the URI by default
cert = "certs/127.0.0.1_9101.pem"
key = "certs/127.0.0.1_9101.key"
ca = "certs/ca.pem"
router = "https://127.0.0.1:9100"   # where status reports and events go (not for the router)
ttl_ms = 3000

[mlc]
disk_dir = "/var/tmp/sdcp/mlc"      # shared by the instances of one host
redis_url = "redis://127.0.0.1:6379/0"

[verifier]                          # or [drafter], [router]
model = "smollm2"
```

Every key is checked: an unknown one is an error naming it, so that a typo never silently falls
back to a default.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sdcp.threads import usable_cores

__all__ = [
    "ConfigError",
    "DrafterConfig",
    "GatewayConfig",
    "InstanceConfig",
    "MLCConfig",
    "RouterConfig",
    "ServiceConfig",
    "VerifierConfig",
    "load_config",
    "thread_budget",
]


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class InstanceConfig:
    uri: str
    cert: Path
    key: Path
    ca: Path
    listen: str | None = None
    router: str | None = None
    # At least 1: reports go every ttl_ms / 3, and a zero would send them without pause.
    ttl_ms: int = field(default=3000, metadata={"min": 1})
    # Threads for the instance's model work (docs/deploy.md, "Threads and cores"); 0: every usable
    # core for the roles that run a model (the verifier, model drafters), one for the others.
    threads: int = 0

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


@dataclass(frozen=True)
class MLCConfig:
    authority: str = "local"
    memory_bytes: int = 256 * 2**20
    disk_dir: Path | None = None
    disk_bytes: int = 4096 * 2**20
    redis_url: str | None = None
    redis_prefix: str = "sdcp:mlc:"
    # Base URI of a remote MLC node (sdcp.services.mlc) to use as the shared store, over mTLS with
    # this instance's certificate; disk_dir then names a local cache (docs/cache.md).
    mlc_url: str | None = None


@dataclass(frozen=True)
class VerifierConfig:
    model: str = "smollm2"
    batch_window_ms: float = 2.0
    max_batch: int = field(default=16, metadata={"min": 1})
    # The KV slot pool (docs/models.md): sessions in it, positions per session (0 = the model's
    # context, at most 4096). On a CPU unused slots cost address space only; on a GPU, memory.
    kv_slots: int = 32
    kv_capacity: int = 0
    output_wait_s: float = 10.0
    # How long an ended or fenced session stays readable (output, stats) before it is forgotten.
    ended_retention_s: float = 600.0
    # A session that nothing drives for this long (no proposal, commit or router message) is closed
    # and forgotten; 0 = never.
    idle_timeout_s: float = 900.0


NGRAM_DRAFTER = "ngram"


@dataclass(frozen=True)
class DrafterConfig:
    model: str = NGRAM_DRAFTER
    # The target whose vocabulary the drafter's rows must match (SDCP 5.2 q_rows).
    target: str = "smollm2"
    lease_s: float = field(default=30.0, metadata={"positive": True})

    @property
    def runs_model(self) -> bool:
        """Every drafter but prompt lookup runs a model (sdcp.models.registry.load_drafter)."""
        return self.model != NGRAM_DRAFTER


@dataclass(frozen=True)
class RouterConfig:
    # How long an ended session can still be looked up (GET sessions/{id}) before it is forgotten.
    ended_retention_s: float = 600.0
    # Assignments start at the contract's own limit (m_init is clamped to m_max): escalation and
    # load lower it where long proposals do not pay (SDCP 6.5).
    m_init: int = field(default=64, metadata={"min": 1})
    verifiers: tuple[str, ...] = ()
    drafters: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible front end: its own listener, without client certificates."""

    listen: str = "127.0.0.1:8000"
    model: str = "smollm2"
    # TLS for the front listener; without both, plain HTTP on a loopback address only.
    cert: Path | None = None
    key: Path | None = None


@dataclass(frozen=True)
class ServiceConfig:
    instance: InstanceConfig
    mlc: MLCConfig = field(default_factory=MLCConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


_Section = TypeVar("_Section")


def _section(cls: type[_Section], table: object, name: str, base: Path) -> _Section:
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key} (known: {', '.join(sorted(known))})")
        annotation = str(known[key].type)
        if "Path" in annotation:
            if not isinstance(value, str):
                raise ConfigError(f"{name}.{key} must be a path string")
            path = Path(value).expanduser()
            value = path if path.is_absolute() else base / path
        elif "tuple" in annotation:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{name}.{key} must be a list of strings")
            value = tuple(value)
        elif annotation.startswith("int") and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{name}.{key} must be an integer")
        elif annotation.startswith("float") and not isinstance(value, (int, float)):
            raise ConfigError(f"{name}.{key} must be a number")
        elif annotation.startswith("str") and not isinstance(value, str):
            raise ConfigError(f"{name}.{key} must be a string")
        # Counts, sizes and durations all: a negative one is a typo, never a setting.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _check_range(f"{name}.{key}", value, known[key].metadata)
        values[key] = value
    try:
        return cls(**values)
    except TypeError as exc:
        missing = [
            key
            for key, f in known.items()
            if key not in values and f.default is MISSING and f.default_factory is MISSING
        ]
        raise ConfigError(f"[{name}] lacks {', '.join(missing) or 'required keys'}") from exc


def thread_budget(config: ServiceConfig, role: str) -> int:
    """The instance's ``threads``, or its default: every usable core for a role that runs a
    model, one for a role that runs none (it then starts no thread pool of its own)."""
    if config.instance.threads:
        return config.instance.threads
    runs_model = role == "verifier" or (role == "drafter" and config.drafter.runs_model)
    return usable_cores() if runs_model else 1


def _check_range(name: str, value: float, limits: Mapping[str, object]) -> None:
    minimum = limits.get("min")
    if isinstance(minimum, int) and value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}")
    if limits.get("positive") and value <= 0:
        raise ConfigError(f"{name} must be positive")
    if value < 0:
        raise ConfigError(f"{name} must not be negative")


def load_config(path: Path | str) -> ServiceConfig:
    """Read and check a TOML configuration; relative paths are relative to the file."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such configuration file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    sections = {
        "instance": InstanceConfig,
        "mlc": MLCConfig,
        "verifier": VerifierConfig,
        "drafter": DrafterConfig,
        "router": RouterConfig,
        "gateway": GatewayConfig,
    }
    unknown = set(document) - set(sections)
    if unknown:
        raise ConfigError(f"{path}: unknown section [{sorted(unknown)[0]}] (known: {', '.join(sections)})")
    if "instance" not in document:
        raise ConfigError(f"{path}: the [instance] section is required")
    base = path.parent
    try:
        parsed = {name: _section(cls, document[name], name, base) for name, cls in sections.items() if name in document}
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return ServiceConfig(**parsed)
