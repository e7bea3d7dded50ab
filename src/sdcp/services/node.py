"""What every SDCP role shares: the mTLS listener, pooled peer clients, the MLC, status reports."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Sequence
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from sdcp.cache import MLC, AccessDenied, StoreUnavailable
from sdcp.cache.redis import RedisStore
from sdcp.config import OWN_MLC, ServiceConfig
from sdcp.engines.errors import OverQuota, SessionNotFound, Unanswered, Unavailable
from sdcp.engines.tasks import BackgroundTasks
from sdcp.models.worker import InlineModelThread, ModelThread, ModelThreadClosed
from sdcp.protocol.codec import DEFAULT_MAX_SIZE
from sdcp.protocol.messages import Status, instance_path_id
from sdcp.services.admin import AdminServer, Readiness
from sdcp.services.authz import Trust
from sdcp.services.mlc_client import RemoteStore
from sdcp.transport.asgi import exception_handlers, problem_response
from sdcp.transport.client import PeerClients
from sdcp.transport.errors import NotFound, ServiceUnavailable, TooManyRequests
from sdcp.transport.local import LocalGate
from sdcp.transport.metrics import metrics_route
from sdcp.transport.server import DEFAULT_GRACEFUL_TIMEOUT_S, Listener, MTLSServer, Server

__all__ = ["ModelThreadDied", "Node", "build_mlc"]

log = logging.getLogger("sdcp.services")


class ModelThreadDied(RuntimeError):
    """The thread that owns the instance's model died: the instance stopped, and its process
    exits so that a supervisor starts it again (docs/reliability.md)."""


def build_mlc(config: ServiceConfig, *, store_every_authority: bool = False, role: str | None = None) -> MLC:
    """The instance's MLC, with the MLC nodes that serve other authorities' cache-refs (SDCP 5.2).
    An authority neither ``[mlc] authority`` nor listed is refused (``UnresolvableRef``, a 400
    naming the member) unless ``[mlc] unlisted = "own"``, or ``store_every_authority``: an MLC
    node's, which stores whatever name its clients chose it for. ``role`` is whose Redis user
    ``[mlc] redis_username`` is (sdcp.cache.redis_acl): its reads refresh only what it may write."""
    mlc = config.mlc
    instance = config.instance

    def node(url: str) -> RemoteStore:
        return RemoteStore(url, cert=instance.cert, key=instance.key, ca=instance.ca)

    return MLC.from_config(
        authority=mlc.authority,
        memory_bytes=mlc.memory_bytes,
        disk_dir=mlc.disk_dir,
        disk_bytes=mlc.disk_bytes,
        redis_url=mlc.redis_url,
        redis_prefix=mlc.redis_prefix,
        redis_access=mlc.redis_access(role) if mlc.redis_url is not None else None,
        remote=node(mlc.mlc_url) if mlc.mlc_url is not None else None,
        routes={
            authority: MLC.from_config(authority=authority, memory_bytes=0, remote=node(target))
            for authority, target in mlc.authorities.items()
            if target != OWN_MLC
        },
        own_authorities=[authority for authority, target in mlc.authorities.items() if target == OWN_MLC],
        serves_unlisted=store_every_authority or mlc.unlisted == OWN_MLC,
    )


async def _not_found(_request: Request, exc: Exception) -> Response:
    return problem_response(NotFound(str(exc)))


async def _unavailable(_request: Request, exc: Exception) -> Response:
    retry_after = exc.retry_after_s if isinstance(exc, Unavailable) else None
    return problem_response(ServiceUnavailable(str(exc), retry_after_s=retry_after))


async def _over_quota(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OverQuota)
    return problem_response(TooManyRequests(str(exc), retry_after_s=exc.retry_after_s))


async def _store_unavailable(_request: Request, exc: Exception) -> Response:
    # The shared store (Redis, an MLC node) did not answer: the request may be repeated shortly.
    return problem_response(ServiceUnavailable(str(exc), retry_after_s=1))


# What the engines raise besides protocol problems, as the problem answers of RFC 9457.
# Unanswered: a peer the engine needed for the request did not answer; the request may be repeated.
_ENGINE_ERROR_HANDLERS = {
    SessionNotFound: _not_found,
    Unavailable: _unavailable,
    Unanswered: _unavailable,
    # The instance's model thread died: it serves nothing until restarted (another instance may).
    ModelThreadClosed: _unavailable,
    OverQuota: _over_quota,
    StoreUnavailable: _store_unavailable,
}


class Node(ABC):
    """One running instance of a role: serves its routes and reports status to the router."""

    # The role's name in the authorization table (sdcp.services.authz.TABLE).
    role: str

    def __init__(self, config: ServiceConfig, mlc: MLC | None = None) -> None:
        self.config = config
        self.uri = config.instance.uri
        self.trust = Trust.from_config(config, self.role)
        self.mlc = mlc if mlc is not None else build_mlc(config, role=self.role)
        instance = config.instance
        self.peers = PeerClients(instance.cert, instance.key, instance.ca)
        self._server: Server | None = None
        # The calls of instances of this process (sdcp.together), which its listener never sees.
        self.local_gate = LocalGate(max_body_bytes=self.max_body_bytes)
        self._admin: AdminServer | None = None
        self._tasks = BackgroundTasks(self.uri, log)
        # When a router last took this instance's status report (time.monotonic).
        self._reported_at: float | None = None
        # Set from a model thread that died (on that thread): the instance stops serving.
        self._model_died = asyncio.Event()

    @abstractmethod
    def routes(self) -> list[BaseRoute]:
        """The role's resources of SDCP Table 1, relative to the base URI."""

    @property
    def max_body_bytes(self) -> int:
        """The largest request body the listener takes: an SDCP message (sdcp.protocol.codec)."""
        return DEFAULT_MAX_SIZE

    def status(self) -> Status | None:
        """This instance's current status report (SDCP 5.2); None for instances that report none
        (the router itself, an MLC node: status roles are drafter and verifier only)."""
        return None

    def admin_routes(self) -> list[BaseRoute]:
        """The role's pages on the admin listener besides /health, /ready, /metrics, /version."""
        return []

    def build(self) -> dict[str, str]:
        """What GET /version says of this instance besides sdcp's version and the role."""
        return {}

    def model_threads(self) -> Sequence[ModelThread | InlineModelThread]:
        """The threads that own the instance's models: the instance works only while each lives."""
        return ()

    def model_failure(self) -> BaseException | None:
        """What killed a model thread of this instance, if one died."""
        return next((thread.failure for thread in self.model_threads() if thread.failure is not None), None)

    async def readiness(self) -> Readiness:
        """Whether the instance can do its work (GET /ready on the admin listener): not once a model
        thread died; an instance that reports status is ready while a router holds a report of it
        that has not expired."""
        failure = self.model_failure()
        if failure is not None:
            return Readiness(False, f"the model thread died: {failure!r}")
        if isinstance(self.mlc.shared, RedisStore):
            # A role whose Redis user is refused (users lost at a restart) can do nothing: every
            # request would hang on the store. Each /ready asks again (redis-py reconnects).
            try:
                await self.mlc.shared.ping()
            except AccessDenied as exc:
                return Readiness(False, f"Redis refuses this role's user: {exc}")
            except StoreUnavailable as exc:
                return Readiness(False, f"Redis is unreachable: {exc}")
        if self.status() is None:
            return Readiness(True, "serving")
        ttl_s = self.config.instance.ttl_ms / 1000
        if self._reported_at is None or time.monotonic() - self._reported_at > ttl_s:
            return Readiness(False, "not registered at the router")
        return Readiness(True, "registered at the router")

    async def on_start(self) -> None:  # noqa: B027 - an optional hook
        """Role-specific start-up, before the listener opens."""

    async def on_stop(self) -> None:  # noqa: B027 - an optional hook
        """Role-specific shutdown, after the listener closed."""

    def app(self) -> Starlette:
        routes = [*self.routes(), self._guarded_metrics()]
        prefix = urlsplit(self.uri).path.rstrip("/")
        return Starlette(
            routes=[Mount(prefix, routes=routes)] if prefix else routes,
            exception_handlers={**exception_handlers(), **_ENGINE_ERROR_HANDLERS},
        )

    @cached_property
    def served_app(self) -> Starlette:
        """The app its listener serves, made once: the instances of its process call it too
        (sdcp.together)."""
        return self.app()

    def _guarded_metrics(self) -> Route:
        serve = metrics_route().endpoint

        async def metrics(request: Request) -> Response:
            self.trust.admit(request, "GET metrics")
            response: Response = await serve(request)
            return response

        return Route("/metrics", metrics, methods=["GET"])

    async def start(self) -> None:
        await self.on_start()
        instance = self.config.instance
        listener = Listener.mtls(
            instance.host,
            instance.port,
            cert=instance.cert,
            key=instance.key,
            ca=instance.ca,
            max_body_bytes=self.max_body_bytes,
        )
        self._server = MTLSServer(self.served_app, listener)
        await self._server.start()
        loop = asyncio.get_running_loop()

        def died(_exc: BaseException) -> None:
            loop.call_soon_threadsafe(self._model_died.set)

        for thread in self.model_threads():
            thread.on_death = died
        if self.status() is not None:
            # Every router hears of the instance, so that each can assign to it and take over the
            # sessions of another (docs/reliability.md, "Routers").
            for router in self._routers():
                self.spawn(self._report_status_forever(router))
        if self.config.admin.listen is not None:
            self._admin = AdminServer(
                self.role, self.config.admin.listen, self.readiness, self.admin_routes(), build=self.build()
            )
            await self._admin.start()
        log.info("%s listening on %s", type(self).__name__, self.uri)

    async def stop(self) -> None:
        await self._tasks.cancel_all()
        if self._admin is not None:
            await self._admin.stop()
        # The process's own calls stop as the listener stops taking connections, and drain after it.
        self.local_gate.close()
        if self._server is not None:
            await self._server.stop()
        await self.local_gate.drained(DEFAULT_GRACEFUL_TIMEOUT_S)
        await self.on_stop()
        await self.peers.aclose()
        await self.mlc.close()

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    async def run_until(self, shutdown: asyncio.Event) -> None:
        """Serve until ``shutdown`` is set; raises ModelThreadDied, after stopping, where a model
        thread died first (the instance cannot work: a supervisor restarts the process)."""
        await self.start()
        try:
            stopping = asyncio.ensure_future(shutdown.wait())
            dying = asyncio.ensure_future(self._model_died.wait())
            try:
                await asyncio.wait((stopping, dying), return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                dying.cancel()
        finally:
            await self.stop()
        failure = self.model_failure()
        if failure is not None and not shutdown.is_set():
            raise ModelThreadDied(f"{self.uri}: the model thread died: {failure!r}")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background for the life of the node; failures are logged."""
        return self._tasks.spawn(coro)

    async def report_status(self, router: str) -> None:
        # An instance whose model thread died reports nothing: routers let its status expire and
        # move its sessions elsewhere (SDCP 6.1, 6.9).
        status = None if self.model_failure() is not None else self.status()
        if status is not None:
            path = f"instances/{instance_path_id(self.uri)}/status"
            await self.peers.get(router).put_cbor(path, status.to_obj())
            self._reported_at = time.monotonic()

    def report_status_soon(self) -> None:
        """Send a status report now, besides the periodic ones (a measurement the routers await)."""
        for router in self._routers():
            self.spawn(self._try_report_status(router))

    def _routers(self) -> tuple[str, ...]:
        return tuple(router for router in self.config.instance.routers if router != self.uri)

    async def _try_report_status(self, router: str) -> None:
        try:
            await self.report_status(router)
        except Exception as exc:  # noqa: BLE001 - a router that is down must not stop the instance
            log.warning("%s: status report to %s failed: %s", self.uri, router, exc)

    async def _report_status_forever(self, router: str) -> None:
        # SDCP 6.1: each instance reports status at intervals shorter than its ttl_ms.
        interval = self.config.instance.ttl_ms / 3000
        while True:
            await self._try_report_status(router)
            await asyncio.sleep(interval)
