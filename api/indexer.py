"""Indexer-compatible routes: the KV-indexer HTTP API of the Mooncake RFC as NVIDIA Dynamo's
standalone indexer serves it, so a router written for that indexer works against us
unchanged (docs/operations.md, "Indexer API").

==========================  ================================================================
``POST /register``          subscribe to a worker's vLLM-format ZMQ KV events (admin)
``POST /unregister``        stop it and drop its blocks (admin)
``GET  /workers``           ``[{"instance_id", "endpoints": {dp_rank: endpoint}}]``
``POST /query``             ``{token_ids, model_name, tenant_id?, lora_name?}`` → scores
``POST /query_by_hash``     ``{block_hashes (local hashes), model_name, tenant_id?}`` → scores
``GET  /dump``              ``{"<model>:<tenant>": [events]}``
``POST /load``              apply a ``/dump`` body (ours: restore or copy an indexer) (admin)
==========================  ================================================================

Scores are matched tokens: leading blocks a worker holds × the index's block size, as
``{"scores": {instance: {dp_rank: tokens}}, "frequencies": [...], "tree_sizes":
{instance: {dp_rank: blocks}}}``, plus ``"tiers": {instance: {dp_rank: {tier: tokens}}}``.
Block hashes of ``/query`` follow :mod:`api.token_hashes`. ``/workers`` and ``/dump``
page with ``limit`` / ``cursor``; the next cursor is in the ``X-Next-Cursor`` header (the
bodies keep the RFC's shapes).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from api.errors import CONFLICT_RESPONSES, ERROR_RESPONSES, ApiError, json_response
from api.hit_rates import HitRates
from api.indexer_registry import DEFAULT_TENANT, IndexerRegistry, Registration
from api.models import MAX_LOOKUP_HASHES, HashParseError, hex64, parse_sequence_hash
from api.paging import MAX_PAGE, page
from api.token_hashes import TokenIdError, local_block_hashes
from api.worker_index import Overlap, WorkerIndex

MAX_QUERY_TOKENS = 262_144
"""Token ids one ``/query`` may carry."""
MAX_NAME = 256
_ENDPOINT = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]{1,253}|\*):[0-9]{1,5}", re.ASCII)
U64 = Field(ge=0, le=(1 << 64) - 1)


def _endpoint(value: str | None) -> str | None:
    if value is None:
        return None
    if not _ENDPOINT.fullmatch(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise ValueError("must be tcp://HOST:PORT")
    return value


class RegisterRequest(BaseModel):
    """``POST /register`` body."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "instance_id": 1, "endpoint": "tcp://127.0.0.1:5557", "model_name": "meta-llama/Llama-3.1-8B",
        "block_size": 16, "tenant_id": "default", "dp_rank": 0}]})

    instance_id: StrictInt = U64
    endpoint: StrictStr = Field(max_length=300, description="the worker's ZMQ PUB endpoint, tcp://HOST:PORT")
    model_name: StrictStr = Field(min_length=1, max_length=MAX_NAME)
    block_size: StrictInt = Field(ge=1, le=1 << 20, description="tokens per block")
    tenant_id: StrictStr = Field(DEFAULT_TENANT, min_length=1, max_length=MAX_NAME)
    dp_rank: StrictInt = Field(0, ge=0, le=1 << 16)
    replay_endpoint: StrictStr | None = Field(None, max_length=300,
                                              description="the worker's ZMQ replay ROUTER endpoint (ours)")
    engine: Literal["vllm", "sglang"] = Field("vllm", description="the worker's KV-event format")

    _check_endpoint = field_validator("endpoint", "replay_endpoint")(classmethod(lambda cls, v: _endpoint(v)))


