"""Stats and health: ``GET /v1/stats``, ``GET /healthz`` (200 ok, 503 unhealthy), ``GET
/health`` (always 200) (docs/operations.md, "REST API")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from api.hit_rates import HitRates
from api.models import HealthResponse, StatsResponse

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery

__all__ = ["stats_router"]


def stats_router(query: AdvisorQuery, rates: Mapping[str, HitRates], read: Sequence[Any], *,
                 indexer: Callable[[], dict[str, Any]] | None = None) -> APIRouter:
    """The stats (``read`` scope) and health (open) routes over ``query``; ``rates``: the
    hit rates by kind (``lookup``, ``query``) that ``/v1/stats`` reports; ``indexer``: the
    indexer routes' figures (:meth:`api.indexer_registry.IndexerRegistry.stats`)."""
    router = APIRouter()

    @router.get("/v1/stats", response_model=StatsResponse, dependencies=list(read))
    def stats() -> StatsResponse:
        body = query.stats()
        body["hit_rates"] = {kind: t.snapshot() for kind, t in rates.items()}
        if indexer is not None:
            body["indexer"] = indexer()
        return StatsResponse.model_validate(body)

    @router.get("/healthz", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    def healthz() -> Response:
        health = HealthResponse.model_validate(query.health())
        return JSONResponse(health.model_dump(), status_code=200 if health.status == "ok" else 503)

    @router.get("/health", response_model=HealthResponse)
    def health() -> HealthResponse:
        return HealthResponse.model_validate(query.health())

    return router
