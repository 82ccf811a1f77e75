"""Response and request models of the REST API (pydantic).

Sequence hashes are u64; JSON numbers carry them exactly in Python clients, and every
hash is also given as a ``0x…`` string for clients whose numbers are doubles.
"""

from __future__ import annotations

import re

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from api.errors import ErrorResponse  # noqa: F401 - re-exported: its old home

U64_MAX = (1 << 64) - 1
MAX_LOOKUP_HASHES = 100_000
MAX_LOOKUP_TOKENS = 262_144


class HashParseError(ValueError):
    """A sequence hash is not a decimal or 0x-hex u64."""


_HASH_TEXT = re.compile(r"0[xX]([0-9a-fA-F]{1,16})|([0-9]{1,20})", re.ASCII)


def parse_sequence_hash(value: int | str) -> int:
    """Parse a sequence hash given as an int, a decimal string or a ``0x`` hex string.

    Raises:
        HashParseError: not a number, negative, or above 2**64 - 1.
    """
    shown = _short(value)
    if isinstance(value, bool):
        raise HashParseError(f"sequence hash must be an integer, got {value!r}")
    if isinstance(value, int):
        h = value
    elif isinstance(value, str):
        # ASCII digits only: int() alone would also take "1_0" and non-ASCII digits.
        m = _HASH_TEXT.fullmatch(value.strip())
        if m is None:
            raise HashParseError(f"sequence hash {shown} is neither decimal nor 0x-hex")
        h = int(m.group(1), 16) if m.group(1) else int(m.group(2), 10)
    else:
        raise HashParseError(f"sequence hash must be an integer or string, got {type(value).__name__}")
    if not 0 <= h <= U64_MAX:
        raise HashParseError(f"sequence hash {shown} is outside the u64 range 0..2**64-1")
    return h


def _short(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters: errors name a bad value, never echo a huge one."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 128 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def hex64(h: int) -> str:
    """``0x`` + 16 lowercase hex digits."""
    return f"0x{h:016x}"



class BlockResponse(BaseModel):
    """One indexed block."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "sequence_hash": 11, "sequence_hash_hex": "0x000000000000000b", "parent": 17293822569102704641,
        "parent_hex": "0xf000000000000001", "prefix_hash": 17293822569102704641,
        "prefix_hash_hex": "0xf000000000000001", "size_bytes": 2048, "locations": ["slow", "w0/g1"], "hits": 0,
        "last_access_ns": 0, "orphan": False, "children": [12], "children_hex": ["0x000000000000000c"]}]})


    sequence_hash: int
    sequence_hash_hex: str
    parent: int | None
    parent_hex: str | None = None
    prefix_hash: int = Field(description="sequence hash of the chain's first block (prefix family)")
    prefix_hash_hex: str = ""
    size_bytes: int
    locations: list[str]
    hits: int
    last_access_ns: int
    orphan: bool
    children: list[int]
    children_hex: list[str] = []


class FingerprintModel(BaseModel):
    """The model fingerprint our sequence hashes are salted with (``kvbm_runtime.hashing``)."""

    name: StrictStr = Field(min_length=1, max_length=256, examples=["meta-llama/Llama-3.1-8B"])
    dtype: StrictStr = Field(max_length=64, examples=["float16"])
    layout: StrictStr = Field(max_length=64, examples=["FullyContiguous"])
    block_size: StrictInt = Field(ge=1, le=1 << 20, description="tokens per block", examples=[16])
    revision: StrictStr = Field("", max_length=256)


class LookupRequest(BaseModel):
    """Either ``{"sequence_hashes": [h0, h1, ...]}`` (first block first; ints or decimal/0x
    strings), or ``{"token_ids": [...], "model": {...}, "lora_name"?, "cache_salt"?}``: the
    API computes the sequence hashes the runtime would (docs/design.md §4)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"sequence_hashes": ["0xf000000000000001", 11]},
        {"token_ids": list(range(32)), "model": {"name": "meta-llama/Llama-3.1-8B", "dtype": "float16",
                                                 "layout": "FullyContiguous", "block_size": 16}},
    ]})

    sequence_hashes: list[StrictInt | StrictStr] | None = Field(None, max_length=MAX_LOOKUP_HASHES)
    token_ids: list[StrictInt] | None = Field(None, max_length=MAX_LOOKUP_TOKENS)
    model: FingerprintModel | None = None
    lora_name: StrictStr | None = Field(None, max_length=256)
    cache_salt: StrictStr | None = Field(None, max_length=256)

    @field_validator("sequence_hashes")
    @classmethod
    def _parse(cls, values: list[int | str] | None) -> list[int] | None:
        if values is None:
            return None
        out = []
        for i, v in enumerate(values):
            try:
                out.append(parse_sequence_hash(v))
            except HashParseError as exc:
                raise ValueError(f"sequence_hashes[{i}]: {exc}") from None
        return out

    @model_validator(mode="after")
    def _one_form(self) -> LookupRequest:
        if (self.sequence_hashes is None) == (self.token_ids is None):
            raise ValueError("give either sequence_hashes or token_ids (with model)")
        if self.token_ids is not None and self.model is None:
            raise ValueError("token_ids need the model fingerprint (model)")
        return self