class UnregisterRequest(BaseModel):
    """``POST /unregister`` body; no tenant = every tenant of the model, no rank = every rank."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"instance_id": 1, "model_name": "meta-llama/Llama-3.1-8B"}]})

    instance_id: StrictInt = U64
    model_name: StrictStr = Field(min_length=1, max_length=MAX_NAME)
    tenant_id: StrictStr | None = Field(None, min_length=1, max_length=MAX_NAME)
    dp_rank: StrictInt | None = Field(None, ge=0, le=1 << 16)


class UnregisterResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"removed": 1}]})

    removed: int = Field(description="registrations removed", examples=[1])


class RegisterResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "status": "registered", "instance_id": 1, "dp_rank": 0, "model_name": "meta-llama/Llama-3.1-8B",
        "tenant_id": "default"}]})

    status: str = Field(examples=["registered"])
    instance_id: int
    dp_rank: int
    model_name: str
    tenant_id: str


class QueryRequest(BaseModel):
    """``POST /query`` body."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "token_ids": list(range(32)), "model_name": "meta-llama/Llama-3.1-8B", "tenant_id": "default"}]})

    token_ids: list[StrictInt] = Field(max_length=MAX_QUERY_TOKENS)
    model_name: StrictStr = Field(min_length=1, max_length=MAX_NAME)
    tenant_id: StrictStr = Field(DEFAULT_TENANT, min_length=1, max_length=MAX_NAME)
    lora_name: StrictStr | None = Field(None, max_length=MAX_NAME)


class QueryByHashRequest(BaseModel):
    """``POST /query_by_hash`` body: local (tokens) block hashes, ints or ``0x`` strings."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "block_hashes": ["0x7e2a1b3c4d5e6f70", 42], "model_name": "meta-llama/Llama-3.1-8B"}]})

    block_hashes: list[StrictInt | StrictStr] = Field(max_length=MAX_LOOKUP_HASHES)
    model_name: StrictStr = Field(min_length=1, max_length=MAX_NAME)
    tenant_id: StrictStr = Field(DEFAULT_TENANT, min_length=1, max_length=MAX_NAME)

    @field_validator("block_hashes")
    @classmethod
    def _parse(cls, values: list[int | str]) -> list[int]:
        out = []
        for i, v in enumerate(values):
            try:
                out.append(parse_sequence_hash(v))
            except HashParseError as exc:
                raise ValueError(f"block_hashes[{i}]: {exc}") from None
        return out


class ScoresResponse(BaseModel):
    """Matched tokens per worker."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "scores": {"1": {"0": 32}}, "frequencies": [2, 1], "tree_sizes": {"1": {"0": 2}, "2": {"0": 1}},
        "tiers": {"1": {"0": {"g1": 32}}}}]})

    scores: dict[str, dict[str, int]] = Field(description="instance_id -> dp_rank -> matched tokens")
    frequencies: list[int] = Field(description="per matched block depth, workers holding it")
    tree_sizes: dict[str, dict[str, int]] = Field(description="instance_id -> dp_rank -> blocks indexed")
    tiers: dict[str, dict[str, dict[str, int]]] = Field(description="instance_id -> dp_rank -> tier -> matched tokens")


class WorkerResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "instance_id": 1, "endpoints": {"0": "tcp://127.0.0.1:5557"}, "indexes": ["meta-llama/Llama-3.1-8B:default"]}]})

    instance_id: int
    endpoints: dict[str, str] = Field(description="dp_rank -> ZMQ endpoint")
    indexes: list[str] = Field(description='"<model>:<tenant>" pairs it feeds (ours)')


_DUMP_EVENT: dict[str, Any] = {
    "instance_id": 1, "dp_rank": 0, "event": {"stored": {
        "parent_hash": None, "medium": "g1", "copies": 1,
        "blocks": [{"block_hash": 101, "block_hash_hex": "0x0000000000000065",
                    "tokens_hash": 10823191264391160519, "sequence_hash": 10823191264391160519}]}}}


class DumpBlock(BaseModel):
    block_hash: StrictInt | StrictStr
    tokens_hash: StrictInt | StrictStr
    sequence_hash: StrictInt | StrictStr
    block_hash_hex: str | None = None


