"""Settings of the ``kvadvisor demo`` replay (pydantic-settings, env prefix ``KVADVISOR_DEMO_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class DemoSettings(BaseSettings):
    """Everything one replay needs; every field can also come from ``KVADVISOR_DEMO_<NAME>``.

    Sizes are bytes unless the name says blocks.
    """

    model_config = SettingsConfigDict(env_prefix="KVADVISOR_DEMO_", extra="forbid")

    trace: Path | None = Field(None, description="Mooncake jsonl; default: the bundled 2,000-request slice")
    requests: int | None = Field(1000, ge=1, description="replay only the first N requests (None: all)")
    workers: int = Field(2, ge=1, le=16)
    transport: Literal["zmq", "nats", "mixed"] = "zmq"
    nats_url: str = "nats://127.0.0.1:4222"
    nats_namespace: str = Field("demo", description="NATS subject namespace (kvadvisor.events.<ns>.<source>)")
    workdir: Path | None = None
    s3_endpoint: str | None = Field(None, description="S3 endpoint; default: start a local one")
    s3_bucket: str = "kvadvisor-demo"
    s3_access_key: str | None = Field(None, description="default: the standard AWS credential chain")
    s3_secret_key: str | None = None
    # KV geometry of one block: [num_layers][outer_dim][page_size][inner_dim] of float16
    num_layers: int = Field(2, ge=1)
    outer_dim: int = Field(2, ge=1)
    page_size: int = Field(512, ge=1, description="tokens per block (the trace's block size)")
    inner_dim: int = Field(4, ge=1)
    # tier sizes in blocks; None: sized to the replayed slice (kvadvisor.demo.size_tiers)
    g1_blocks: int | None = Field(None, ge=1, description="G1 blocks per worker (default: sized to the slice)")
    g2_blocks: int | None = Field(None, ge=1, description="G2 blocks per worker (default: sized to the slice)")
    disk_offload_filter: bool = Field(False, description="KVBM's G3 admission filter (frequency >= 2); off: write-through")
    fast_capacity_blocks: int | None = Field(None, ge=1, description="capacity of the fast volume in blocks (default: sized to the slice)")
    slow_capacity_blocks: int | None = Field(None, ge=1, description="capacity of the slow volume in blocks (default: sized to the slice)")
    s3_capacity_blocks: int | None = Field(None, ge=1, description="capacity of the s3 volume in blocks (default: sized to the slice)")
    compaction_live_fraction: float = Field(0.75, gt=0.0, le=1.0, description="compact segments less live than this")
    max_moves_per_round: int = Field(4096, ge=0, description="the advisor's promotions + demotions per policy round")
    max_compactions_per_round: int = Field(64, ge=0, description="segments the advisor compacts per policy round")
    policy_every: int = Field(100, ge=1, description="run one advisor policy round every N requests")
    router_lookups: bool = Field(True, description="ask POST /v1/lookup before each request, as a KV-aware router does")
    api_port: int = Field(0, ge=0, le=65535, description="0: a free port")
    verify: bool = Field(False, description="check index == held blocks and read every block back")
    keep: bool = Field(False, description="keep the work directory")

    @field_validator("trace")
    @classmethod
    def _trace_exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.exists():  # a directory or another format: the reader names it
            raise ValueError(f"trace file {v} does not exist")
        return v

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        """A ``nats://HOST:PORT`` server address: the demo appends ``?namespace=`` itself."""
        from urllib.parse import urlsplit

        u = urlsplit(v)
        if u.scheme != "nats" or not u.hostname or u.query or u.path not in ("", "/"):
            raise ValueError(f"{v!r} is not a NATS server address like nats://127.0.0.1:4222 (no path or query)")
        return v
