"""FastAPI app over an :class:`advisor.query.AdvisorQuery`.

Routes (all JSON unless stated):

=====================================  ==================================================
``GET  /v1/blocks/{sequence_hash}``    one block (decimal or 0x-hex); 404 if unknown
``POST /v1/lookup``                    ``{"sequence_hashes": [...]}`` → longest prefix per location
``GET  /v1/locations``                 blocks per location
``GET  /v1/locations/{loc}/blocks``    sequence hashes at a location (``fast``, ``w0/g1``...)
``GET  /v1/volumes``                   volumes with role, usage, indexed blocks
``GET  /v1/stats``                     index / ingest / mover / subscriber figures
``GET  /v1/plans?limit=N``             recent executed plan items with reasons
``POST /v1/plans/run``                 run one policy round now; its results
``GET  /metrics``                      Prometheus text exposition
``GET  /healthz``                      health: 200 ok, 503 while journal writes fail
=====================================  ==================================================

Errors are ``{"error": code, "detail": text}`` with codes ``unknown_block`` (404),
``bad_sequence_hash`` (400), ``invalid_request`` (422).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.dashboard import mount_dashboard
from api.models import (
    BlockResponse,
    ErrorResponse,
    HashParseError,
    HealthResponse,
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

if TYPE_CHECKING:
    from advisor.query import AdvisorQuery


class ApiError(Exception):
    """An error with an HTTP status, a machine code and a human detail."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def _summary(plans: list[object]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        key = f"{p.kind}_{p.status}"  # type: ignore[attr-defined]
        out[key] = out.get(key, 0) + 1
    return out


def create_app(query: AdvisorQuery) -> FastAPI:
    """Build the REST API for one advisor.

    Args:
        query: the advisor's read interface (thread-safe).
    """
    app = FastAPI(title="kvadvisor", version="0.1.0", description="KV-cache block index, volumes and advisor plans")
    errors = {404: {"model": ErrorResponse}, 400: {"model": ErrorResponse}, 422: {"model": ErrorResponse}}

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"error": exc.error, "detail": exc.detail})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
        return JSONResponse(status_code=422, content={"error": "invalid_request", "detail": "; ".join(parts)})

    @app.get("/v1/blocks/{sequence_hash}", response_model=BlockResponse, responses=errors)
    def get_block(sequence_hash: str) -> BlockResponse:
        try:
            h = parse_sequence_hash(sequence_hash)
        except HashParseError as exc:
            raise ApiError(400, "bad_sequence_hash", str(exc)) from None
        info = query.block(h)
        if info is None:
            raise ApiError(404, "unknown_block", f"block {h} ({hex64(h)}) is not indexed at any location")
        return BlockResponse(
            sequence_hash=h,
            sequence_hash_hex=hex64(h),
            parent=info.parent,
            prefix_hash=info.prefix_hash,
            size_bytes=info.size,
            locations=sorted(info.locations),
            hits=info.hits,
            last_access_ns=info.last_access_ns,
            orphan=info.orphan,
            children=query.children(h),
        )

    @app.post("/v1/lookup", response_model=LookupResponse, responses=errors)
    def lookup(req: LookupRequest) -> LookupResponse:
        res = query.lookup(req.sequence_hashes)  # type: ignore[arg-type]  # validated to ints
        return LookupResponse(
            requested=res.requested,
            prefix_blocks=res.per_location,
            any_location=res.any_location,
            longest=max(res.per_location.values(), default=0),
        )

    @app.get("/v1/locations", response_model=LocationsResponse)
    def locations() -> LocationsResponse:
        return LocationsResponse(locations=query.locations())

    @app.get("/v1/locations/{location:path}/blocks", response_model=LocationBlocksResponse)
    def location_blocks(location: str) -> LocationBlocksResponse:
        hashes = query.blocks_at(location)
        return LocationBlocksResponse(location=location, count=len(hashes), sequence_hashes=hashes)

    @app.get("/v1/volumes", response_model=VolumesResponse)
    def volumes() -> VolumesResponse:
        out = []
        for v in query.volumes():
            st = v.stats
            out.append(
                VolumeResponse(
                    id=v.id, kind=v.kind, media=v.media, role=v.role, capacity_bytes=v.capacity_bytes,
                    used_bytes=st.get("used_bytes"), live_bytes=st.get("live_bytes"), dead_bytes=st.get("dead_bytes"),
                    segments=st.get("segments"), blocks=st.get("blocks"), reads=st.get("reads"),
                    writes=st.get("writes"), indexed_blocks=v.indexed_blocks,
                )
            )
        return VolumesResponse(volumes=out)

    @app.get("/v1/stats", response_model=StatsResponse)
    def stats() -> StatsResponse:
        return StatsResponse.model_validate(query.stats())

    @app.get("/v1/plans", response_model=PlansResponse)
    def plans(limit: int = Query(100, ge=1, le=1000)) -> PlansResponse:
        items = [plan_response(r) for r in query.plans(limit)]
        return PlansResponse(plans=items, summary=_summary(items))

    @app.post("/v1/plans/run", response_model=PlansResponse)
    def run_plans() -> PlansResponse:
        items = [plan_response(r) for r in query.run_policies()]
        return PlansResponse(plans=items, summary=_summary(items))

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(query.metrics_registry()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    def healthz() -> Response:
        health = HealthResponse.model_validate(query.health())
        return JSONResponse(health.model_dump(), status_code=200 if health.status == "ok" else 503)

    mount_dashboard(app)
    return app
