"""The `sdcp` command line: run a role, a local cluster, generate text, make certificates.

Every error a user can cause ends with one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from sdcp.conformance.cli import conformance_app
from sdcp.models.cli import models_app
from sdcp.terminal import help_markup_mode, is_terminal, plain_table

if TYPE_CHECKING:  # imported where used: a role's host has only its own extra installed
    from sdcp.frontend.client import ClusterClient, SessionHandle
    from sdcp.frontend.text import TextCodec

app = typer.Typer(
    name="sdcp",
    help="Speculative Decoding Coordination Protocol: run roles, a local cluster, generate text.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=help_markup_mode(),
)
app.add_typer(models_app, name="models")
app.add_typer(conformance_app, name="conformance")

err_console = Console(stderr=True)
# How long Ctrl-C in `sdcp generate` waits for the session's cancellation.
_CANCEL_WAIT_S = 5.0
# How long `sdcp generate` waits for a session's statistics before going on without them.
_STATS_WAIT_S = 2.0


def fail(message: str, code: int = 1) -> NoReturn:
    # One line however narrow the terminal (rich wraps at 80 columns where there is none).
    err_console.print(f"[red]sdcp:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can cause into one clear line."""
    from sdcp.cache import CacheError
    from sdcp.cluster import ClusterError
    from sdcp.config import ConfigError
    from sdcp.models.errors import ModelError
    from sdcp.protocol.problems import ProtocolError
    from sdcp.transport.errors import TransportError
    from sdcp.transport.server import ServerStartError

    try:
        yield
    except ModuleNotFoundError as exc:
        fail(_missing_extra(exc.name or ""))
    except (ClusterError, ConfigError, ModelError, CacheError, ServerStartError, OSError) as exc:
        fail(str(exc))
    except TransportError as exc:
        fail(f"cannot reach the cluster: {exc}")
    except ProtocolError as exc:
        # The problem's title in words (SDCP Table 2), not its type URI.
        fail(f"{exc.problem.title.lower()}: {exc.detail}" if exc.problem is not None else exc.detail)
    except KeyboardInterrupt:
        fail("interrupted", 130)


# Which extra of the package brings a module a command needs (pyproject.toml).
_EXTRA_OF_MODULE = {
    "torch": "verifier",
    "transformers": "verifier",
    "safetensors": "verifier",
    "gguf": "verifier",
    "accelerate": "verifier",
    "tokenizers": "gateway",
    "jinja2": "gateway",
    "matplotlib": "bench",
}


def _missing_extra(module: str) -> str:
    extra = _EXTRA_OF_MODULE.get(module.split(".")[0])
    if extra is None:
        return f"the Python module {module!r} is missing; reinstall sdcp"
    return f"this command needs {module!r}: pip install 'sdcp[{extra}]' (or 'sdcp[all]')"


@app.command()
def version() -> None:
    """Print the sdcp version."""
    from sdcp import __version__

    typer.echo(__version__)


def _print_version(given: bool) -> None:
    if given:
        version()
        raise typer.Exit()


@app.callback()
def _options(
    _version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the sdcp version and exit."
    ),
) -> None:
    pass


@app.command()
def certs(
    directory: Path = typer.Argument(..., help="Where the CA and the certificates go."),
    instance: list[str] = typer.Option(..., "--instance", help="An instance base URI (repeat for each)."),
) -> None:
    """Create a dev CA (once) and a certificate per instance, identified by its base URI."""
    from sdcp.transport.certs import InvalidInstanceURI, make_certs

    try:
        issued = make_certs(directory, instance)
    except InvalidInstanceURI as exc:
        fail(str(exc))
    for uri, files in issued.items():
        typer.echo(f"{uri}: {files.cert_path} {files.key_path}")
    typer.echo(f"CA: {directory / 'ca.pem'}")


# -- roles ----------------------------------------------------------------------------------------


class Role(StrEnum):
    verifier = "verifier"
    drafter = "drafter"
    router = "router"
    mlc = "mlc"
    gateway = "gateway"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _serve(role: Role, config_path: Path, log_level: LogLevel, log_json: bool, api_key: str | None = None) -> None:
    from dataclasses import replace

    from sdcp.config import load_config, thread_budget
    from sdcp.logs import configure_logging
    from sdcp.threads import limit_native_threads

    configure_logging(log_level.value, json_lines=log_json)
    with user_errors():
        config = load_config(config_path)
        if api_key is not None:
            config = replace(config, gateway=replace(config.gateway, api_key=api_key))
        # Before the role's modules import torch: its thread pools read these once.
        limit_native_threads(thread_budget(config, role.value))
        node = _build_node(role, config)
        _serve_until_signal(node.run_until)