class DumpStored(BaseModel):
    parent_hash: StrictInt | StrictStr | None
    medium: StrictStr = Field("g1", max_length=64)
    copies: StrictInt = Field(1, ge=1, le=1 << 16)
    blocks: list[DumpBlock] = Field(max_length=4096)


class DumpEventBody(BaseModel):
    stored: DumpStored


class DumpEvent(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [_DUMP_EVENT]})

    instance_id: StrictInt = U64
    dp_rank: StrictInt = Field(ge=0, le=1 << 16)
    event: DumpEventBody


class LoadRequest(BaseModel):
    """``POST /load``: a ``/dump`` body and the block size of new indexes."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "block_size": 16, "dump": {"meta-llama/Llama-3.1-8B:default": [_DUMP_EVENT]}}]})

    block_size: StrictInt = Field(ge=1, le=1 << 20)
    dump: dict[str, list[DumpEvent]] = Field(max_length=1024)


class LoadResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"blocks": 1}]})

    blocks: int = Field(description="blocks applied", examples=[128])


def _nested(d: dict[tuple[int, int], Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for (inst, dp), v in sorted(d.items()):
        out.setdefault(str(inst), {})[str(dp)] = v
    return out


def scores_body(ov: Overlap, index: WorkerIndex) -> dict[str, Any]:
    """The RFC's answer (:class:`ScoresResponse` shape) for an :class:`~api.worker_index.Overlap`
    (tokens = blocks × block size)."""
    bs = index.block_size
    return {
        "scores": _nested({w: n * bs for w, n in ov.blocks.items()}),
        "frequencies": ov.frequencies,
        "tree_sizes": _nested(index.tree_sizes()),
        "tiers": _nested({w: {t: n * bs for t, n in sorted(m.items())} for w, m in ov.tiers.items()}),
    }


def _index_of(registry: IndexerRegistry, model: str, tenant: str) -> WorkerIndex:
    idx = registry.index(model, tenant)
    if idx is None:
        raise ApiError(404, "unknown_index", f"no worker registered for model {model!r} tenant {tenant!r}")
    return idx


def _u64(v: int | str, what: str) -> int:
    try:
        return parse_sequence_hash(v)
    except HashParseError as exc:
        raise ApiError(400, "bad_hash", f"{what}: {exc}") from None


def indexer_router(
    registry: IndexerRegistry, read: Sequence[Any] = (), admin: Sequence[Any] = (), hit_rates: HitRates | None = None
) -> APIRouter:
    """The indexer-compatible routes over ``registry``.

    Args:
        registry: registrations and indexes.
        read / admin: FastAPI dependencies guarding read and mutating routes (:mod:`api.auth`).
        hit_rates: tally of ``/query`` and ``/query_by_hash`` answers (:mod:`api.hit_rates`).
    """
    r = APIRouter(tags=["indexer"], responses=ERROR_RESPONSES)
    rd, ad = [Depends(d) for d in read], [Depends(d) for d in admin]

    @r.post("/register", response_model=RegisterResponse, dependencies=ad, responses=CONFLICT_RESPONSES)
    def register(req: RegisterRequest) -> RegisterResponse:
        registry.register(Registration(req.instance_id, req.dp_rank, req.model_name, req.tenant_id, req.endpoint,
                                       req.replay_endpoint, req.block_size, req.engine))
        return RegisterResponse(status="registered", instance_id=req.instance_id, dp_rank=req.dp_rank,
                                model_name=req.model_name, tenant_id=req.tenant_id)

    @r.post("/unregister", response_model=UnregisterResponse, dependencies=ad)
    def unregister(req: UnregisterRequest) -> UnregisterResponse:
        n = registry.unregister(req.instance_id, req.model_name, req.tenant_id, req.dp_rank)
        if n == 0:
            raise ApiError(404, "unknown_worker", f"instance {req.instance_id} is not registered for {req.model_name!r}")
        return UnregisterResponse(removed=n)

    @r.get("/workers", response_model=list[WorkerResponse], dependencies=rd)
    def workers(response: Response, limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
                cursor: str | None = Query(None, max_length=64)) -> list[WorkerResponse]:
        by: dict[int, WorkerResponse] = {}
        for reg in registry.registrations():
            w = by.setdefault(reg.instance_id, WorkerResponse(instance_id=reg.instance_id, endpoints={}, indexes=[]))
            w.endpoints[str(reg.dp_rank)] = reg.endpoint
            pair = f"{reg.model_name}:{reg.tenant_id}"
            if pair not in w.indexes:
                w.indexes.append(pair)
        items, nxt = page([by[k] for k in sorted(by)], limit, cursor)
        if nxt is not None:
            response.headers["X-Next-Cursor"] = nxt
        return items

    def _answer(idx: WorkerIndex, local: list[int]) -> Response:
        ov = idx.overlap(local)
        if hit_rates is not None:
            tiers: dict[str, int] = {}
            for media in ov.tiers.values():
                for t, n in media.items():
                    tiers[t] = max(tiers.get(t, 0), n)
            hit_rates.record(tiers, {f"{i}/{d}": n for (i, d), n in ov.blocks.items()}, idx.block_size)
        return json_response(scores_body(ov, idx))

    # async: the hot routes run on the event loop (an overlap walk takes microseconds)
    @r.post("/query", response_model=ScoresResponse, dependencies=rd)
    async def query(req: QueryRequest) -> Response:
        idx = _index_of(registry, req.model_name, req.tenant_id)
        try:
            local = local_block_hashes(req.token_ids, idx.block_size, req.lora_name)
        except TokenIdError as exc:
            raise ApiError(422, "invalid_request", f"token_ids: {exc}") from None
        return _answer(idx, local)

    @r.post("/query_by_hash", response_model=ScoresResponse, dependencies=rd)
    async def query_by_hash(req: QueryByHashRequest) -> Response:
        return _answer(_index_of(registry, req.model_name, req.tenant_id), req.block_hashes)  # type: ignore[arg-type]

    @r.get("/dump", dependencies=rd, response_model=dict[str, list[DumpEvent]])
    def dump(response: Response, limit: int = Query(MAX_PAGE, ge=1, le=MAX_PAGE),
             cursor: str | None = Query(None, max_length=64)) -> dict[str, list[dict[str, Any]]]:
        flat: list[tuple[str, dict[str, Any]]] = []
        for (model, tenant), idx in sorted(registry.indexes().items()):
            for ev in idx.dump():
                for b in ev["event"]["stored"]["blocks"]:
                    b["block_hash_hex"] = hex64(b["block_hash"])
                flat.append((f"{model}:{tenant}", ev))
        items, nxt = page(flat, limit, cursor)
        if nxt is not None:
            response.headers["X-Next-Cursor"] = nxt
        out: dict[str, list[dict[str, Any]]] = {}
        for key, ev in items:
            out.setdefault(key, []).append(ev)
        return out

    @r.post("/load", response_model=LoadResponse, dependencies=ad, responses=CONFLICT_RESPONSES)
    def load(req: LoadRequest) -> LoadResponse:
        n = 0
        for key, events in req.dump.items():
            model, sep, tenant = key.rpartition(":")
            if not sep or not model or not tenant:
                raise ApiError(400, "bad_index_key", "dump keys are '<model>:<tenant>'")
            idx = registry.ensure_index(model, tenant, req.block_size)
            for ev in events:
                st = ev.event.stored
                parent = None if st.parent_hash is None else _u64(st.parent_hash, "parent_hash")
                hashes = [_u64(b.block_hash, "block_hash") for b in st.blocks]
                local = [_u64(b.tokens_hash, "tokens_hash") for b in st.blocks]
                chains = [_u64(b.sequence_hash, "sequence_hash") for b in st.blocks]
                # all copies in one step per block (a loop over copies made a 4 MiB body cost
                # CPU-minutes at copies=65,536)
                n += st.copies * idx.stored((ev.instance_id, ev.dp_rank), hashes, parent, local, st.medium,
                                            chains=chains, copies=st.copies)
        return LoadResponse(blocks=n)

    return r
