"""Volumes: ``GET /v1/volumes``, ``GET /v1/volumes/{id}/segments``, ``POST /v1/volumes``,
``DELETE /v1/volumes/{id}``, ``POST /v1/volumes/{id}/drain``, ``DELETE /v1/volumes/{id}/drain``
(docs/operations.md, "REST API" and "Operator actions")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Path, Query
from pydantic import ValidationError

from advisor.ops.drain import DrainError
from advisor.ops.volume_admin import VolumeAdminError, VolumeUnreachableError
from advisor.settings import VolumeSettings
from api.errors import ApiError, ErrorResponse
from api.models import (
    DrainRequest,
    DrainResponse,
    RegisterVolumeRequest,
    SegmentResponse,
    SegmentsResponse,
    VolumeActionResponse,
    VolumeResponse,
    VolumesResponse,
)
from api.paging import MAX_PAGE, page

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery

__all__ = ["volumes_router"]


def volumes_router(query: AdvisorQuery, read: Sequence[Any], admin: Sequence[Any]) -> APIRouter:
    """The volume routes over ``query`` (``read``: listing; ``admin``: register, remove, drain)."""
    router = APIRouter()
    read, admin = list(read), list(admin)

    @router.get("/v1/volumes", response_model=VolumesResponse, dependencies=read)
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

    @router.get("/v1/volumes/{volume_id}/segments", response_model=SegmentsResponse, dependencies=read)
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

    @router.post("/v1/volumes", response_model=VolumeActionResponse, dependencies=admin,
                 responses={409: {"model": ErrorResponse, "description": "no storage, id taken, volume refused"},
                            504: {"model": ErrorResponse, "description": "the S3 endpoint did not answer the probe"}})
    def register_volume(req: RegisterVolumeRequest) -> VolumeActionResponse:
        try:
            vol = VolumeSettings.model_validate(req.volume)
        except ValidationError as exc:
            raise ApiError(422, "invalid_request", "volume: " + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])[:500]) from None
        try:
            query.register_volume(vol, req.role)
        except VolumeUnreachableError as exc:
            raise ApiError(504, "volume_unreachable", str(exc)[:400]) from None
        except VolumeAdminError as exc:
            raise ApiError(409, "volume_refused", str(exc)[:400]) from None
        return VolumeActionResponse(volume=vol.id, status="registered")

    @router.delete("/v1/volumes/{volume_id}", response_model=VolumeActionResponse, dependencies=admin,
                   responses={409: {"model": ErrorResponse, "description": "unknown, fast/archive, or not empty"}})
    def unregister_volume(volume_id: str = Path(max_length=255, examples=["slow2"])) -> VolumeActionResponse:
        try:
            query.unregister_volume(volume_id)
        except VolumeAdminError as exc:
            raise ApiError(409, "volume_refused", str(exc)[:400]) from None
        return VolumeActionResponse(volume=volume_id, status="unregistered")

    @router.post("/v1/volumes/{volume_id}/drain", response_model=DrainResponse, dependencies=admin,
                 responses={409: {"model": ErrorResponse, "description": "no storage, unknown volume or destination"}})
    def drain(volume_id: str = Path(max_length=255, examples=["fast"]),
              req: DrainRequest | None = None) -> DrainResponse:
        try:
            res = query.drain(volume_id, req.to if req is not None else None)
        except DrainError as exc:
            raise ApiError(409, "cannot_drain", str(exc)[:300]) from None
        return DrainResponse(volume=res.volume, to=res.to, counts=res.counts, bytes_moved=res.bytes_moved,
                             other_namespaces=getattr(res, "other_namespaces", {}),
                             hint=res.hint() if hasattr(res, "hint") else None)

    @router.delete("/v1/volumes/{volume_id}/drain", response_model=VolumeActionResponse, dependencies=admin,
                   responses={409: {"model": ErrorResponse, "description": "the volume is not draining"}})
    def undrain(volume_id: str = Path(max_length=255, examples=["slow2"])) -> VolumeActionResponse:
        if not query.undrain(volume_id):
            raise ApiError(409, "not_draining", f"volume {volume_id[:60]!r} is not draining")
        return VolumeActionResponse(volume=volume_id, status="active")

    return router
