"""FastAPI app over an :class:`advisor.ops.query.AdvisorQuery`: :func:`create_app` assembles
the routers of :mod:`api.routers` (one per area), the indexer's, the dashboard and the guards.

Routes (all JSON unless stated; scopes in brackets when tokens are configured, :mod:`api.auth`):

=====================================  ==================================================
``GET  /v1/blocks/{sequence_hash}``    one block (decimal or 0x-hex); 404 if unknown [read]
``POST /v1/lookup``                    sequence hashes or token ids → longest prefix per
                                       location, tier and worker; a prefetch hint
                                       (:mod:`advisor.moves.prefetch`) [read]
``GET  /v1/locations``                 blocks per location [read]
``GET  /v1/locations/{loc}/blocks``    sequence hashes at a location, paged [read]
``GET  /v1/volumes``                   volumes with role, usage, indexed blocks, paged [read]
``GET  /v1/stats``                     index / ingest / mover / subscriber figures [read]
``GET  /v1/plans?limit=N&cursor=C``    recent executed plan items with reasons, paged [read]
``POST /v1/plans/run``                 run one policy round now; its results [admin]
``GET  /metrics``                      Prometheus text exposition [read]
``GET  /healthz``, ``GET /health``     health (open): ``/healthz`` 200 ok, 503 while journal
                                       writes fail or a partition is taken over
indexer routes                         :mod:`api.indexer` (``/register``, ``/query``...)
=====================================  ==================================================

Errors have one shape, ``{"error": code, "detail": text}`` (:mod:`api.errors`); every hash
goes out as a number and as a ``0x`` string. docs/operations.md lists codes and settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from api.auth import ApiSecurity, ApiSecuritySettings, GuardMiddleware, require_admin, require_read
from api.dashboard import mount_dashboard
from api.errors import ERROR_RESPONSES, ApiError, install_error_handlers
from api.hit_rates import HitRateCollector, HitRates
from api.indexer import indexer_router
from api.indexer_registry import IndexerCollector, IndexerRegistry
from api.register_policy import EndpointPolicy
from api.routers.blocks import blocks_router
from api.routers.metrics import metrics_router
from api.routers.plans import plans_router
from api.routers.stats import stats_router
from api.routers.volumes import volumes_router

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery

__all__ = ["ApiError", "create_app"]


def create_app(
    query: AdvisorQuery,
    *,
    security: ApiSecuritySettings | None = None,
    bind_host: str = "127.0.0.1",
    registry: IndexerRegistry | None = None,
) -> FastAPI:
    """Build the REST API for one advisor.

    Args:
        query: the advisor's read interface (thread-safe).
        security: tokens, allowed hosts / origins, body limit (default: from the
            environment, ``KVADVISOR_API_*``).
        bind_host: the address the server listens on (for the Host check).
        registry: the indexer-compatible routes' registry (by default a new one that keeps
            its registrations in the advisor's run state and restores them); closed by the
            caller (``api.server``).

    Raises:
        pydantic.ValidationError: bad security settings in the environment.
    """
    settings = security if security is not None else ApiSecuritySettings()
    # no /docs or /redoc: they load JavaScript from a CDN into this API's origin (where the
    # admin routes live); the schema itself needs the read scope like every read route
    app = FastAPI(title="kvadvisor", version="0.1.0", description="KV-cache block index, volumes and advisor plans",
                  responses=ERROR_RESPONSES, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.security = ApiSecurity(settings, bind_host)
    if registry is None:
        closed = not getattr(query, "plain_zmq_allowed", lambda: True)()
        policy = EndpointPolicy.of(settings.register_networks, settings.register_resolve_names, closed)
        store = query if hasattr(query, "load_registrations") else None
        registry = IndexerRegistry(settings.max_registrations, max_indexes=settings.max_indexes, policy=policy,
                                   store=store, max_worker_blocks=settings.max_worker_blocks,
                                   max_blocks=settings.max_indexer_blocks)
        registry.restore()
    app.state.indexer_registry = registry
    app.add_middleware(GuardMiddleware, security=app.state.security)
    install_error_handlers(app)
    read, admin = [Depends(require_read)], [Depends(require_admin)]
    rates = {"lookup": HitRates("lookup"), "query": HitRates("query")}
    app.state.hit_rates = rates
    api_metrics = CollectorRegistry(auto_describe=False)
    api_metrics.register(HitRateCollector(rates.values()))
    api_metrics.register(IndexerCollector(registry))

    app.include_router(blocks_router(query, rates["lookup"], read))
    app.include_router(volumes_router(query, read, admin))
    app.include_router(stats_router(query, rates, read, indexer=registry.stats))
    app.include_router(plans_router(query, read, admin))
    app.include_router(metrics_router(query, api_metrics, read))

    @app.get("/openapi.json", include_in_schema=False, dependencies=read)
    def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.include_router(indexer_router(app.state.indexer_registry, read=[require_read], admin=[require_admin],
                                      hit_rates=rates["query"]))
    mount_dashboard(app)
    return app
