"""``/metrics`` for every role (prometheus-client).

The route is mounted on the role's mTLS listener like any other: a scraper presents a certificate
from the deployment's CA, and no further authorization applies, because the numbers expose load
and acceptance rates, not session contents.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = ["metrics_route"]


def metrics_route(path: str = "/metrics", registry: CollectorRegistry = REGISTRY) -> Route:
    """A starlette route that serves ``registry`` in the Prometheus text format."""

    async def metrics(_request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Route(path, metrics, methods=["GET"])