class FinishedRequest(LookupRequest):
    """A router's word that a request finished, and how: the request's prompt in either
    form of :class:`LookupRequest`, and its ``finish_reason`` as the serving API named it
    (``tool_calls``, ``stop``, ``length``; Anthropic's ``tool_use``, ``end_turn``,
    ``max_tokens``).  The default policy's ``finish_aware`` expert keeps the prefixes of
    sessions waiting on a tool call over those that ended their turn
    (:mod:`advisor.policy.eviction.finish_aware`)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"sequence_hashes": ["0xf000000000000001", 11], "finish_reason": "tool_calls"},
    ]})

    finish_reason: StrictStr = Field(min_length=1, max_length=64)


class FinishedResponse(BaseModel):
    """Whether the hint was taken, and the finish-reason class it counts in."""

    taken: bool
    finish_class: str


class LookupResponse(BaseModel):
    """Longest cached prefix, in blocks, per location, per tier and per worker."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "requested": 5, "prefix_blocks": {"slow": 2, "w0/g1": 4, "w1/g2": 3}, "any_location": 4, "longest": 4,
        "per_tier": {"G1": 4, "G2": 3, "G3": 2}, "per_worker": {"w0": {"G1": 4}, "w1": {"G2": 3}},
        "sequence_hashes_hex": None}]})


    requested: int
    prefix_blocks: dict[str, int] = Field(description="location -> leading blocks all held there")
    any_location: int = Field(description="leading blocks held somewhere (locations may differ)")
    longest: int = Field(description="max over prefix_blocks (0 if none)")
    per_tier: dict[str, int] = Field(description="G1..G4 -> leading blocks held in one location of that tier")
    per_worker: dict[str, dict[str, int]] = Field(description="worker -> G1/G2 -> leading blocks in its own tiers")
    best_worker: str | None = Field(None, description="the worker that would reuse the longest prefix (its G1/G2 + "
                                    "the volumes; null: only the volumes hold it, or scaled mode)")
    served_per_tier: dict[str, int] = Field(default_factory=dict, description=(
        "G1..G4 -> leading blocks best_worker would read from that tier, each from its fastest tier "
        "(what the hit rates per tier count; scaled mode: per_tier)"))
    sequence_hashes_hex: list[str] | None = Field(None, description="the hashes computed from token_ids")


