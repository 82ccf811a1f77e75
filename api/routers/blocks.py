"""Blocks and lookups: ``GET /v1/blocks/{sequence_hash}``, ``POST /v1/lookup``, ``POST
/v1/finished``, ``GET /v1/locations``, ``GET /v1/locations/{loc}/blocks`` (docs/operations.md,
"REST API")."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from api.auth import client_of
from api.errors import ApiError, json_response
from api.hit_rates import HitRates, served_per_tier
from api.models import (
    BlockResponse,
    FinishedRequest,
    FinishedResponse,
    HashParseError,
    LocationBlocksResponse,
    LocationsResponse,
    LookupRequest,
    LookupResponse,
    hex64,
    parse_sequence_hash,
)
from advisor.policy.eviction.finish_aware import FINISH_CLASS_NAMES, finish_class
from api.paging import MAX_PAGE, page
from kvbm_runtime.hashing import ModelFingerprint, TokenIdError, salt_hash, sequence_hashes

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery

__all__ = ["Tiers", "blocks_router"]


class Tiers:
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


def blocks_router(query: AdvisorQuery, lookup_rates: HitRates, read: Sequence[Any]) -> APIRouter:
    """The block and lookup routes over ``query``; lookups are counted in ``lookup_rates``.

    Args:
        query: the advisor's read interface (thread-safe).
        lookup_rates: hit rates of ``POST /v1/lookup`` (``GET /v1/stats``, ``/metrics``).
        read: the dependencies of the read scope.
    """
    router = APIRouter()
    read = list(read)
    tiers = Tiers(query)

    @router.get("/v1/blocks/{sequence_hash}", response_model=BlockResponse, dependencies=read)
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

    def hashes_of(req: LookupRequest) -> tuple[list[int], list[int] | None]:
        """``(sequence hashes, those computed from token ids or None)`` of a request body."""
        if req.token_ids is None:
            return list(req.sequence_hashes or ()), None  # type: ignore[arg-type]  # validated to ints
        m = req.model
        assert m is not None  # the model validator requires it
        fp = ModelFingerprint(m.name, m.dtype, m.layout, m.block_size, m.revision)
        try:
            computed = sequence_hashes(req.token_ids, m.block_size, salt_hash(fp, req.lora_name, req.cache_salt))
        except TokenIdError as exc:
            raise ApiError(422, "invalid_request", f"token_ids: {exc}") from None
        return computed, computed

    @router.post("/v1/finished", response_model=FinishedResponse, dependencies=read)
    def finished(req: FinishedRequest, request: Request) -> FinishedResponse:
        """A router reports that a request finished and how (``finish_reason``): the default
        policy keeps sessions waiting on a tool call (:mod:`advisor.policy.eviction.finish_aware`)."""
        hint = getattr(query, "finish_hint", None)
        if hint is None:
            raise ApiError(501, "not_supported", "this API's advisor takes no finish hints")
        hashes, _ = hashes_of(req)
        return FinishedResponse(taken=bool(hint(hashes, req.finish_reason, client_of(request))),
                                finish_class=FINISH_CLASS_NAMES[finish_class(req.finish_reason)])

    @router.post("/v1/lookup", response_model=LookupResponse, dependencies=read)
    async def lookup(req: LookupRequest, request: Request) -> Response:
        # async and a pre-encoded body: the hot route of routers runs on the event loop (the
        # index lookup takes microseconds) and skips FastAPI's second validation pass
        hashes, computed = hashes_of(req)
        res = query.lookup(hashes)  # type: ignore[arg-type]  # validated to ints
        hint = getattr(query, "prefetch_hint", None)  # a router asks before it dispatches: prefetch
        if hint is not None:
            hint(hashes, client_of(request))  # a fair share of the prefetch queue per token
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
        lookup_rates.record(served, {w: max(t.values()) for w, t in per_worker.items()},
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

    @router.get("/v1/locations", response_model=LocationsResponse, dependencies=read)
    def locations() -> LocationsResponse:
        return LocationsResponse(locations=query.locations())

    @router.get("/v1/locations/{location:path}/blocks", response_model=LocationBlocksResponse, dependencies=read)
    def location_blocks(location: str, limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
                        cursor: str | None = Query(None, max_length=64)) -> LocationBlocksResponse:
        hashes = query.blocks_at(location)
        items, nxt = page(hashes, limit, cursor)
        return LocationBlocksResponse(location=location, count=len(hashes), sequence_hashes=items,
                                      sequence_hashes_hex=[hex64(h) for h in items], next_cursor=nxt)

    return router
