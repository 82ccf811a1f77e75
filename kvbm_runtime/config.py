"""Runtime configuration (pydantic-settings, env prefix ``KVADVISOR_RUNTIME_``).

Also accepts the names KVBM users already set (KVBM configuration reference):

=========================================== =====================================
``DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS``   ``g2_blocks``
``DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS``  ``g3_blocks``
``DYN_KVBM_CPU_CACHE_GB``                    ``cpu_cache_gb`` (→ ``g2_blocks``)
``DYN_KVBM_DISK_CACHE_GB``                   ``disk_cache_gb`` (→ ``g3_blocks``)
``DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER``     ``disable_disk_offload_filter``
``DYN_KVBM_DISK_ZEROFILL_FALLBACK``          ``disk_zerofill_fallback``
``DYN_KVBM_DISK_ALLOCATOR_TYPE``             ``disk_allocator_type``
``DYN_KVBM_DISK_DISABLE_O_DIRECT``           ``disk_disable_o_direct``
``DYN_KVBM_METRICS``                         ``metrics``
``DYN_KVBM_METRICS_PORT``                    ``metrics_port``
``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS`` ``leader_worker_init_timeout_secs``
=========================================== =====================================

The disk-offload admission filter (a block is written to G3 only once its frequency is at
least 2, see :class:`~kvbm_runtime.transfer.DiskOffloadFilter`) is on by default; it is
off when ``disk_offload_filter=False`` (``KVADVISOR_RUNTIME_DISK_OFFLOAD_FILTER=false``) or
``DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=true``.  :attr:`RuntimeConfig.offload_filter_enabled`
combines both.

A block-count override wins over a size in GB (10^9 bytes), as in KVBM.  Capacities that
shrink from G1 to G2 (or from G2 to G3 when G3 is sized) are refused with
:class:`~kvbm_runtime.errors.CapacityConfigError` naming the numbers.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import CapacityConfigError, LayoutConfigError
from .hashing import ModelFingerprint
from .layout import LayoutConfig, LayoutKind, dtype_from_name

_GB = 1_000_000_000


def _alias(field: str, *extra: str) -> AliasChoices:
    return AliasChoices(field, f"KVADVISOR_RUNTIME_{field.upper()}", *extra)


class RuntimeConfig(BaseSettings):
    """Configuration of one worker's :class:`~kvbm_runtime.manager.BlockManager`.

    Attributes:
        model_name, model_revision: model identity (part of the salt and the storage namespace).
        lora_name, cache_salt: optional salt fields (DESIGN.md §4).
        num_layers, outer_dim, page_size, inner_dim, kv_dtype, alignment: block geometry
            (``page_size`` = block size in tokens).
        layout: ``"FullyContiguous"`` or ``"LayerSeparated"``.
        g1_blocks: device pool size in blocks.
        g2_blocks: host pool size in blocks (≥ g1_blocks).
        g3_blocks: disk budget in blocks (≥ g2_blocks when set; informational otherwise).
        cpu_cache_gb, disk_cache_gb: KVBM-style sizes in GB, used when the block counts
            are not given.
        disk_offload_filter: admission filter before G2 → G3 writes (frequency >= 2; 1
            when first offered, doubling on each further offer, minus 1 every
            ``disk_filter_decay_s``); on by default.
        disable_disk_offload_filter: KVBM's switch; ``True`` turns the filter off.
        disk_filter_decay_s: seconds between two decay steps of the filter (every
            frequency minus 1).
        disk_zerofill_fallback, disk_allocator_type, disk_disable_o_direct: KVBM's disk
            options; handed to whoever creates the G3 volume (:meth:`volume_options`); the
            runtime itself writes through the storage agent.
        metrics: serve ``/metrics`` over HTTP (prometheus-client) on ``metrics_port``.
        metrics_port: port of that endpoint (0: a free port is chosen).
        leader_worker_init_timeout_secs: how long parallel ranks wait for each other at
            start-up (``kvbm_runtime.parallel``).
        tp_rank, tp_size: tensor-parallel rank and world size; with ``tp_size > 1`` the
            storage namespace gets a ``/tp<rank>of<size>`` suffix (each rank stores its own
            shard under the same sequence hashes).
        transfer_batch_blocks: most blocks one transfer-manager batch moves.
        bounce_blocks: blocks in the host bounce buffer of the G3 → G1 path.
        hit_rate_window: requests in the sliding window of the hit-rate gauges.
    """

    model_config = SettingsConfigDict(env_prefix="KVADVISOR_RUNTIME_", populate_by_name=True, extra="ignore")

    model_name: str = "kvadvisor/demo-model"
    model_revision: str = ""
    lora_name: str | None = None
    cache_salt: str | None = None

    num_layers: int = Field(2, gt=0)
    outer_dim: int = Field(2, gt=0)
    page_size: int = Field(16, gt=0)
    inner_dim: int = Field(64, gt=0)
    kv_dtype: str = "float16"
    alignment: int = Field(1, gt=0)
    layout: LayoutKind = "FullyContiguous"

    g1_blocks: int = Field(64, gt=0)
    g2_blocks: int | None = Field(None, gt=0, validation_alias=_alias("g2_blocks", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"))
    g3_blocks: int | None = Field(None, gt=0, validation_alias=_alias("g3_blocks", "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"))
    cpu_cache_gb: float | None = Field(None, gt=0, validation_alias=_alias("cpu_cache_gb", "DYN_KVBM_CPU_CACHE_GB"))
    disk_cache_gb: float | None = Field(None, gt=0, validation_alias=_alias("disk_cache_gb", "DYN_KVBM_DISK_CACHE_GB"))
    disable_disk_offload_filter: bool = Field(
        False, validation_alias=_alias("disable_disk_offload_filter", "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER")
    )
    disk_offload_filter: bool = Field(True, validation_alias=_alias("disk_offload_filter"))
    disk_filter_decay_s: float = Field(600.0, gt=0)
    disk_zerofill_fallback: bool = Field(
        False, validation_alias=_alias("disk_zerofill_fallback", "DYN_KVBM_DISK_ZEROFILL_FALLBACK")
    )
    disk_allocator_type: str | None = Field(
        None, validation_alias=_alias("disk_allocator_type", "DYN_KVBM_DISK_ALLOCATOR_TYPE")
    )
    disk_disable_o_direct: bool = Field(
        False, validation_alias=_alias("disk_disable_o_direct", "DYN_KVBM_DISK_DISABLE_O_DIRECT")
    )
    metrics: bool = Field(False, validation_alias=_alias("metrics", "DYN_KVBM_METRICS"))
    metrics_port: int = Field(6880, ge=0, le=65535, validation_alias=_alias("metrics_port", "DYN_KVBM_METRICS_PORT"))
    leader_worker_init_timeout_secs: float = Field(
        120.0, gt=0, validation_alias=_alias("leader_worker_init_timeout_secs", "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS")
    )
    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, gt=0)
    transfer_batch_blocks: int = Field(256, gt=0)
    bounce_blocks: int = Field(32, gt=0)
    hit_rate_window: int = Field(1000, gt=0)

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        try:
            layout = self.layout_config()
        except LayoutConfigError as exc:
            raise ValueError(str(exc)) from exc
        if self.g2_blocks is None:
            if self.cpu_cache_gb is not None:
                self.g2_blocks = max(1, int(self.cpu_cache_gb * _GB) // layout.block_bytes)
            else:
                self.g2_blocks = 4 * self.g1_blocks
        if self.g3_blocks is None and self.disk_cache_gb is not None:
            self.g3_blocks = max(1, int(self.disk_cache_gb * _GB) // layout.block_bytes)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})")
        return self

    @property
    def offload_filter_enabled(self) -> bool:
        """Whether G3 writes go through the disk-offload admission filter."""
        return self.disk_offload_filter and not self.disable_disk_offload_filter

    def namespace_suffix(self) -> str:
        """``""``, or ``"/tp<rank>of<size>"`` for a tensor-parallel rank."""
        return f"/tp{self.tp_rank}of{self.tp_size}" if self.tp_size > 1 else ""

    def volume_options(self) -> dict[str, object]:
        """KVBM disk options for whoever registers the G3 volume: ``o_direct`` (bool),
        ``zerofill_fallback`` (bool), ``allocator_type`` (str or ``None``)."""
        return {
            "o_direct": not self.disk_disable_o_direct,
            "zerofill_fallback": self.disk_zerofill_fallback,
            "allocator_type": self.disk_allocator_type,
        }

    def layout_config(self) -> LayoutConfig:
        """Block geometry as a :class:`LayoutConfig`.

        Raises:
            LayoutConfigError: invalid geometry or dtype.
        """
        return LayoutConfig(
            num_layers=self.num_layers,
            outer_dim=self.outer_dim,
            page_size=self.page_size,
            inner_dim=self.inner_dim,
            dtype=dtype_from_name(self.kv_dtype),
            alignment=self.alignment,
        )

    def fingerprint(self) -> ModelFingerprint:
        """Model fingerprint (name, revision, dtype, layout, block size in tokens)."""
        return ModelFingerprint(
            name=self.model_name,
            dtype=self.kv_dtype,
            layout=self.layout,
            block_size=self.page_size,
            revision=self.model_revision,
        )

    def check_capacities(self) -> None:
        """Refuse tier capacities that shrink from G1 to G2 to G3.

        Raises:
            CapacityConfigError: naming the numbers, e.g. ``"G1 has 64 blocks but G2
                only 32"``.
        """
        g2 = self.g2_blocks
        assert g2 is not None
        if g2 < self.g1_blocks:
            raise CapacityConfigError(
                f"tier capacities must not shrink from G1 to G2: G1 has {self.g1_blocks} blocks "
                f"but G2 only {g2} (set g2_blocks >= {self.g1_blocks})"
            )
        if self.g3_blocks is not None and self.g3_blocks < g2:
            raise CapacityConfigError(
                f"tier capacities must not shrink from G2 to G3: G2 has {g2} blocks "
                f"but G3 only {self.g3_blocks} (set g3_blocks >= {g2})"
            )