class InvalidateRequest(BaseModel):
    """``POST /v1/actions/invalidate``: a key namespace, or the model fingerprint it derives from."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"namespace": "9f2c4e1a7b3d5f60"},
        {"model": {"name": "meta-llama/Llama-3.1-8B", "dtype": "float16", "layout": "FullyContiguous",
                   "block_size": 16}},
    ]})

    namespace: StrictStr | None = Field(None, min_length=1, max_length=256)
    model: FingerprintModel | None = None

    @model_validator(mode="after")
    def _one(self) -> InvalidateRequest:
        if (self.namespace is None) == (self.model is None):
            raise ValueError("give either namespace or model")
        return self


class InvalidateResponse(BaseModel):
    """What an invalidation deleted and published."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"namespace": "9f2c4e1a7b3d5f60", "deleted": {"fast": 12, "s3": 40}, "removes_published": 52}]})

    namespace: str
    deleted: dict[str, int] = Field(description="volume -> blocks deleted there")
    removes_published: int


class RegisterVolumeRequest(BaseModel):
    """``POST /v1/volumes``: a volume as in the configuration's ``volumes``, and its role."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "volume": {"id": "slow2", "kind": "posix", "media": "hdd", "capacity_bytes": 549755813888,
                   "root": "/var/lib/kvadvisor/volumes/slow2"}, "role": "slow"}]})

    volume: dict[str, Any] = Field(description="fields of advisor.settings.VolumeSettings")
    role: Literal["slow", "none"] = "none"


class VolumeActionResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"volume": "slow2", "status": "registered"}]})

    volume: str
    status: str


class SegmentResponse(BaseModel):
    """One segment (file or object) of a volume, bytes."""

    segment_id: int
    size_bytes: int
    live_bytes: int
    dead_bytes: int
    live_blocks: int
    sealed: bool
    created_at: float = Field(description="Unix seconds")


class SegmentsResponse(BaseModel):
    """The segments of one volume, by id, paged."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "volume": "fast", "count": 1, "segments": [{"segment_id": 7, "size_bytes": 4194304, "live_bytes": 3145728,
                                                    "dead_bytes": 1048576, "live_blocks": 48, "sealed": True,
                                                    "created_at": 1764600000.0}], "next_cursor": None}]})

    volume: str
    count: int = Field(description="segments of the volume (all pages)")
    segments: list[SegmentResponse]
    next_cursor: str | None = None


class DrainRequest(BaseModel):
    """``POST /v1/volumes/{volume_id}/drain`` body (may be empty)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"to": "slow"}, {}]})

    to: StrictStr | None = Field(None, min_length=1, max_length=255,
                                 description="destination volume (default: a slow volume, else the archive)")


class DrainResponse(BaseModel):
    """What a drain moved."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "volume": "fast", "to": "slow", "counts": {"done": 12, "skipped": 0, "failed": 0}, "bytes_moved": 786432}]})

    volume: str
    to: str
    counts: dict[str, int] = Field(description="plan status -> blocks")
    bytes_moved: int
    other_namespaces: dict[str, int] = Field(default_factory=dict, description=(
        "namespace -> blocks left on the volume: namespaces this advisor does not manage"))
    hint: str | None = Field(None, description=(
        "why blocks stayed: other_namespaces not empty (what to set), or nothing moved (the namespaces looked for "
        "and those seen on the volume and in the catalog)"))


class VolumeResponse(BaseModel):
    """A registered volume with its role, usage (bytes) and indexed block count."""

    id: str
    kind: str
    media: str
    role: str
    capacity_bytes: int
    used_bytes: int | None = None
    live_bytes: int | None = None
    dead_bytes: int | None = None
    segments: int | None = None
    blocks: int | None = None
    reads: int | None = None
    writes: int | None = None
    indexed_blocks: int
    draining: bool = Field(False, description="a drain marked it: policy rounds move nothing onto it")


class VolumesResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"volumes": [{
        "id": "fast", "kind": "posix", "media": "nvme", "role": "fast", "capacity_bytes": 68719476736,
        "used_bytes": 1048576, "live_bytes": 1048576, "dead_bytes": 0, "segments": 1, "blocks": 512, "reads": 10,
        "writes": 512, "indexed_blocks": 512}], "next_cursor": None}]})

    volumes: list[VolumeResponse]
    next_cursor: str | None = None