def _serve_until_signal(serve: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run ``serve(shutdown)`` until SIGINT or SIGTERM sets ``shutdown``; a model thread that died
    ends the process with EX_SOFTWARE, so that a supervisor (Kubernetes, `sdcp up` again) starts it
    anew."""
    from sdcp.services.node import ModelThreadDied

    async def run() -> None:
        shutdown = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, shutdown.set)
        await serve(shutdown)

    try:
        asyncio.run(run())
    except ModelThreadDied as exc:
        fail(str(exc), code=70)


def _build_node(role: Role, config: Any) -> Any:
    if role is Role.verifier:
        from sdcp.services.verifier import VerifierNode

        return VerifierNode(config)
    if role is Role.drafter:
        from sdcp.services.drafter import DrafterNode

        return DrafterNode(config)
    if role is Role.router:
        from sdcp.services.router import RouterNode

        return RouterNode(config)
    if role is Role.gateway:
        from sdcp.frontend.gateway import GatewayNode

        return GatewayNode(config)
    from sdcp.services.mlc import MLCNode

    return MLCNode(config)


_CONFIG_HELP = "The instance's TOML configuration (docs/deploy.md)."
_LEVEL_HELP = "Log level."
_JSON_HELP = "Log one JSON object per line (time, level, logger, message) instead of text lines."


def _role_command(role: Role) -> Callable[..., None]:
    command: Callable[..., None]
    if role is Role.gateway:

        def serve_gateway(
            config: Path = typer.Option(..., "--config", help=_CONFIG_HELP),
            log_level: LogLevel = typer.Option(LogLevel.info, "--log-level", help=_LEVEL_HELP),
            log_json: bool = typer.Option(False, "--log-json", help=_JSON_HELP),
            api_key: str = typer.Option(
                None,
                "--api-key",
                envvar="SDCP_API_KEY",
                help="Require 'Authorization: Bearer KEY' on /v1 (overrides \\[gateway] api_key).",
            ),
        ) -> None:
            _serve(role, config, log_level, log_json, api_key)

        command = serve_gateway
    else:

        def serve_role(
            config: Path = typer.Option(..., "--config", help=_CONFIG_HELP),
            log_level: LogLevel = typer.Option(LogLevel.info, "--log-level", help=_LEVEL_HELP),
            log_json: bool = typer.Option(False, "--log-json", help=_JSON_HELP),
        ) -> None:
            _serve(role, config, log_level, log_json)

        command = serve_role
    what = "the OpenAI-compatible front end" if role is Role.gateway else f"an SDCP {role.value} instance"
    command.__doc__ = f"Run {what} until SIGINT or SIGTERM."
    return command


for _role in Role:
    app.command(_role.value)(_role_command(_role))


@app.command()
def together(
    instances: list[str] = typer.Argument(
        ..., metavar="ROLE=CONFIG...", help="Each instance's role and TOML configuration, e.g. verifier=verifier.toml."
    ),
    log_level: LogLevel = typer.Option(LogLevel.info, "--log-level", help=_LEVEL_HELP),
    log_json: bool = typer.Option(False, "--log-json", help=_JSON_HELP),
) -> None:
    """Run several instances in one process until SIGINT or SIGTERM: each is the service it is alone
    (its own listener, identity and metrics), and they ask each other by calls instead of over HTTP
    (`sdcp up` runs its cluster so on the CPU)."""
    from sdcp.config import load_config, thread_budget
    from sdcp.logs import configure_logging
    from sdcp.threads import limit_native_threads

    configure_logging(log_level.value, json_lines=log_json)
    with user_errors():
        configs = []
        for given in instances:
            role_name, _, path = given.partition("=")
            if role_name not in Role.__members__ or not path:
                fail(f"{given!r}: give each instance as ROLE=CONFIG, ROLE one of {', '.join(Role.__members__)}")
            configs.append((Role(role_name), load_config(Path(path))))
        # Before the roles' modules import torch: its thread pools read these once; the largest
        # budget of the instances (the verifier's) applies to the process.
        limit_native_threads(max(thread_budget(config, role.value) for role, config in configs))
        nodes = [_build_node(role, config) for role, config in configs]
        from sdcp.together import run_together

        _serve_until_signal(lambda shutdown: run_together(nodes, shutdown))


# -- the local cluster ----------------------------------------------------------------------------


class DtypeName(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class BackendName(StrEnum):
    auto = "auto"
    torch = "torch"
    llamacpp = "llamacpp"


@app.command()
def up(
    redis: str = typer.Option(
        None,
        "--redis",
        help="Use this Redis (redis://[user:password@]host:port/db, rediss:// for TLS) as the MLC's shared tier; "
        "its user must be allowed ACL SETUSER: each role gets a user of its own (docs/security.md).",
    ),
    redis_acl: bool = typer.Option(
        True, "--redis-acl/--no-redis-acl", help="A Redis user per role, or the --redis URL for every role."
    ),
    redis_insecure: bool = typer.Option(
        False,
        "--redis-insecure",
        help="Use a Redis whose default user is open (anyone who reaches it reads and writes everything), "
        "or that keeps its users in no file (they are gone at its restart).",
    ),
    redis_ca: Path = typer.Option(None, "--redis-ca", help="CA of the Redis server's certificate (rediss://)."),
    redis_cert: Path = typer.Option(None, "--redis-cert", help="Client certificate for Redis (rediss://)."),
    redis_key: Path = typer.Option(None, "--redis-key", help="Key of --redis-cert."),
    model: str = typer.Option("smollm2", help="Target model of the verifier."),
    backend: BackendName = typer.Option(
        "auto",
        help="Who runs the target: auto (for smollm2 on the CPU the faster on this host, measured once), "
        "torch or llamacpp.",
    ),
    drafter: list[str] = typer.Option(
        None,
        "--drafter",
        help="Drafter specs: ngram (the default), suffix (prompt lookup plus earlier sessions' outputs), hf:NAME "
        "or llamacpp:NAME_OR_GGUF (a model much smaller than the target).",
    ),
    gateway_port: int = typer.Option(8000, "--gateway-port", help="Port of the OpenAI-compatible API (0: any)."),
    host: str = typer.Option(
        None,
        "--host",
        help="Address the OpenAI-compatible API listens on (default 127.0.0.1). Another than loopback needs "
        "--api-key and serves TLS with a certificate from the cluster's CA.",
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar="SDCP_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1. Kept (mode 0600) in the cluster's home for restarts; "
        "never printed.",
        show_envvar=True,
    ),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="The model name the API reports and accepts (default: --model)."
    ),
    device: str = typer.Option(
        None, "--device", help="Where the verifier (and hf: drafters) run: cpu (default), cuda, cuda:N or mps."
    ),
    dtype: DtypeName = typer.Option(
        None, "--dtype", help="Their precision: float32 (default), bfloat16 or float16 (torch backend)."
    ),
    home: Path = typer.Option(None, help="SDCP home (default $SDCP_HOME or ~/.cache/sdcp)."),
    one_process: bool = typer.Option(
        None,
        "--one-process/--processes",
        help="Run every instance in one process (`sdcp together`; they ask each other without HTTP) "
        "or each in its own. Default: one process where the verifier runs on the cpu and no drafter runs a "
        "model (the verifier's threads take every core, and the services' work costs the passes less so), "
        "else a process each.",
    ),
) -> None:
    """Start a local cluster in the background: router, verifier, drafters, embedded MLC, and the
    OpenAI-compatible API (on 127.0.0.1 unless --host). A cluster that exists is left as it runs,
    its stopped instances restarted with the options it was started with; other options are an error."""
    from sdcp.cluster import DEFAULT_DRAFTERS, LocalCluster

    with user_errors():
        cluster = LocalCluster(home)
        setup = None
        if redis is not None:
            from sdcp.cluster import RedisSetup

            setup = RedisSetup(
                redis, acl=redis_acl, insecure=redis_insecure, ca=redis_ca, cert=redis_cert, key=redis_key
            )
            _check_redis(setup)
        with err_console.status(
            "starting the local cluster (the verifier loads its model; the first time, "
            "it measures which backend runs it faster)..."
        ):
            instances = cluster.up(
                model=model,
                backend=backend.value,
                drafters=tuple(drafter or DEFAULT_DRAFTERS),
                redis_url=setup,
                gateway_port=gateway_port,
                device=device,
                dtype=None if dtype is None else dtype.value,
                host=host,
                served_model_name=served_model_name,
                api_key=api_key,
                one_process=one_process,
            )
    if setup is not None and setup.acl:
        kept = cluster.redis_users_kept_in
        where = f"kept in the server's {kept}" if kept else "NOT kept over a Redis restart (--redis-insecure)"
        err_console.print(f"Redis: a user per role, {where}", highlight=False)
    _print_instances(instances)
    _print_api(LocalCluster(home))
    for name, target in LocalCluster(home).target().items():
        err_console.print(f"{name}: {target}", highlight=False, soft_wrap=True)
    _print_dashboard(LocalCluster(home))


def _print_api(cluster: Any) -> None:
    """How to reach the API: its TLS trust and where its key is, never the key."""
    gateway = cluster.gateway
    if gateway is None:
        return
    notes = []
    if gateway.startswith("https:"):
        notes.append(f"TLS: trust {cluster.certs / 'ca.pem'}")
    if cluster.api_key_file.is_file():
        notes.append(f"API key in {cluster.api_key_file}")
    if notes:
        # Paths and URLs are copied from here: never wrapped mid-way.
        err_console.print(f"API: {gateway} ({'; '.join(notes)})", highlight=False, soft_wrap=True)


def _print_dashboard(cluster: Any) -> None:
    dashboard = cluster.dashboard
    if dashboard is not None:
        err_console.print(f"dashboard: {dashboard}", highlight=False, soft_wrap=True)


def _check_redis(setup: Any) -> None:
    import redis as redis_client

    from sdcp.cache.redis_acl import redact_url

    try:
        redis_client.Redis.from_url(setup.url, socket_connect_timeout=2, **setup.client_options()).ping()
    except (redis_client.RedisError, ValueError) as exc:
        # The URL may carry a password: never printed.
        fail(f"Redis at {redact_url(setup.url)} is unreachable: {exc}")


@app.command("redis-acl")
def redis_acl(
    secrets_dir: Path = typer.Option(
        None, "--secrets", help="Directory of the roles' password files (default: the cluster's home, cluster/redis)."
    ),
    acl_file: Path = typer.Option(
        None, "--acl-file", help="Write an ACL file for redis-server --aclfile (the default user off)."
    ),
    url: str = typer.Option(
        None,
        "--url",
        help="Create the users on this Redis now (ACL SETUSER) with the URL's credentials, and keep them in "
        "its ACL file (ACL SAVE) or configuration file (CONFIG REWRITE).",
    ),
    lock_default: bool = typer.Option(
        False,
        "--lock-default",
        help="With --url: also turn the server's default user off, so that nobody gets in without a user "
        "and password (the URL must name another user, such as sdcp-admin).",
    ),
    prefix: str = typer.Option("sdcp:mlc:", "--prefix", help="The deployment's [mlc] redis_prefix."),
    role: list[str] = typer.Option(
        None, "--role", help="Roles to make users for (default: router, verifier, drafter, mlc, admin)."
    ),
    home: Path = typer.Option(None, help="SDCP home (default $SDCP_HOME or ~/.cache/sdcp)."),
) -> None:
    """Redis ACL users, one per role (sdcp-router, sdcp-verifier, sdcp-drafter, sdcp-mlc for an MLC
    node, sdcp-admin): random passwords kept in files of mode 0600 (reused when they exist), an
    ACL file and/or the users created on a running server. Passwords are never printed."""
    from sdcp.cache.redis_acl import (
        ADMIN,
        ROLE_USERS,
        ROLES,
        UsersNotPersisted,
        acl_file_text,
        create_users,
        ensure_passwords,
        lock_default_user,
        persist_users,
        redact_url,
    )
    from sdcp.home import sdcp_home

    roles = tuple(role or (*ROLES, ADMIN))
    if lock_default and url is None:
        fail("--lock-default acts on a running server: give its --url")
    unknown = sorted(set(roles) - set(ROLE_USERS))
    if unknown:
        fail(f"no Redis user for {', '.join(unknown)}; roles are {', '.join(ROLE_USERS)}")
    with user_errors():
        directory = secrets_dir or (home or sdcp_home()) / "cluster" / "redis"
        passwords = ensure_passwords(directory, roles)
        if acl_file is not None:
            descriptor = os.open(acl_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
                stream.write(acl_file_text(passwords, prefix))
            err_console.print(f"ACL file: {acl_file}", highlight=False)
        if url is not None:
            import redis as redis_client

            client = redis_client.Redis.from_url(url, socket_connect_timeout=5)
            try:
                if lock_default:
                    lock_default_user(client)
                create_users(client, passwords, prefix)
                kept = persist_users(client)
            except (redis_client.RedisError, ValueError, UsersNotPersisted) as exc:
                fail(f"at {redact_url(url)}: {exc}")
            finally:
                client.close()
            locked = "; the default user is off" if lock_default else ""
            err_console.print(f"users created at {redact_url(url)}, kept in its {kept}{locked}", highlight=False)
    for name in roles:
        print(f"{name}\t{ROLE_USERS[name]}\t{directory / f'{name}.password'}")


@app.command()
def down(home: Path = typer.Option(None, help="SDCP home (default $SDCP_HOME or ~/.cache/sdcp).")) -> None:
    """Stop the local cluster."""
    from sdcp.cluster import LocalCluster

    with user_errors():
        stopped = LocalCluster(home).down()
    typer.echo(f"stopped {len(stopped)} instances" if stopped else "no local cluster was running")


@app.command()
def status(
    home: Path = typer.Option(None, help="SDCP home (default $SDCP_HOME or ~/.cache/sdcp)."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object: the instances (name, role, uri, admin, pid, state) and each verifier's target.",
    ),
) -> None:
    """Show the local cluster's instances."""
    from sdcp.cluster import LocalCluster

    with user_errors():
        instances = LocalCluster(home).instances()
        targets = LocalCluster(home).target() if instances else {}
    if not instances:
        fail("no local cluster is running; start one with `sdcp up`")
    if as_json:
        described = [
            {
                "name": instance.name,
                "role": instance.role,
                "uri": instance.uri,
                "admin": instance.admin,
                "pid": instance.pid,
                "state": "running" if instance.alive() else "stopped",
            }
            for instance in instances
        ]
        typer.echo(json.dumps({"instances": described, "targets": targets}))
        return
    _print_instances(instances)
    for name, target in targets.items():
        err_console.print(f"{name}: {target}", highlight=False, soft_wrap=True)


@app.command()
def trace(
    session: str = typer.Argument(..., help="The session id in hex, as the logs print it."),
    as_json: bool = typer.Option(False, "--json", help="Print the rounds as JSON instead of a table."),
    router: str = typer.Option(None, help="A deployment's router (default: the local cluster's)."),
    cert: Path = typer.Option(None, help="With --router: the operator's certificate."),
    key: Path = typer.Option(None, help="With --router: its key."),
    ca: Path = typer.Option(None, help="With --router: the deployment's CA."),
    home: Path = typer.Option(None, help="SDCP home (default $SDCP_HOME or ~/.cache/sdcp)."),
) -> None:
    """Show a session's timeline: each round's drafter, M, accepted tokens, verdict, and where its
    time went (queue for a pass, q-row fetch, scoring, commit-log append, the rest)."""
    from sdcp.cluster import LocalCluster

    try:
        session_id = bytes.fromhex(session)
        if len(session_id) != 16:
            raise ValueError("a session id is 16 bytes")
    except ValueError as exc:
        fail(f"{session!r} is not a session id in hex: {exc}")
    with user_errors():
        if router is None:
            cluster = LocalCluster(home)
            router = cluster.router
            cert, key, ca = cluster.client_credentials()
        elif cert is None or key is None or ca is None:
            fail("--router needs --cert, --key and --ca (an operator's identity, docs/security.md)")
        rounds = asyncio.run(_session_trace(router, cert, key, ca, session_id))
    if as_json:
        typer.echo(json.dumps(rounds))
        return
    _print_trace(session, rounds)


async def _session_trace(router: str, cert: Path, key: Path, ca: Path, session: bytes) -> list[dict[str, Any]]:
    from sdcp.frontend.client import ClusterClient, SessionHandle

    async with ClusterClient(router, cert=cert, key=key, ca=ca) as client:
        handle = await client.locate(SessionHandle(session, 1, "", None))
        _, body = await client.peers.get(handle.verifier).get_cbor(f"sessions/{handle.path_id}/trace")
    if not isinstance(body, list):
        fail("the verifier's trace is not a list of rounds")
    return body


def _print_trace(session: str, rounds: list[dict[str, Any]]) -> None:
    from rich.table import Table

    columns = ("round", "kind", "drafter", "M", "accepted", "emitted", "action", "m_cap")
    times = ("gap", "queue", "fetch", "model", "append", "other")
    headers = (*columns, *(f"{name} ms" for name in times))
    rows = []
    for entry in rounds:
        cells = [entry.get(name) for name in ("round", "kind", "drafter", "proposed", "accepted", "emitted", "action")]
        cells.append(entry.get("m_cap"))
        cells += [entry.get(f"{name}_us") for name in times]
        rows.append(
            ["-" if c is None else f"{c / 1000:.1f}" if i >= len(columns) else str(c) for i, c in enumerate(cells)]
        )
    if not is_terminal():
        typer.echo(f"session {session}\n{plain_table(headers, rows)}")
        return
    table = Table(title=f"session {session}")
    for column in headers:
        table.add_column(column, justify="left" if column in ("kind", "drafter", "action") else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def _print_instances(instances: list[Any]) -> None:
    from rich.table import Table

    columns = ("name", "role", "uri", "admin", "pid", "state")
    rows = [
        (instance.name, instance.role, instance.uri, instance.admin or "-", str(instance.pid), instance.alive())
        for instance in instances
    ]
    if not is_terminal():
        typer.echo(plain_table(columns, [(*row[:5], "running" if row[5] else "stopped") for row in rows]))
        return
    table = Table()
    for column in columns:
        # Folded, never cut: a URI is copied from here.
        table.add_column(column, overflow="fold")
    for *cells, alive in rows:
        table.add_row(*cells, "running" if alive else "[red]stopped[/red]")
    Console().print(table)


# -- generate -------------------------------------------------------------------------------------


class RuleName(StrEnum):
    greedy = "greedy"
    sampling = "sampling"


# The most sessions one `generate` opens (as the gateway's choices of a request).
_MAX_CHOICES = 16


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    max_new: int = typer.Option(128, "--max-new", min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(None, min=0.0, help="Sampling temperature (0 = greedy)."),
    top_k: int = typer.Option(None, "--top-k", min=0, help="Keep the k most probable tokens."),
    top_p: float = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass."),
    seed: int = typer.Option(
        None,
        min=0,
        help="Seed of the session's random values (SDCP 6.4): its draws can be recomputed from the seed, "
        "session id, round and position; every run is a new session, so runs differ. Greedy output is "
        "always the same.",
    ),
    rule: RuleName = typer.Option(
        None,
        help="Acceptance rule: greedy (1) or sampling (2); default sampling when --temperature > 0, "
        "--top-k or --top-p is given, else greedy.",
    ),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to the prompt."),
    system: str = typer.Option(
        None, "--system", help="A system message before the prompt (applies the chat template, as --chat)."
    ),
    stop: list[str] = typer.Option(
        None, "--stop", help="End the generation where this text appears (repeatable); it is left out of the text."
    ),
    n: int = typer.Option(1, "-n", min=1, max=_MAX_CHOICES, help="Generate this many completions, each a session."),
    max_draft: int = typer.Option(
        None, "--max-draft", min=1, max=64, help="Most tokens a drafter proposes in a round (the contract's m_max)."
    ),
    no_speculation: bool = typer.Option(
        False, "--no-speculation", help="No drafter proposes: the verifier decodes alone (same greedy output)."
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object instead of streaming text: the session id, tokens, text, finish reason "
        '(stop, length, eos; fail), statistics; with -n above 1, {"choices": [...]}.',
    ),
    model: str = typer.Option("smollm2", help="Target model (for the tokenizer and a new local cluster)."),
    home: Path = typer.Option(None, help="SDCP home (default $SDCP_HOME or ~/.cache/sdcp)."),
) -> None:
    """Generate a completion on the local cluster (started if needed), streaming the text."""
    from sdcp.cluster import LocalCluster
    from sdcp.protocol.messages import Sampling

    with user_errors():
        rule = _chosen_rule(rule, temperature, top_k, top_p, seed)
        if no_speculation and max_draft is not None:
            fail("--no-speculation leaves no proposal for --max-draft to bound: give one of them")
        stops = tuple(stop or ())
        if any(not text for text in stops):
            fail("--stop needs a non-empty text")
        codec = _load_codec(model, home)
        prompt_ids = _tokenize(codec, prompt, chat or system is not None, system)
        sampling = None
        if rule is RuleName.sampling:
            sampling = Sampling(
                temperature_milli=None if temperature is None else round(temperature * 1000),
                top_k=top_k,
                top_p_milli=None if top_p is None else round(top_p * 1000),
                seed=seed,
            )
        cluster = LocalCluster(home)
        _ensure_running(cluster, model)
        if not as_json:
            _print_dashboard(cluster)
        request = _Request(
            prompt_ids, max_new, 1 if rule is RuleName.greedy else 2, sampling, stops, n, max_draft, no_speculation
        )
        result = asyncio.run(_generate(cluster, codec, request, as_json))
    if as_json:
        typer.echo(json.dumps(result))


def _chosen_rule(
    rule: RuleName | None, temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None
) -> RuleName:
    """The rule the options ask for; options that the rule would ignore are a one-line error."""
    shaping = [
        name
        for name, given in (
            ("--temperature", bool(temperature)),
            ("--top-k", top_k is not None),
            ("--top-p", top_p is not None),
        )
        if given
    ]
    if rule is RuleName.greedy and (shaping or seed is not None):
        given = ", ".join([*shaping, *(["--seed"] if seed is not None else [])])
        fail(
            f"--rule greedy takes the most probable token and would ignore {given}: "
            "leave them out or use --rule sampling"
        )
    if rule is None:
        rule = RuleName.sampling if shaping else RuleName.greedy
    if rule is RuleName.greedy and seed is not None:
        fail("--seed applies only to sampling: give --temperature above 0, --top-k, --top-p or --rule sampling")
    return rule


def _ensure_running(cluster: Any, model: str) -> None:
    """Start the local cluster, or restart only the instances of it that stopped."""
    if cluster.running():
        return
    # LocalCluster.up restarts the stopped instances of a cluster, or starts a new one.
    stopped = ", ".join(instance.name for instance in cluster.stopped())
    if stopped:
        err_console.print(f"restarting {stopped}, which stopped (logs in {cluster.root / 'logs'})", highlight=False)
    starting = "starting the local cluster (first time: loads the model)..."
    with err_console.status(f"restarting {stopped}..." if stopped else starting):
        cluster.up(model=model)


def _load_codec(model: str, home: Path | None) -> TextCodec:
    """The gateway's text codec of ``model``: the same chat rendering and tokens as an OpenAI request."""
    from sdcp.frontend.text import load_text_codec

    return load_text_codec(model, home)


def _tokenize(codec: TextCodec, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    if chat:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": prompt})
        return codec.encode_chat(messages)
    return codec.encode(prompt)


@dataclass(frozen=True)
class _Request:
    """What `generate` asks of each of its sessions."""

    prompt_ids: list[int]
    max_new: int
    rule: int
    sampling: Any
    stops: tuple[str, ...]
    n: int
    # Per-request speculation (docs/services.md): the contract's m_max, or None for the default;
    # whether no drafter may propose (session request self_decode_only).
    max_draft: int | None = None
    self_decode_only: bool = False


async def _generate(cluster: Any, codec: TextCodec, request: _Request, as_json: bool) -> dict[str, Any]:
    from rich.text import Text

    from sdcp.frontend.client import DEFAULT_M_MAX, ClusterClient, build_contract
    from sdcp.frontend.stops import stop_token_ids

    cert, key, ca = cluster.client_credentials()
    async with ClusterClient(cluster.router, cert=cert, key=key, ca=ca) as client:
        targets = await client.targets()
        if not targets:
            fail("the cluster has no live verifier; see `sdcp status` and the logs")
        target_digest, tokenizer_digest = targets[0]["model"], targets[0]["tokenizer"]
        if not isinstance(target_digest, bytes) or not isinstance(tokenizer_digest, bytes):
            fail("the router's target list does not give the target's digests")
        eos = set(codec.end_of_text_tokens())
        contract = build_contract(
            target=target_digest,
            tokenizer=tokenizer_digest,
            rule=request.rule,
            max_new=request.max_new,
            stop=list(stop_token_ids(codec, request.stops)),
            sampling=request.sampling,
            m_max=request.max_draft or DEFAULT_M_MAX,
        )
        started = time.monotonic()
        opened = await asyncio.gather(
            *(
                client.open(
                    request.prompt_ids,
                    contract,
                    self_decode_only=request.self_decode_only,
                    # As the gateway: stop strings are matched in the text, as soon as it comes.
                    self_decode_group_ms=0 if request.stops else None,
                )
                for _ in range(request.n)
            ),
            return_exceptions=True,
        )
        handles = [h for h in opened if not isinstance(h, BaseException)]
        failure = next((e for e in opened if isinstance(e, BaseException)), None)
        if failure is not None:
            await _cancel_all(client, handles)
            raise failure
        live = request.n == 1 and not as_json
        try:
            choices = await asyncio.gather(
                *(_choice(client, codec, handle, request, eos, started, live=live) for handle in handles)
            )
        except asyncio.CancelledError:
            # Ctrl-C: end the sessions rather than leave the verifier decoding to max_new.
            await _cancel_all(client, handles)
            raise
    for index, summary in enumerate(choices):
        summary["prompt_tokens"] = len(request.prompt_ids)
        if not as_json and request.n > 1:
            sys.stdout.write(f"--- choice {index} (session {summary['session']})\n{summary['text']}\n")
        if not as_json:
            err_console.print(Text(_summary_line(summary), style="dim"), soft_wrap=True)
    if not as_json and any(summary["finish"] == "fail" for summary in choices):
        fail("the verifier ended the session with an error (escalation ladder exhausted)")
    if request.n == 1:
        return choices[0]
    return {"choices": [{"index": index, **summary} for index, summary in enumerate(choices)]}


async def _cancel_all(client: ClusterClient, handles: list[SessionHandle]) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.gather(*(client.cancel(h) for h in handles)), _CANCEL_WAIT_S)


async def _choice(
    client: ClusterClient,
    codec: TextCodec,
    handle: SessionHandle,
    request: _Request,
    eos: set[int],
    started: float,
    *,
    live: bool,
) -> dict[str, Any]:
    """One session's tokens, text and finish reason; its text streamed to stdout with ``live``
    (held back by what may start a stop text, as the gateway's answers are)."""
    from rich.live import Live
    from rich.text import Text

    from sdcp.frontend.stops import ChoiceText
    from sdcp.protocol.messages import Action

    tokens: list[int] = []
    text = ""
    finish = None
    stopped = False
    stats: dict[str, Any] = {}
    decoded = ChoiceText(codec, request.stops)
    status = Live(Text(""), console=err_console, transient=True, refresh_per_second=8) if live else None
    last_stats = 0.0
    if status is not None:
        status.start()
    try:
        async for chunk in client.stream(handle):
            if chunk.verifier is not None and chunk.verifier != handle.verifier:
                # A failover: the statistics are the new verifier's; the old one may never answer.
                handle = dataclasses.replace(handle, verifier=chunk.verifier, epoch=chunk.epoch)
            tokens.extend(chunk.tokens)
            finish = chunk.finish
            ready, stopped = decoded.add(chunk.tokens, last=finish is not None)
            text += ready
            if stopped:
                # The stop text decides the end (one of a single token also stopped the session at
                # the verifier): the tokens up to its end, the text before it; a session that goes
                # on is cancelled.
                assert decoded.stopped_by is not None
                tokens = _tokens_to(codec, tokens, len(text) + len(decoded.stopped_by))
                if finish is None:
                    await _cancel_all(client, [handle])
            now = time.monotonic()
            if now - last_stats > 0.25 or finish is not None or stopped:
                stats = await _safe_stats(client, handle)
                last_stats = now
            if status is not None:
                sys.stdout.write(ready)
                sys.stdout.flush()
                status.update(_status_line(len(tokens), now - started, stats))
            if stopped:
                break
    finally:
        if status is not None:
            status.stop()
            sys.stdout.write("\n")
    elapsed = time.monotonic() - started
    if stopped:
        reason = "stop"
    elif finish is Action.FINISH:
        reason = "eos" if tokens and tokens[-1] in eos else "length"
    else:
        reason = finish.name.lower() if finish is not None else "unknown"
    return {
        "session": handle.session.hex(),
        "tokens": tokens,
        "text": text,
        "finish": reason,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(len(tokens) / elapsed, 2) if elapsed > 0 else None,
        "stats": stats,
    }


def _tokens_to(codec: TextCodec, tokens: list[int], length: int) -> list[int]:
    """The fewest leading tokens whose text reaches ``length`` characters: the output up to the
    token that ended the stop text."""
    for count in range(1, len(tokens) + 1):
        if len(codec.decode(tokens[:count])) >= length:
            return tokens[:count]
    return tokens


async def _safe_stats(client: ClusterClient, handle: SessionHandle) -> dict[str, Any]:
    from sdcp.protocol.problems import ProtocolError
    from sdcp.transport.errors import TransportError

    try:
        # Statistics only: a verifier that does not answer at once never holds up the output.
        async with asyncio.timeout(_STATS_WAIT_S):
            return await client.stats(handle)
    except (ProtocolError, TransportError, TimeoutError):
        return {}


def _acceptance(stats: dict[str, Any]) -> str:
    proposed = stats.get("proposed", 0)
    return f"{100 * stats.get('accepted', 0) / proposed:.0f}%" if proposed else "-"


def _status_line(count: int, elapsed: float, stats: dict[str, Any]) -> Any:
    from rich.text import Text

    rate = count / elapsed if elapsed > 0 else 0.0
    drafter = stats.get("drafter", "-")
    return Text(
        f"{count} tokens  {rate:.1f} tok/s  acceptance {_acceptance(stats)}  drafter {drafter}  "
        f"m_cap {stats.get('m_cap', '-')}  escalations {stats.get('escalations', 0)}  "
        f"self-decoded {stats.get('self_decoded', 0)}",
        style="dim",
    )


def _summary_line(summary: dict[str, Any]) -> str:
    stats = summary["stats"]
    return (
        f"[{summary['finish']}] {len(summary['tokens'])} tokens in {summary['seconds']:.2f} s "
        f"({summary['tokens_per_second']} tok/s), {stats.get('rounds', 0)} rounds, "
        f"acceptance {_acceptance(stats)}, {stats.get('self_decoded', 0)} self-decoded, "
        f"{stats.get('escalations', 0)} escalations"
    )


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="A reduced set that runs in under 10 minutes."),
    out: Path = typer.Option(
        Path("bench"),
        "--out",
        help=(
            "Directory for results.json, results.md and plots, and the clusters the run starts"
            " (each started afresh: nothing of an earlier run into it is kept)."
        ),
    ),
    model: str = typer.Option("smollm2", help="Target model of every system."),
    prompts: Path = typer.Option(None, help="Prompt directory (default: the set in the package, sdcp/bench/prompts)."),
    per_workload: int = typer.Option(None, "--per-workload", min=1, help="Prompts per workload."),
    max_new: int = typer.Option(None, "--max-new", min=1, help="Tokens per generation."),
    repeats: int = typer.Option(None, min=1, help="Runs of every system on every prompt."),
    concurrency: str = typer.Option(None, help="Comma-separated session counts, e.g. 1,4,8,16."),
    redis: bool = typer.Option(True, "--redis/--no-redis", help="Also run the Redis tier when redis-server exists."),
    workloads: str = typer.Option(
        None, help="Comma-separated workloads to run, e.g. structured (default: all of them)."
    ),
    systems: str = typer.Option(
        None,
        help="Comma-separated systems to run, sdcp_target_only among them, e.g. "
        "sdcp_target_only,sdcp_default (default: all of them).",
    ),
    llama_server: Path = typer.Option(
        None,
        "--llama-server",
        help="The llama-server binary of the agent and serving workloads (default: built once from the installed "
        "llama-cpp-python's llama.cpp source).",
    ),
) -> None:
    """Benchmark target-only, transformers speculative, SDCP in-process, SDCP end to end, and the
    default `sdcp up` cluster through its OpenAI gateway (what a user runs). `--workloads agent`
    runs the agent workload instead: the default cluster with and without its prefix cache against
    llama-server, streamed chat requests with a long shared system prompt (agent.md);
    `--workloads serving` runs short streamed chat questions at 1, 4 and 16 streams (`--concurrency`;
    `--per-workload`: questions per stream; `--repeats`: runs of it all, each on servers started
    afresh, each after one warm-up request reported apart, figures their medians) against
    llama-server with 16 slots (serving.md). Both run the
    bundled model on questions of their own: --quick, --model and --prompts (for agent, --repeats
    and --concurrency too) are refused there."""
    from sdcp.bench import BenchConfig, BenchInputError, run_bench
    from sdcp.bench.report import write_report
    from sdcp.bench.workloads import DEFAULT_PROMPTS_DIR

    chosen = _names(workloads)
    if chosen in (("agent",), ("serving",)):
        # These workloads run the bundled model against llama-server, on questions of their own.
        unused = {
            "--quick": quick,
            "--model": model != "smollm2",
            "--prompts": prompts is not None,
            "--repeats": repeats is not None and chosen == ("agent",),
            "--concurrency": concurrency is not None and chosen == ("agent",),
        }
        given = [option for option, used in unused.items() if used]
        if given:
            fail(f"{', '.join(given)} does not apply to --workloads {chosen[0]}")
    if chosen == ("agent",):
        _agent_bench(out, max_new, per_workload, llama_server, _names(systems))
        return
    with user_errors():
        try:
            levels = tuple(int(level) for level in concurrency.split(",")) if concurrency else None
        except ValueError:
            fail(f"--concurrency must be comma-separated integers, got {concurrency!r}")
        if chosen == ("serving",):
            _serving_bench(out, max_new, per_workload, levels, llama_server, _names(systems), repeats)
            return
        config = BenchConfig(
            out=out,
            model=model,
            quick=quick,
            prompts_dir=prompts or DEFAULT_PROMPTS_DIR,
            per_workload=per_workload,
            max_new=max_new,
            repeats=repeats,
            concurrency=levels,
            redis=redis,
            workloads=_names(workloads),
            systems=_names(systems),
        )
        try:
            data = run_bench(config)
        except BenchInputError as exc:
            fail(str(exc))
        summary = write_report(data, "sdcp " + " ".join(sys.argv[1:]))
    typer.echo((out / "results.md").read_text(encoding="utf-8"))
    if not summary["identical_outputs"]:
        fail("outputs of the exact systems differ from target-only decoding; see mismatches in results.json")


