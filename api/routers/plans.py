"""Plans and actions: ``GET /v1/plans``, ``POST /v1/plans/run``, ``POST /v1/actions/invalidate``
(docs/operations.md, "REST API" and "Operator actions")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Query

from advisor.ops.invalidate import InvalidateError
from api.errors import ApiError, ErrorResponse
from api.models import InvalidateRequest, InvalidateResponse, PlansResponse, plan_response
from api.paging import MAX_PAGE, page, parse_cursor
from kvbm_runtime.hashing import ModelFingerprint

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery

__all__ = ["plans_router"]


def _summary(plans: list[object]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in plans:
        key = f"{p.kind}_{p.status}"  # type: ignore[attr-defined]
        out[key] = out.get(key, 0) + 1
    return out


def plans_router(query: AdvisorQuery, read: Sequence[Any], admin: Sequence[Any]) -> APIRouter:
    """The plan and action routes over ``query`` (``read``: the plans; ``admin``: run, invalidate)."""
    router = APIRouter()
    read, admin = list(read), list(admin)

    @router.get("/v1/plans", response_model=PlansResponse, dependencies=read)
    def plans(limit: int = Query(100, ge=1, le=MAX_PAGE), cursor: str | None = Query(None, max_length=64)) -> PlansResponse:
        start = parse_cursor(cursor)
        recent = query.plans(min(start + limit + 1, 1 << 31))
        items, nxt = page([plan_response(r) for r in recent], limit, cursor)
        return PlansResponse(plans=items, summary=_summary(items), next_cursor=nxt)

    @router.post("/v1/plans/run", response_model=PlansResponse, dependencies=admin)
    def run_plans() -> PlansResponse:
        items = [plan_response(r) for r in query.run_policies()]
        return PlansResponse(plans=items, summary=_summary(items))

    @router.post("/v1/actions/invalidate", response_model=InvalidateResponse, dependencies=admin,
                 responses={409: {"model": ErrorResponse, "description": "no storage attached"}})
    def invalidate(req: InvalidateRequest) -> InvalidateResponse:
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

    return router
