"""Response and request models of the REST API (pydantic).

Sequence hashes are u64; JSON numbers carry them exactly in Python clients, and every
hash is also given as a ``0x…`` string for clients whose numbers are doubles.
"""

from __future__ import annotations

import re

from typing import Any

from pydantic import BaseModel, Field, StrictInt, StrictStr, field_validator

U64_MAX = (1 << 64) - 1
MAX_LOOKUP_HASHES = 100_000


class HashParseError(ValueError):
    """A sequence hash is not a decimal or 0x-hex u64."""


_HASH_TEXT = re.compile(r"0[xX]([0-9a-fA-F]{1,16})|([0-9]{1,20})", re.ASCII)


def parse_sequence_hash(value: int | str) -> int:
    """Parse a sequence hash given as an int, a decimal string or a ``0x`` hex string.

    Raises:
        HashParseError: not a number, negative, or above 2**64 - 1.
    """
    if isinstance(value, bool):
        raise HashParseError(f"sequence hash must be an integer, got {value!r}")
    if isinstance(value, int):
        h = value
    elif isinstance(value, str):
        # ASCII digits only: int() alone would also take "1_0" and non-ASCII digits.
        m = _HASH_TEXT.fullmatch(value.strip())
        if m is None:
            raise HashParseError(f"sequence hash {value!r} is neither decimal nor 0x-hex")
        h = int(m.group(1), 16) if m.group(1) else int(m.group(2), 10)
    else:
        raise HashParseError(f"sequence hash must be an integer or string, got {type(value).__name__}")
    if not 0 <= h <= U64_MAX:
        raise HashParseError(f"sequence hash {value!r} is outside the u64 range 0..2**64-1")
    return h


def hex64(h: int) -> str:
    """``0x`` + 16 lowercase hex digits."""
    return f"0x{h:016x}"


class ErrorResponse(BaseModel):
    """Every error body: a stable machine code and a human explanation."""

    error: str
    detail: str


class BlockResponse(BaseModel):
    """One indexed block."""

    sequence_hash: int
    sequence_hash_hex: str
    parent: int | None
    prefix_hash: int = Field(description="sequence hash of the chain's first block (prefix family)")
    size_bytes: int
    locations: list[str]
    hits: int
    last_access_ns: int
    orphan: bool
    children: list[int]


class LookupRequest(BaseModel):
    """``{"sequence_hashes": [h0, h1, ...]}``, first block first; ints or decimal/0x strings."""

    sequence_hashes: list[StrictInt | StrictStr] = Field(max_length=MAX_LOOKUP_HASHES)

    @field_validator("sequence_hashes")
    @classmethod
    def _parse(cls, values: list[int | str]) -> list[int]:
        out = []
        for i, v in enumerate(values):
            try:
                out.append(parse_sequence_hash(v))
            except HashParseError as exc:
                raise ValueError(f"sequence_hashes[{i}]: {exc}") from None
        return out


class LookupResponse(BaseModel):
    """Longest cached prefix, in blocks, per location."""

    requested: int
    prefix_blocks: dict[str, int] = Field(description="location -> leading blocks all held there")
    any_location: int = Field(description="leading blocks held somewhere (locations may differ)")
    longest: int = Field(description="max over prefix_blocks (0 if none)")


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


class VolumesResponse(BaseModel):
    volumes: list[VolumeResponse]


class SourceResponse(BaseModel):
    epoch: int
    last_seq: int
    batches: int
    events: int


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


class LocationBlocksResponse(BaseModel):
    """Blocks the index places at one location."""

    location: str
    count: int
    sequence_hashes: list[int]


class LocationsResponse(BaseModel):
    """Blocks per location."""

    locations: dict[str, int]


class StatsResponse(BaseModel):
    """Index, ingest, mover and subscriber figures."""

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
    plans: list[PlanResponse]
    summary: dict[str, int] = Field(description='counts by "<kind>_<status>"')


class HealthResponse(BaseModel):
    status: str
    journal_position: int
    subscribed: bool
    storage: bool
    reason: str | None = None


def plan_response(res: Any) -> PlanResponse:
    """Convert an ``advisor.plan.PlanResult``."""
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
