"""Prometheus: ``GET /metrics``, the advisor's registry followed by the API's own (hit rates)
(docs/operations.md, "Metrics")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery

__all__ = ["metrics_router"]

_METRICS_EXAMPLE = '# TYPE kvadvisor_index_blocks gauge\nkvadvisor_index_blocks{location="w0/g1"} 4.0\n'


def metrics_router(query: AdvisorQuery, api_metrics: CollectorRegistry, read: Sequence[Any]) -> APIRouter:
    """``GET /metrics`` (``read`` scope): ``query.metrics_registry()`` then ``api_metrics``."""
    router = APIRouter()

    @router.get("/metrics", dependencies=list(read), response_class=Response,
                responses={200: {"content": {CONTENT_TYPE_LATEST: {"example": _METRICS_EXAMPLE}},
                                 "description": "Prometheus text"}})
    def metrics() -> Response:
        return Response(generate_latest(query.metrics_registry()) + generate_latest(api_metrics),
                        media_type=CONTENT_TYPE_LATEST)

    return router