def _agent_bench(
    out: Path, max_new: int | None, turns: int | None, llama_server: Path | None, systems: tuple[str, ...] | None
) -> None:
    from sdcp.bench.agent import AgentConfig, run_agent_bench
    from sdcp.bench.workloads import BenchInputError

    with user_errors():
        config = AgentConfig(out=out, max_tokens=max_new or 96, turns=turns, llama_server=llama_server)
        if systems is not None:
            config = AgentConfig(out, config.max_tokens, turns, llama_server, systems)
        try:
            run_agent_bench(config, lambda message: typer.echo(message, err=True))
        except BenchInputError as exc:
            fail(str(exc))
    typer.echo((out / "agent.md").read_text(encoding="utf-8"))


def _serving_bench(
    out: Path,
    max_new: int | None,
    per_stream: int | None,
    streams: tuple[int, ...] | None,
    llama_server: Path | None,
    systems: tuple[str, ...] | None,
    repeats: int | None = None,
) -> None:
    from sdcp.bench.serving import STREAMS, ServingConfig, run_serving_bench
    from sdcp.bench.workloads import BenchInputError

    config = ServingConfig(out, max_new or 96, per_stream, streams or STREAMS, llama_server, repeats=repeats or 1)
    if systems is not None:
        config = dataclasses.replace(config, systems=systems)
    try:
        run_serving_bench(config, lambda message: typer.echo(message, err=True))
    except BenchInputError as exc:
        fail(str(exc))
    typer.echo((out / "serving.md").read_text(encoding="utf-8"))


def _names(text: str | None) -> tuple[str, ...] | None:
    """A comma-separated list of names; None for an option not given."""
    return None if text is None else tuple(name.strip() for name in text.split(",") if name.strip())


def main() -> None:
    app()