class SourceResponse(BaseModel):
    epoch: int
    last_seq: int
    batches: int
    events: int
    last_ts_ns: int = Field(0, description="timestamp of its last batch (publisher clock, ns since the Unix epoch)")
    last_seen_s: float = Field(0.0, description="ts_ns of its last batch, seconds since the Unix epoch")
    last_seen: str = Field("", description="the same, ISO 8601 UTC")


class MovesResponse(BaseModel):
    """What the mover did: totals of completed items, and per-kind outcome counts."""

    promotions: int
    demotions: int
    compactions: int
    bytes_moved: int
    done: dict[str, int]
    skipped: dict[str, int]
    failed: dict[str, int]
    bytes_by_kind: dict[str, int]
    blocks_by_kind: dict[str, int]
    routes: dict[str, int] = Field(default_factory=dict)
    """Completed moves per ``"<kind> <source>-><destination>"`` volume pair (e.g.
    ``"demote slow->s3"``); empty where the advisor does not count them."""


class LocationBlocksResponse(BaseModel):
    """Blocks the index places at one location."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "location": "w0/g1", "count": 2, "sequence_hashes": [11, 12],
        "sequence_hashes_hex": ["0x000000000000000b", "0x000000000000000c"], "next_cursor": None}]})


    location: str
    count: int = Field(description="blocks at the location (all pages)")
    sequence_hashes: list[int] = Field(description="this page, ascending")
    sequence_hashes_hex: list[str]
    next_cursor: str | None = Field(None, description="cursor of the next page, null on the last")


class LocationsResponse(BaseModel):
    """Blocks per location."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"locations": {"slow": 2, "w0/g1": 4}}]})


    locations: dict[str, int]


_STATS_EXAMPLE: dict[str, Any] = {
    "blocks": 1, "blocks_per_location": {"w0/g1": 1}, "orphans_pending": 0, "index_counters": {"stores": 1},
    "sources": {"w0": {"epoch": 5, "last_seq": 0, "batches": 1, "events": 1,
                       "last_ts_ns": 1764600000000000000}}, "journal_position": 1,
    "batches_applied": 1, "events_applied": 1, "events_per_s": 1.0, "ingest_events_per_busy_s": 5600.0,
    "ingest": {"ingested_batches": 1}, "advisor_events": 0, "promotions": 0, "demotions": 0, "compactions": 0,
    "bytes_moved": 0, "moves": {"promotions": 0, "demotions": 0, "compactions": 0, "bytes_moved": 0,
                                "done": {"promote": 0}, "skipped": {"promote": 0}, "failed": {"promote": 0},
                                "bytes_by_kind": {"promote": 0}, "blocks_by_kind": {"promote": 0}},
    "subscriber": {}, "uptime_s": 12.5,
    "hit_rates": {"lookup": {"1m": {"lookups": 1, "tiers": {"G1": {"hits": 1, "blocks": 1, "tokens": 16, "hit_rate": 1.0}},
                                    "workers": {"w0": {"hits": 1, "blocks": 1, "tokens": 16, "hit_rate": 1.0}}}}},
}


