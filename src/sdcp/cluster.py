"""A local SDCP cluster: one process per instance on loopback, started in the background.

Layout under ``$SDCP_HOME/cluster`` (docs/deploy.md shows the same files for several hosts):
``certs/`` (dev CA and one certificate per instance), ``<name>.toml`` (one config per instance),
``logs/<name>.log``, ``mlc/`` (the embedded MLC's shared disk tier), ``cluster.json`` (what runs:
names, roles, URIs, pids), ``options.json`` (the `sdcp up` options it was started with) and, with
``--api-key``, ``api-key`` (mode 0600; the gateway's TOML names the file, never the key).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit

from sdcp.config import MODEL_FREE_DRAFTERS, SUFFIX_DRAFTER
from sdcp.home import sdcp_home
from sdcp.localhost import accepts, free_port
from sdcp.threads import usable_cores
from sdcp.transport.certs import instance_name, make_certs

__all__ = [
    "API_KEY_FILE",
    "CLIENT_URI",
    "GATEWAY_URI",
    "ClusterError",
    "Instance",
    "LocalCluster",
    "RedisSetup",
    "UpOptions",
    "check_up_options",
]

CLIENT_URI = "https://localhost/sdcp-client"
GATEWAY_URI = "https://localhost/sdcp-gateway"
# Prompt lookup alone: on a CPU host the bundled model is the only model drafter there is, the
# target itself, whose every drafted token costs a target pass (docs/performance.md). A model
# drafter (`--drafter hf:NAME`) pays where it is much smaller than the target.
DEFAULT_DRAFTERS = ("ngram",)
_TTL_MS = 3000
# The roles whose processes reach the store (the gateway reaches none), and the key prefix of
# `[mlc] redis_prefix`'s default, which their users' key patterns name.
ROLE_STORE_USERS = ("router", "verifier", "drafter")
_REDIS_PREFIX = "sdcp:mlc:"
API_KEY_FILE = "api-key"
_OPTIONS_FILE = "options.json"


@dataclass(frozen=True)
class UpOptions:
    """The options of `sdcp up` that shape the cluster's instances, kept in ``options.json``: a
    restart runs the instances with the same ones, and `sdcp up` given others while the cluster
    exists is an error, not silently ignored. None: not given (the cluster's, or the default)."""

    device: str | None = None
    dtype: str | None = None
    host: str | None = None
    served_model_name: str | None = None
    # Kept as whether one is set: the key itself is only in the api-key file.
    api_key: bool | None = None
    # Every instance in one process (`sdcp together`) rather than one process each.
    one_process: bool | None = None

    def given(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def check_up_options(
    backend: str, *, device: str | None, dtype: str | None, host: str | None, api_key: str | None
) -> None:
    """Options that cannot be, or cannot go together, as one line each (ClusterError)."""
    if device is not None and re.fullmatch(r"cpu|mps|cuda(:\d+)?", device) is None:
        raise ClusterError(f"--device {device} is none of cpu, cuda, cuda:N, mps")
    if backend == "llamacpp" and device not in (None, "cpu"):
        raise ClusterError(f"--backend llamacpp runs on the cpu, not on {device}; use --backend torch (or auto) for it")
    if backend == "llamacpp" and dtype not in (None, "float32"):
        raise ClusterError("--backend llamacpp runs the GGUF's own types; --dtype is for --backend torch")
    if host is not None and not is_loopback(host) and api_key is None:
        raise ClusterError(
            f"--host {host} serves the API beyond this machine: give --api-key too "
            "(the gateway then also serves TLS with a certificate from the cluster's CA)"
        )


def one_process_by_default(device: str | None, drafters: Sequence[str]) -> bool:
    """Whether `sdcp up` runs every instance in one process when not told (`--one-process` or
    `--processes`): where the verifier runs on the CPU and no drafter runs a model. The verifier's
    threads take every core there, so the services' Python runs on the cores the passes use and
    costs them about its own time; in one process the instances ask each other by calls instead of
    over HTTP/2 and TLS, which saved a third of the services' CPU a token (docs/performance.md,
    session 38). On a GPU the passes leave the host's cores free, and a process each lets the roles'
    Python run on several of them at once; a model drafter (`hf:`, `llamacpp:`) keeps its model's
    threads and their settings (torch's are the process's) in a process of its own."""
    return device in (None, "cpu") and all(spec in MODEL_FREE_DRAFTERS for spec in drafters)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClusterError(RuntimeError):
    """The local cluster cannot be started, found or stopped; the message says why."""


@dataclass(frozen=True, repr=False)
class RedisSetup:
    """Redis as the shared tier: ``url`` with credentials that may create ACL users (``acl``, the
    default: each role then gets its own user, sdcp.cache.redis_acl, its password in
    ``redis/<role>.password`` with mode 0600, and each instance its own disk cache ``cache/<name>``),
    or that every role uses as they are (``acl=False``, for a Redis without ACLs); TLS files for a
    ``rediss://`` URL. No repr: the URL may carry a password."""

    url: str
    acl: bool = True
    # Accept a server whose default user is open, or that cannot keep the users over a restart.
    insecure: bool = False
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def client_options(self) -> dict[str, str]:
        options = {"ssl_ca_certs": self.ca, "ssl_certfile": self.cert, "ssl_keyfile": self.key}
        return {name: str(path.resolve()) for name, path in options.items() if path is not None}


@dataclass(frozen=True)
class Instance:
    name: str
    role: str
    uri: str
    pid: int
    # Base URL of its admin listener (/health, /ready, /metrics, /version).
    admin: str | None = None

    @property
    def port(self) -> int:
        return int(self.uri.rsplit(":", 1)[1].split("/", 1)[0])

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:
            # A process that exited but was not reaped is a zombie: not alive for our purposes.
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as stat:
                return stat.read().split(") ", 1)[1][:1] != "Z"
        except OSError:
            return True


class LocalCluster:
    """Start, find and stop the local cluster of one SDCP home directory."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = home if home is not None else sdcp_home()
        self.root = self.home / "cluster"
        self.certs = self.root / "certs"
        self.state_file = self.root / "cluster.json"
        # Each role's Redis user, once `up` created them (None: no Redis, or its URL for every role).
        self._redis_users: dict[str, str] | None = None
        # Where the Redis server keeps the roles' users over a restart ("ACL file", "configuration
        # file"; None: nowhere, accepted with --redis-insecure).
        self.redis_users_kept_in: str | None = None

    # -- what runs ---------------------------------------------------------------------------

    def instances(self) -> list[Instance]:
        if not self.state_file.is_file():
            return []
        try:
            state = json.loads(self.state_file.read_text(encoding="utf-8"))
            return [Instance(**entry) for entry in state["instances"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ClusterError(f"{self.state_file} is damaged ({exc}); run `sdcp down` and `sdcp up` again") from exc

    def running(self) -> bool:
        instances = self.instances()
        return bool(instances) and all(instance.alive() for instance in instances)

    @property
    def gateway(self) -> str | None:
        """Base URL of the OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1."""
        return next((i.uri for i in self.instances() if i.role == "gateway"), None)

    @property
    def dashboard(self) -> str | None:
        """The router's live dashboard (its admin listener)."""
        admin = next((i.admin for i in self.instances() if i.role == "router"), None)
        return None if admin is None else f"{admin}/dashboard"

    def target(self) -> dict[str, str]:
        """The verifiers' model, backend and target digest (the one a contract must name), by
        instance name (their admin listener's /version)."""
        found = {}
        for instance in self.instances():
            if instance.role == "verifier" and instance.admin is not None:
                try:
                    with urllib.request.urlopen(f"{instance.admin}/version", timeout=5) as response:
                        about = json.loads(response.read())
                except (OSError, ValueError):
                    continue
                described = f"{about.get('model')} on {about.get('backend')}"
                if about.get("target"):
                    described += f", target digest {about['target']}"
                found[instance.name] = described
        return found

    @property
    def router(self) -> str:
        for instance in self.instances():
            if instance.role == "router":
                return instance.uri
        raise ClusterError("no local cluster is running; start one with `sdcp up`")

    def client_credentials(self) -> tuple[Path, Path, Path]:
        """Certificate, key and CA with which the CLI talks to the cluster."""
        name = instance_name(CLIENT_URI)
        return self.certs / f"{name}.pem", self.certs / f"{name}.key", self.certs / "ca.pem"

    # -- start and stop ----------------------------------------------------------------------

    def up(
        self,
        *,
        model: str = "smollm2",
        backend: str = "auto",
        drafters: tuple[str, ...] = DEFAULT_DRAFTERS,
        redis_url: str | RedisSetup | None = None,
        gateway_port: int = 8000,
        timeout_s: float = 180.0,
        device: str | None = None,
        dtype: str | None = None,
        host: str | None = None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        role_settings: Mapping[str, Mapping[str, int]] | None = None,
        one_process: bool | None = None,
    ) -> list[Instance]:
        """Start router, verifier, drafters and the gateway in one process (`sdcp together`) or a process each,
        as ``one_process`` says (by default one_process_by_default); wait until they serve. A cluster of which
        some instances stopped gets those restarted (in one process: the process), the others untouched, with
        the options it was started with (its API key among them); options given that differ from those are a
        ClusterError. ``device``, ``dtype``: the verifier's and the ``hf:`` drafters' torch device and
        precision; ``host``: where the gateway listens (loopback by default; another address needs ``api_key``
        and gets TLS); ``served_model_name``: the model name the API reports and accepts; ``api_key``: required
        on every /v1 request; ``role_settings``: further settings of the `[verifier]` and `[router]` sections,
        by role (the benchmark turns the prefix cache off, tests shorten deadlines)."""
        given = UpOptions(device, dtype, host, served_model_name, None if api_key is None else True, one_process)
        if self.instances():
            self._check_same(given, api_key)
            if self.running():
                return self.instances()
            return self.restart_stopped(timeout_s)
        check_up_options(backend, device=device, dtype=dtype, host=host, api_key=api_key)
        if one_process is None:
            one_process = one_process_by_default(device, drafters)
        if gateway_port and accepts(gateway_port):
            raise ClusterError(
                f"port {gateway_port} is busy; start the cluster with `sdcp up --gateway-port N` (0 picks a free one)"
            )
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        # A URL alone: a Redis user per role, created with the URL's rights (RedisSetup).
        redis_url = RedisSetup(redis_url) if isinstance(redis_url, str) else redis_url
        self._redis_users = self._create_redis_users(redis_url) if redis_url is not None and redis_url.acl else None
        plan = [("router", "router", "router")]
        plan.append(("verifier", "verifier", model))
        plan.extend((f"drafter-{index}", "drafter", spec) for index, spec in enumerate(drafters, start=1))
        plan.append(("gateway", "gateway", model))
        uris = {name: f"https://127.0.0.1:{free_port()}" for name, _, _ in plan}
        # The gateway's SDCP identity is a client one; its own URI is where the OpenAI API listens:
        # plain HTTP on loopback, else TLS under the name clients reach it by (_api_host).
        listen_host = host or "127.0.0.1"
        port = gateway_port or free_port()
        tls = not is_loopback(listen_host)
        uris["gateway"] = f"https://{_api_host(listen_host)}:{port}/v1" if tls else f"http://{listen_host}:{port}/v1"
        admins = {name: f"http://127.0.0.1:{free_port()}" for name, _, _ in plan}
        make_certs(
            self.certs,
            [
                *(uri for name, uri in uris.items() if name != "gateway"),
                CLIENT_URI,
                GATEWAY_URI,
                *([uris["gateway"]] if tls else []),
            ],
        )
        options = UpOptions(
            device or "cpu", dtype or "float32", listen_host, served_model_name, api_key is not None, bool(one_process)
        )
        self._write_options(options, api_key)
        gateway = _GatewaySettings(
            listen_host, port, served_model_name, api_key is not None, uris["gateway"] if tls else None
        )
        started: list[Instance] = []
        try:
            for name, role, what in plan:
                config = self._write_config(
                    name, role, what, uris, admins[name], model, backend, redis_url, options, gateway
                )
                extra = (role_settings or {}).get(role)
                if extra and role in ("verifier", "router"):
                    # The verifier's section is its file's last; the router's has none of its own.
                    header = ["[router]\n"] if role == "router" else []
                    with config.open("a", encoding="utf-8") as file:
                        file.writelines([*header, *(f"{key} = {int(value)}\n" for key, value in extra.items())])
                if not one_process:
                    started.append(self._spawn(name, role, uris[name], admins[name], config))
                    self._save(started)
            if one_process:
                started = self._spawn_together(
                    [Instance(name, role, uris[name], 0, admins[name]) for name, role, _ in plan]
                )
                self._save(started)
            self._wait_ready(started, timeout_s)
        except BaseException:
            self._terminate(started)
            self.state_file.unlink(missing_ok=True)
            raise
        return started

    @property
    def api_key_file(self) -> Path:
        return self.root / API_KEY_FILE

    def options(self) -> UpOptions:
        """The options the cluster was started with (defaults for a cluster of an older sdcp)."""
        path = self.root / _OPTIONS_FILE
        if not path.is_file():
            return UpOptions("cpu", "float32", "127.0.0.1", None, self.api_key_file.is_file())
        try:
            return UpOptions(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as exc:
            raise ClusterError(f"{path} is damaged ({exc}); run `sdcp down` and `sdcp up` again") from exc

    def _write_options(self, options: UpOptions, api_key: str | None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / _OPTIONS_FILE).write_text(json.dumps(asdict(options), indent=2) + "\n", encoding="utf-8")
        self.api_key_file.unlink(missing_ok=True)
        if api_key is not None:
            # Created with mode 0600, never wider for an instant; the gateway reads it at each start.
            descriptor = os.open(self.api_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
                stream.write(api_key + "\n")

    def _check_same(self, given: UpOptions, api_key: str | None) -> None:
        """Options given to `sdcp up` for a cluster that exists must be those it runs with."""
        current = self.options()
        for name, value in given.given().items():
            if name == "api_key":
                stored = self.api_key_file.read_text(encoding="utf-8").strip() if self.api_key_file.is_file() else None
                if stored != api_key:
                    runs = "with another API key" if stored else "without an API key"
                    raise ClusterError(f"the cluster runs {runs}; `sdcp down` first to start it with --api-key")
                continue
            running = getattr(current, name)
            if running != value:
                if name == "one_process":
                    # A cluster whose options predate the choice ran a process each.
                    if bool(running) == value:
                        continue
                    flags = {True: "--one-process", False: "--processes"}
                    differs = f"{flags[bool(running)]}, not {flags[bool(value)]}"
                else:
                    differs = f"--{name.replace('_', '-')} {running}, not {value}"
                raise ClusterError(f"the cluster runs with {differs}; `sdcp down` first to start it with other options")

    def stopped(self) -> list[Instance]:
        return [instance for instance in self.instances() if not instance.alive()]

    def restart_stopped(self, timeout_s: float = 180.0) -> list[Instance]:
        """Start again, with their own configuration and addresses, the instances that stopped."""
        instances = self.instances()
        if self.options().one_process:
            # One process ran them all: any stopped means all did.
            if all(instance.alive() for instance in instances):
                return instances
            self._terminate(instances)
            current = self._spawn_together(instances)
            self._save(current)
            self._wait_ready(current, timeout_s)
            return current
        restarted = [
            self._spawn(i.name, i.role, i.uri, i.admin, self.root / f"{i.name}.toml")
            for i in instances
            if not i.alive()
        ]
        by_name = {instance.name: instance for instance in restarted}
        current = [by_name.get(instance.name, instance) for instance in instances]
        self._save(current)
        self._wait_ready(restarted, timeout_s)
        return current

    def down(self, timeout_s: float = 10.0) -> list[Instance]:
        """Stop every instance of the cluster (SIGTERM, then SIGKILL after ``timeout_s``)."""
        instances = self.instances()
        self._terminate(instances, timeout_s)
        self.state_file.unlink(missing_ok=True)
        # A cluster started later has options and a key of its own: no secret is left behind.
        (self.root / _OPTIONS_FILE).unlink(missing_ok=True)
        self.api_key_file.unlink(missing_ok=True)
        return instances

    def _write_config(
        self,
        name: str,
        role: str,
        what: str,
        uris: dict[str, str],
        admin: str,
        model: str,
        backend: str,
        redis_url: RedisSetup | None,
        options: UpOptions,
        gateway: _GatewaySettings,
    ) -> Path:
        uri = GATEWAY_URI if role == "gateway" else uris[name]
        stem = instance_name(uri)
        lines = [
            "[instance]",
            f'uri = "{uri}"',
            f'cert = "certs/{stem}.pem"',
            f'key = "certs/{stem}.key"',
            'ca = "certs/ca.pem"',
            f'router = "{uris["router"]}"',
            f"ttl_ms = {_TTL_MS}",
            f"threads = {_threads(role)}",
            "",
            "[mlc]",
        ]
        if redis_url is None:
            lines.append('disk_dir = "mlc"')
        elif role != "gateway":  # the gateway reaches no store
            lines += self._redis_lines(name, role, redis_url)
        lines += _trust(uris)
        lines += ["", "[admin]", f'listen = "{admin.removeprefix("http://")}"']
        torch = [f'device = "{options.device}"', f'dtype = "{options.dtype}"']
        if role == "verifier":
            lines += ["", "[verifier]", f'model = "{what}"', f'backend = "{backend}"', *torch]
        elif role == "drafter":
            lines += ["", "[drafter]", f'model = "{what}"', f'target = "{model}"']
            # Only a model drafter of torch runs on a device (a llamacpp: one on the cpu).
            lines += torch if what.startswith("hf:") else []
            if what == SUFFIX_DRAFTER:
                # The cluster's front ends: a suffix drafter drafts from their history from its start.
                lines.append(f'history_warm_owners = ["{GATEWAY_URI}", "{CLIENT_URI}"]')
        elif role == "gateway":
            lines += gateway.toml_lines(what)
        path = self.root / f"{name}.toml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    def _create_redis_users(self, redis: RedisSetup) -> dict[str, str]:
        """Create (or reset) this cluster's Redis user of each role with ACL SETUSER, using the
        URL's credentials; the passwords stay in ``redis/`` (0600). Named after this home, so that
        clusters of several homes on one Redis do not reset each other's."""
        import redis as redis_client

        from sdcp.cache.redis_acl import (
            UsersNotPersisted,
            create_users,
            default_user_open,
            ensure_passwords,
            persist_users,
            redact_url,
        )

        passwords = ensure_passwords(self.root / "redis", ROLE_STORE_USERS)
        tag = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:8]
        users = {role: f"sdcp-{role}-{tag}" for role in ROLE_STORE_USERS}
        client = redis_client.Redis.from_url(redis.url, socket_connect_timeout=5, **redis.client_options())
        where = redact_url(redis.url)
        try:
            if default_user_open(client) and not redis.insecure:
                raise ClusterError(
                    f"the Redis at {where} lets anyone in as its default user (on, no password), who could "
                    "read every output and write commit logs: close it with `sdcp redis-acl --url ADMIN_URL "
                    "--lock-default`, or pass --redis-insecure"
                )
            create_users(client, passwords, _REDIS_PREFIX, users)
            try:
                self.redis_users_kept_in = persist_users(client)
            except UsersNotPersisted as exc:
                if not redis.insecure:
                    raise ClusterError(f"the roles' Redis users at {where}: {exc}; or pass --redis-insecure") from exc
                self.redis_users_kept_in = None
        except redis_client.RedisError as exc:
            raise ClusterError(
                f"cannot create the roles' Redis users at {redact_url(redis.url)} ({exc}): give a URL whose user "
                "may run ACL SETUSER, or --no-redis-acl to let every role use the URL as it is"
            ) from exc
        finally:
            client.close()
        return users

    def _redis_lines(self, name: str, role: str, redis: RedisSetup) -> list[str]:
        """The [mlc] keys of one instance: its role's user, its own disk cache in front of Redis."""
        from sdcp.cache.redis_acl import redact_url

        # A disk cache shared by the roles would let one role's process plant copies that another
        # serves (docs/security.md): each instance caches in a directory of its own.
        lines = [f'disk_dir = "cache/{name}"']
        users = self._redis_users
        if users is None:
            lines.append(f'redis_url = "{redis.url}"')
        else:
            lines.append(f'redis_url = "{redact_url(redis.url)}"')
            lines += [f'redis_username = "{users[role]}"', f'redis_password_file = "redis/{role}.password"']
        for key, path in (("redis_ca", redis.ca), ("redis_cert", redis.cert), ("redis_key", redis.key)):
            if path is not None:
                lines.append(f'{key} = "{path.resolve()}"')
        return lines

    def _spawn(self, name: str, role: str, uri: str, admin: str | None, config: Path) -> Instance:
        pid = self._start_process([role, "--config", str(config)], self.root / "logs" / f"{name}.log")
        return Instance(name=name, role=role, uri=uri, pid=pid, admin=admin)

    def _start_process(self, arguments: list[str], log_path: Path) -> int:
        """`sdcp ARGUMENTS` in the background, its output appended to ``log_path``; its pid."""
        if log_path.is_symlink():
            # The instance ran in one process before (`_spawn_together`): its log is its own again.
            log_path.unlink()
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "sdcp", *arguments],
                # Models load from this cluster's home, whatever the caller's $SDCP_HOME says; the
                # gateway's key is the cluster's file, whatever the caller's $SDCP_API_KEY says.
                env={**_without(os.environ, "SDCP_API_KEY"), "SDCP_HOME": str(self.home)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
            )
        return process.pid

    def _spawn_together(self, instances: list[Instance]) -> list[Instance]:
        """One `sdcp together` process for ``instances``; each role's log is the process's."""
        logs = self.root / "logs"
        combined = logs / "together.log"
        for instance in instances:
            link = logs / f"{instance.name}.log"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(combined.name)
        arguments = ["together", *(f"{i.role}={self.root / f'{i.name}.toml'}" for i in instances)]
        pid = self._start_process(arguments, combined)
        return [Instance(i.name, i.role, i.uri, pid, i.admin) for i in instances]

    def _save(self, instances: list[Instance]) -> None:
        state = {"instances": [asdict(instance) for instance in instances]}
        self.state_file.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")

    def _wait_ready(self, instances: list[Instance], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(instances)
        while waiting:
            for instance in list(waiting):
                if not instance.alive():
                    tail = self._log_tail(instance.name)
                    raise ClusterError(f"{instance.name} exited during start-up: {tail}")
                if accepts(instance.port, _probe_host(instance)):
                    waiting.remove(instance)
            if time.monotonic() > deadline:
                names = ", ".join(instance.name for instance in waiting)
                raise ClusterError(f"{names} did not start within {timeout_s:.0f} s (logs in {self.root / 'logs'})")
            time.sleep(0.2)
        # Each instance reports its status within a third of its TTL of listening.
        time.sleep(_TTL_MS / 3000 + 0.5)

    def _log_tail(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines() if path.exists() else []
        return lines[-1] if lines else f"no output (see {path})"

    @staticmethod
    def _terminate(instances: list[Instance], timeout_s: float = 10.0) -> None:
        for instance in instances:
            if instance.alive():
                os.kill(instance.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for instance in instances:
            while instance.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if instance.alive():
                os.kill(instance.pid, signal.SIGKILL)


@dataclass(frozen=True)
class _GatewaySettings:
    """What the gateway's TOML says besides its identity: where it listens, under which name it
    serves the model, whether it reads an API key file, and its TLS certificate's URI (None: plain
    HTTP on loopback)."""

    host: str
    port: int
    served_model_name: str | None
    api_key: bool
    tls_uri: str | None

    def toml_lines(self, model: str) -> list[str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        lines = ["", "[gateway]", f'listen = "{host}:{self.port}"', f'model = "{model}"']
        if self.served_model_name is not None:
            lines.append(f"served_model_name = {json.dumps(self.served_model_name)}")
        if self.api_key:
            lines.append(f'api_key_file = "{API_KEY_FILE}"')
        if self.tls_uri is not None:
            stem = instance_name(self.tls_uri)
            lines += [f'cert = "certs/{stem}.pem"', f'key = "certs/{stem}.key"']
        return lines


def _api_host(listen_host: str) -> str:
    """The name clients reach a gateway listening on ``listen_host`` by, for its certificate: the
    address itself, or for every address (0.0.0.0, ::) this machine's host name."""
    bare = listen_host.strip("[]")
    try:
        if ipaddress.ip_address(bare).is_unspecified:
            return socket.gethostname()
    except ValueError:
        pass
    return f"[{bare}]" if ":" in bare else bare


def _trust(uris: dict[str, str]) -> list[str]:
    """Every instance trusts the cluster's own verifier and drafters; the CLI and the gateway open
    sessions, and the CLI is the operator (docs/security.md)."""

    def listed(values: list[str]) -> str:
        return "[" + ", ".join(f'"{value}"' for value in values) + "]"

    return [
        "",
        "[trust]",
        f"verifiers = {listed([uris['verifier']])}",
        f"drafters = {listed([uri for name, uri in uris.items() if name.startswith('drafter-')])}",
        f"front_ends = {listed([CLIENT_URI, GATEWAY_URI])}",
        f"operators = {listed([CLIENT_URI])}",
    ]


def _without(environment: Mapping[str, str], name: str) -> dict[str, str]:
    return {key: value for key, value in environment.items() if key != name}


def _probe_host(instance: Instance) -> str:
    """Where to find an instance listening: loopback, or the gateway's own address when it listens
    on another (its URI's host; loopback where that name does not resolve, as a host name of a
    gateway on every address may not)."""
    host = (urlsplit(instance.uri).hostname or "127.0.0.1") if instance.role == "gateway" else "127.0.0.1"
    try:
        socket.getaddrinfo(host, instance.port)
    except OSError:
        return "127.0.0.1"
    return host


def _threads(role: str) -> int:
    """The verifier gets every core of the host, every other instance one: the n-gram drafter,
    router and gateway run no model, and a model drafter's one thread is what is left beside the
    verifier (docs/deploy.md, "Threads and cores")."""
    return usable_cores() if role == "verifier" else 1
