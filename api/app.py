"""FastAPI app over an :class:`advisor.query.AdvisorQuery`.

Routes (all JSON unless stated; scopes in brackets when tokens are configured, :mod:`api.auth`):

=====================================  ==================================================
``GET  /v1/blocks/{sequence_hash}``    one block (decimal or 0x-hex); 404 if unknown [read]
``POST /v1/lookup``                    sequence hashes or token ids → longest prefix per
                                       location, tier and worker; a prefetch hint
                                       (:mod:`advisor.prefetch`) [read]
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

import math
import threading
import time
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from advisor.cluster import PartitionUnavailable
from api.auth import ApiSecurity, ApiSecuritySettings, GuardMiddleware, require_admin, require_read
from api.dashboard import mount_dashboard
from api.errors import ERROR_RESPONSES, ApiError, ErrorResponse, json_response
from api.hit_rates import HitRateCollector, HitRates, served_per_tier
from api.indexer import indexer_router
from api.indexer_registry import IndexerRegistry
from api.models import (
    BlockResponse,
    HashParseError,
    DrainRequest,
    SegmentResponse,
    SegmentsResponse,
    RegisterVolumeRequest,
    VolumeActionResponse,
    DrainResponse,
    HealthResponse,
    InvalidateRequest,
    InvalidateResponse,
    LocationBlocksResponse,
    LocationsResponse,
    LookupRequest,
    LookupResponse,
    PlansResponse,
    StatsResponse,
    VolumeResponse,
    VolumesResponse,
    hex64,
    parse_sequence_hash,
    plan_response,
)
from api.paging import MAX_PAGE, page, parse_cursor
from api.register_policy import EndpointPolicy
from kvbm_runtime.hashing import ModelFingerprint, TokenIdError, salt_hash, sequence_hashes

if TYPE_CHECKING:
    from advisor.query import AdvisorQuery

__all__ = ["ApiError", "create_app"]

MAX_DETAIL_CHARS = 600
"""A 422 detail is cut here: it names fields and reasons, never the whole input."""

_METRICS_EXAMPLE = '# TYPE kvadvisor_index_blocks gauge\nkvadvisor_index_blocks{location="w0/g1"} 4.0\n'

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 403: "forbidden"}


def _summary(plans: list[object]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        key = f"{p.kind}_{p.status}"  # type: ignore[attr-defined]
        out[key] = out.get(key, 0) + 1
    return out


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")[:120]
        msg = str(e.get("msg", "invalid"))[:200]
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = len(exc.errors()) - 5
    if more > 0:
        parts.append(f"and {more} more")
    text = "; ".join(parts)
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


class _Tiers:
    """Location → tier (G1..G4) and worker; volume kinds cached, refreshed at most every 5 s."""

    def __init__(self, query: AdvisorQuery) -> None:
        self._query = query
        self._kinds: dict[str, str] = {}
        self._at = 0.0
        self._lock = threading.Lock()

    def of(self, location: str) -> tuple[str, str | None]:
        """``(tier, worker or None)`` of an index location."""
        src, sep, tier = location.rpartition("/")
        if sep and tier in ("g1", "g2"):
            return tier.upper(), src
        kind = self._kinds.get(location)
        if kind is None:
            with self._lock:
                now = time.monotonic()
                if now - self._at > 5.0:
                    self._kinds = {v.id: v.kind for v in self._query.volumes()}
                    self._at = now
            kind = self._kinds.get(location, "posix")
        return ("G4" if kind == "s3" else "G3"), None


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
        store = query if hasattr(query, "load_registrations") else None  # a cluster's API keeps none
        registry = IndexerRegistry(settings.max_registrations, max_indexes=settings.max_indexes, policy=policy,
                                   store=store)
        registry.restore()
    app.state.indexer_registry = registry
    app.add_middleware(GuardMiddleware, security=app.state.security)
    read, admin = [Depends(require_read)], [Depends(require_admin)]
    tiers = _Tiers(query)
    rates = {"lookup": HitRates("lookup"), "query": HitRates("query")}
    app.state.hit_rates = rates
    api_metrics = CollectorRegistry(auto_describe=False)
    api_metrics.register(HitRateCollector(rates.values()))

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"error": exc.error, "detail": exc.detail},
                            headers=exc.headers)

    @app.exception_handler(PartitionUnavailable)
    async def _unavailable(_req: Request, exc: PartitionUnavailable) -> JSONResponse:
        # a partition of a scaled cluster is being taken over: never a partial answer
        retry = max(1, math.ceil(exc.retry_after_s))
        return JSONResponse(status_code=503, content={"error": "partition_unavailable", "detail": str(exc)[:200]},
                            headers={"Retry-After": str(retry)})

    @app.exception_handler(NotImplementedError)
    async def _not_here(_req: Request, exc: NotImplementedError) -> JSONResponse:
        return JSONResponse(status_code=501, content={"error": "not_implemented", "detail": str(exc)[:200]})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": "invalid_request", "detail": _validation_detail(exc)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse(status_code=exc.status_code, content={"error": code, "detail": str(exc.detail)[:200]},
                            headers=getattr(exc, "headers", None))

    @app.get("/v1/blocks/{sequence_hash}", response_model=BlockResponse, dependencies=read)
    def get_block(sequence_hash: str = Path(description="decimal or 0x-hex u64",
                                            examples=["0x8000000000000000", "11"])) -> BlockResponse:
        try:
            h = parse_sequence_hash(sequence_hash)
        except HashParseError as exc:
            raise ApiError(400, "bad_sequence_hash", str(exc)[:200]) from None
        info = query.block(h)
        if info is None:
            raise ApiError(404, "unknown_block", f"block {h} ({hex64(h)}) is not indexed at any location")
        children = query.children(h)
        return BlockResponse(
            sequence_hash=h,
            sequence_hash_hex=hex64(h),
            parent=info.parent,
            parent_hex=None if info.parent is None else hex64(info.parent),
            prefix_hash=info.prefix_hash,
            prefix_hash_hex=hex64(info.prefix_hash),
            size_bytes=info.size,
            locations=sorted(info.locations),
            hits=info.hits,
            last_access_ns=info.last_access_ns,
            orphan=info.orphan,
            children=children,
            children_hex=[hex64(c) for c in children],
        )

    @app.post("/v1/lookup", response_model=LookupResponse, dependencies=read)
    async def lookup(req: LookupRequest) -> Response:
        # async and a pre-encoded body: the hot route of routers runs on the event loop (the
        # index lookup takes microseconds) and skips FastAPI's second validation pass
        computed: list[int] | None = None
        if req.token_ids is not None:
            m = req.model
            assert m is not None  # the model validator requires it
            fp = ModelFingerprint(m.name, m.dtype, m.layout, m.block_size, m.revision)
            try:
                computed = sequence_hashes(req.token_ids, m.block_size, salt_hash(fp, req.lora_name, req.cache_salt))
            except TokenIdError as exc:
                raise ApiError(422, "invalid_request", f"token_ids: {exc}") from None
        hashes = computed if computed is not None else req.sequence_hashes
        res = query.lookup(hashes)  # type: ignore[arg-type]  # validated to ints
        hint = getattr(query, "prefetch_hint", None)  # a router asks before it dispatches: prefetch
        if hint is not None:
            hint(hashes)
        per_tier: dict[str, int] = {}
        per_worker: dict[str, dict[str, int]] = {}
        for loc, n in res.per_location.items():
            tier, worker = tiers.of(loc)
            per_tier[tier] = max(per_tier.get(tier, 0), n)
            if worker is not None:
                per_worker.setdefault(worker, {})[tier] = n
        served, best = per_tier, None
        if res.prefix_locations is not None:
            best, served = served_per_tier(res.prefix_locations, tiers.of)
        rates["lookup"].record(served, {w: max(t.values()) for w, t in per_worker.items()},
                               req.model.block_size if computed is not None and req.model is not None else None)
        return json_response({
            "requested": res.requested,
            "prefix_blocks": res.per_location,
            "any_location": res.any_location,
            "longest": max(res.per_location.values(), default=0),
            "per_tier": dict(sorted(per_tier.items())),
            "per_worker": per_worker,
            "best_worker": best,
            "served_per_tier": dict(sorted(served.items())),
            "sequence_hashes_hex": None if computed is None else [hex64(h) for h in computed],
        })

    @app.get("/v1/locations", response_model=LocationsResponse, dependencies=read)
    def locations() -> LocationsResponse:
        return LocationsResponse(locations=query.locations())

    @app.get("/v1/locations/{location:path}/blocks", response_model=LocationBlocksResponse, dependencies=read)
    def location_blocks(location: str, limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
                        cursor: str | None = Query(None, max_length=64)) -> LocationBlocksResponse:
        hashes = query.blocks_at(location)
        items, nxt = page(hashes, limit, cursor)
        return LocationBlocksResponse(location=location, count=len(hashes), sequence_hashes=items,
                                      sequence_hashes_hex=[hex64(h) for h in items], next_cursor=nxt)

    @app.get("/v1/volumes", response_model=VolumesResponse, dependencies=read)
    def volumes(limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
                cursor: str | None = Query(None, max_length=64)) -> VolumesResponse:
        out = []
        for v in query.volumes():
            st = v.stats
            out.append(
                VolumeResponse(
                    id=v.id, kind=v.kind, media=v.media, role=v.role, capacity_bytes=v.capacity_bytes,
                    used_bytes=st.get("used_bytes"), live_bytes=st.get("live_bytes"), dead_bytes=st.get("dead_bytes"),
                    segments=st.get("segments"), blocks=st.get("blocks"), reads=st.get("reads"),
                    writes=st.get("writes"), indexed_blocks=v.indexed_blocks, draining=v.draining,
                )
            )
        items, nxt = page(out, limit, cursor)
        return VolumesResponse(volumes=items, next_cursor=nxt)

    @app.get("/v1/stats", response_model=StatsResponse, dependencies=read)
    def stats() -> StatsResponse:
        body = query.stats()
        body["hit_rates"] = {kind: t.snapshot() for kind, t in rates.items()}
        return StatsResponse.model_validate(body)

    @app.get("/v1/plans", response_model=PlansResponse, dependencies=read)
    def plans(limit: int = Query(100, ge=1, le=MAX_PAGE), cursor: str | None = Query(None, max_length=64)) -> PlansResponse:
        start = parse_cursor(cursor)
        recent = query.plans(min(start + limit + 1, 1 << 31))
        items, nxt = page([plan_response(r) for r in recent], limit, cursor)
        return PlansResponse(plans=items, summary=_summary(items), next_cursor=nxt)

    @app.post("/v1/plans/run", response_model=PlansResponse, dependencies=admin)
    def run_plans() -> PlansResponse:
        items = [plan_response(r) for r in query.run_policies()]
        return PlansResponse(plans=items, summary=_summary(items))

    @app.post("/v1/actions/invalidate", response_model=InvalidateResponse, dependencies=admin,
              responses={409: {"model": ErrorResponse, "description": "no storage attached"}})
    def invalidate(req: InvalidateRequest) -> InvalidateResponse:
        from advisor.invalidate import InvalidateError

        ns = req.namespace
        if req.model is not None:
            m = req.model
            ns = ModelFingerprint(m.name, m.dtype, m.layout, m.block_size, m.revision).namespace()
        assert ns is not None  # the model validator requires one
        try:
            res = query.invalidate(ns)
        except InvalidateError as exc:
            raise ApiError(409, "no_storage", str(exc)) from None
        return InvalidateResponse(namespace=res.namespace, deleted=res.deleted, removes_published=res.removes_published)

    @app.get("/v1/volumes/{volume_id}/segments", response_model=SegmentsResponse, dependencies=read)
    def volume_segments(volume_id: str = Path(max_length=255, examples=["fast"]),
                        limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
                        cursor: str | None = Query(None, max_length=64)) -> SegmentsResponse:
        segs = query.segments(volume_id)
        if segs is None:
            raise ApiError(404, "unknown_volume", f"volume {volume_id[:60]!r} is not configured")
        items, nxt = page(segs, limit, cursor)
        return SegmentsResponse(volume=volume_id, count=len(segs), next_cursor=nxt, segments=[
            SegmentResponse(segment_id=g.segment_id, size_bytes=g.size_bytes, live_bytes=g.live_bytes,
                            dead_bytes=g.dead_bytes, live_blocks=g.live_blocks, sealed=g.sealed,
                            created_at=g.created_at) for g in items])

    @app.post("/v1/volumes", response_model=VolumeActionResponse, dependencies=admin,
              responses={409: {"model": ErrorResponse, "description": "no storage, id taken, volume refused"}})
    def register_volume(req: RegisterVolumeRequest) -> VolumeActionResponse:
        from pydantic import ValidationError

        from advisor.settings import VolumeSettings
        from advisor.volume_admin import VolumeAdminError

        try:
            vol = VolumeSettings.model_validate(req.volume)
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", "volume: " + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])[:500]) from None
        try:
            query.register_volume(vol, req.role)
        except VolumeAdminError as exc:
            raise ApiError(409, "volume_refused", str(exc)[:400]) from None
        return VolumeActionResponse(volume=vol.id, status="registered")

    @app.delete("/v1/volumes/{volume_id}", response_model=VolumeActionResponse, dependencies=admin,
                responses={409: {"model": ErrorResponse, "description": "unknown, fast/archive, or not empty"}})
    def unregister_volume(volume_id: str = Path(max_length=255, examples=["slow2"])) -> VolumeActionResponse:
        from advisor.volume_admin import VolumeAdminError

        try:
            query.unregister_volume(volume_id)
        except VolumeAdminError as exc:
            raise ApiError(409, "volume_refused", str(exc)[:400]) from None
        return VolumeActionResponse(volume=volume_id, status="unregistered")

    @app.post("/v1/volumes/{volume_id}/drain", response_model=DrainResponse, dependencies=admin,
              responses={409: {"model": ErrorResponse, "description": "no storage, unknown volume or destination"}})
    def drain(volume_id: str = Path(max_length=255, examples=["fast"]),
              req: DrainRequest | None = None) -> DrainResponse:
        from advisor.drain import DrainError

        try:
            res = query.drain(volume_id, req.to if req is not None else None)
        except DrainError as exc:
            raise ApiError(409, "cannot_drain", str(exc)[:300]) from None
        return DrainResponse(volume=res.volume, to=res.to, counts=res.counts, bytes_moved=res.bytes_moved,
                             other_namespaces=getattr(res, "other_namespaces", {}),
                             hint=res.hint() if hasattr(res, "hint") else None)

    @app.delete("/v1/volumes/{volume_id}/drain", response_model=VolumeActionResponse, dependencies=admin,
                responses={409: {"model": ErrorResponse, "description": "the volume is not draining"}})
    def undrain(volume_id: str = Path(max_length=255, examples=["slow2"])) -> VolumeActionResponse:
        if not query.undrain(volume_id):
            raise ApiError(409, "not_draining", f"volume {volume_id[:60]!r} is not draining")
        return VolumeActionResponse(volume=volume_id, status="active")

    @app.get("/metrics", dependencies=read, response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"example": _METRICS_EXAMPLE}},
                              "description": "Prometheus text"}})
    def metrics() -> Response:
        return Response(generate_latest(query.metrics_registry()) + generate_latest(api_metrics),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    def healthz() -> Response:
        health = HealthResponse.model_validate(query.health())
        return JSONResponse(health.model_dump(), status_code=200 if health.status == "ok" else 503)

    @app.get("/health", response_model=HealthResponse)
    def health() -> HealthResponse:
        return HealthResponse.model_validate(query.health())

    @app.get("/openapi.json", include_in_schema=False, dependencies=read)
    def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    app.include_router(indexer_router(app.state.indexer_registry, read=[require_read], admin=[require_admin],
                                      hit_rates=rates["query"]))
    mount_dashboard(app)
    return app