class StatsResponse(BaseModel):
    """Index, ingest, mover and subscriber figures."""

    model_config = ConfigDict(json_schema_extra={"examples": [_STATS_EXAMPLE]})

    blocks: int
    blocks_per_location: dict[str, int]
    orphans_pending: int
    index_counters: dict[str, int]
    sources: dict[str, SourceResponse]
    journal_position: int
    batches_applied: int
    events_applied: int
    events_per_s: float = Field(description="arrival rate over the last 10 s")
    ingest_events_per_busy_s: float = Field(description="ingest capacity: events per second of journal + apply work")
    ingest: dict[str, int]
    advisor_events: int = Field(description="events the advisor published for its own moves")
    promotions: int
    demotions: int
    compactions: int
    bytes_moved: int
    moves: MovesResponse
    subscriber: dict[str, int]
    uptime_s: float
    namespaces: dict[str, Any] = Field(default_factory=dict, description=(
        '{"managed": [namespace, ...], "seen": {namespace: {volume: blocks}}, "left": {namespace: blocks}}: the key '
        "namespaces this advisor moves (configured, then those followed from the catalog up to max_namespaces), "
        "those the catalog places blocks in (a connector's namespace is its model fingerprint's), and those it "
        "leaves alone"))
    hit_rates: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='kind ("lookup", "query") -> "total" / "1m" / "1h" -> {lookups, tiers, workers} (api.hit_rates)')
    indexer: dict[str, Any] = Field(
        default_factory=dict,
        description="the indexer routes: registrations, indexes, blocks (per medium) held, max_worker_blocks, "
                    "max_blocks, refused_blocks {worker_blocks, blocks} (api.worker_index.BlockBudget)")
    prefetch: dict[str, int] = Field(
        default_factory=dict,
        description="lookups taken as prefetch hints and the prefetch moves' outcomes: hints, refused, queued, "
                    "issued, skipped, failed, bytes, used, wasted, pending, tracked (advisor.moves.prefetch); empty "
                    "when the advisor does not prefetch")
    policy: dict[str, Any] = Field(
        default_factory=dict,
        description="the default policy's live expert selection: leader (the expert whose order the policy rounds "
                    "follow), switches, requests observed, window_requests, window_refs, superseded_blocks (blocks "
                    "the rounds rank first while they follow prefix_value), finish_hints, finish_hint_clients and "
                    "finish_hints_dropped (routers' POST /v1/finished hints kept, the API tokens they came "
                    "from, and hints dropped by their quota), clock_refused (batches "
                    "stamped more than 5 s ahead of the advisor's clock, not taken as arrivals) "
                    "(advisor.policy.eviction.experts.LiveSelector); on a partitioned cluster's API "
                    "{\"partitions\": {partition: those fields}}, each partition's own selection")


class PlanResponse(BaseModel):
    """One executed plan item and its outcome."""

    kind: str
    status: str
    reason: str
    detail: str
    src_volume: str
    dst_volume: str | None
    sequence_hash: int | None
    sequence_hash_hex: str | None
    segment_id: int | None
    bytes: int
    bytes_moved: int
    blocks_moved: int
    finished_ns: int
    duration_s: float


class PlansResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"plans": [{
        "kind": "promote", "status": "done", "reason": "hits 5 >= min_hits 3", "detail": "", "src_volume": "slow",
        "dst_volume": "fast", "sequence_hash": 11, "sequence_hash_hex": "0x000000000000000b", "segment_id": None,
        "bytes": 2048, "bytes_moved": 2048, "blocks_moved": 1, "finished_ns": 1764600000000000000,
        "duration_s": 0.002}], "summary": {"promote_done": 1}, "next_cursor": None}]})

    plans: list[PlanResponse]
    next_cursor: str | None = None
    summary: dict[str, int] = Field(description='counts by "<kind>_<status>"')


class HealthResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"status": "ok", "journal_position": 1, "subscribed": True,
                                                               "storage": True}]})

    status: str
    journal_position: int
    subscribed: bool
    storage: bool
    reason: str | None = None


def plan_response(res: Any) -> PlanResponse:
    """Convert an ``advisor.policy.plan.PlanResult``."""
    it = res.item
    return PlanResponse(
        kind=it.kind.value,
        status=res.status.value,
        reason=it.reason,
        detail=res.detail,
        src_volume=it.src_volume,
        dst_volume=it.dst_volume,
        sequence_hash=it.sequence_hash,
        sequence_hash_hex=hex64(it.sequence_hash) if it.sequence_hash is not None else None,
        segment_id=it.segment_id,
        bytes=it.bytes,
        bytes_moved=res.bytes_moved,
        blocks_moved=res.blocks_moved,
        finished_ns=res.finished_ns,
        duration_s=res.duration_s,
    )
