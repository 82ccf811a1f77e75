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
``DYN_KVBM_NCCL_MLA_MODE``                   ``nccl_mla_mode`` (only ``false``)
=========================================== =====================================

Each takes effect or is refused at validation with an error naming the variable; the
table with effects, defaults and tests is in ``docs/operations.md`` ("KVBM settings").

The disk-offload admission filter (a block is written to G3 only once its frequency is at
least 2, see :class:`~kvbm_runtime.transfer.DiskOffloadFilter`) is on by default; it is
off when ``disk_offload_filter=False`` (``KVADVISOR_RUNTIME_DISK_OFFLOAD_FILTER=false``) or
``DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=true``.  :attr:`RuntimeConfig.offload_filter_enabled`
combines both.

A block-count override wins over a size in GB (10^9 bytes), as in KVBM.  Capacities that
shrink from G1 to G2 (or from G2 to G3 when G3 is sized) are refused with
:class:`~kvbm_runtime.errors.CapacityConfigError` naming the numbers, and so is a host pool
larger than the machine's available memory (:meth:`RuntimeConfig.check_memory`).

Disk-only mode (:attr:`RuntimeConfig.disk_only`, as in KVBM): a disk cache is configured and
no CPU cache is (neither ``cpu_cache_gb`` nor ``g2_blocks`` set).  The disk-offload filter
does not apply then, and the vLLM connector offloads G1 → G3 directly (the G2 pool, sized
by its default, only stages those copies).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from storage_backends.types import MediaClass, VolumeDescriptor, VolumeKind

from .errors import CapacityConfigError, LayoutConfigError
from .hashing import ModelFingerprint
from .layout import LayoutConfig, LayoutKind, default_device, dtype_from_name

_GB = 1_000_000_000
_GIB = 1 << 30

DISK_ALLOCATOR_TYPES = ("default", "open-direct")
"""Values of ``DYN_KVBM_DISK_ALLOCATOR_TYPE``: ``default`` = segment files opened with
O_DIRECT (unless disabled), buffered I/O where the filesystem refuses it; ``open-direct`` =
O_DIRECT required, a filesystem that refuses it is an error."""


def available_memory_bytes() -> int | None:
    """Memory available to new allocations, in bytes: ``MemAvailable`` of ``/proc/meminfo``
    (Linux), else psutil's ``virtual_memory().available`` when psutil is installed, else
    ``None`` (unknown)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _gib(nbytes: int) -> str:
    return f"{nbytes / _GIB:.2f} GiB"


def _alias(field: str, *extra: str) -> AliasChoices:
    return AliasChoices(field, f"KVADVISOR_RUNTIME_{field.upper()}", *extra)


class RuntimeConfig(BaseSettings):
    """Configuration of one worker's :class:`~kvbm_runtime.manager.BlockManager`.

    Attributes:
        model_name, model_revision: model identity (part of the salt and the storage namespace).
        lora_name, cache_salt: optional salt fields (docs/design.md §4).
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
        disk_zerofill_fallback: where the G3 filesystem has no ``fallocate``, zero-fill new
            segments (``True``) or only extend them (``False``, KVBM's default).
        disk_allocator_type: ``None`` / ``"default"`` or ``"open-direct"`` (O_DIRECT
            required, see :data:`DISK_ALLOCATOR_TYPES`); anything else is refused.
        disk_disable_o_direct: buffered I/O for G3 segment files.  The three disk options
            reach the G3 volume through :meth:`volume_options` /
            :meth:`g3_volume_descriptor`; the runtime itself writes through the storage agent.
        nccl_mla_mode: KVBM's MLA-cache replication over NCCL; not implemented here, so
            ``True`` is refused at validation.
        metrics: serve ``/metrics`` over HTTP (prometheus-client) on ``metrics_port``.
        metrics_port: port of that endpoint (0: a free port is chosen).
        leader_worker_init_timeout_secs: how long parallel ranks wait for each other at
            start-up (``kvbm_runtime.parallel``); 1800 s as in KVBM.
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
    nccl_mla_mode: bool = Field(False, validation_alias=_alias("nccl_mla_mode", "DYN_KVBM_NCCL_MLA_MODE"))
    leader_worker_init_timeout_secs: float = Field(
        1800.0, gt=0, validation_alias=_alias("leader_worker_init_timeout_secs", "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS")
    )
    tp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, gt=0)
    transfer_batch_blocks: int = Field(256, gt=0)
    bounce_blocks: int = Field(32, gt=0)
    hit_rate_window: int = Field(1000, gt=0)

    # where g2_blocks came from: "g2_blocks" (set), "cpu_cache_gb" (derived) or "default"
    _g2_origin: Literal["g2_blocks", "cpu_cache_gb", "default"] = PrivateAttr("default")

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        try:
            layout = self.layout_config()
        except LayoutConfigError as exc:
            raise ValueError(str(exc)) from exc
        if self.nccl_mla_mode:
            raise ValueError(
                "DYN_KVBM_NCCL_MLA_MODE=true (nccl_mla_mode) is not supported: kvbm_runtime does not "
                "replicate MLA caches over NCCL; unset it or set it to false"
            )
        if self.disk_allocator_type is not None and self.disk_allocator_type not in DISK_ALLOCATOR_TYPES:
            raise ValueError(
                f"DYN_KVBM_DISK_ALLOCATOR_TYPE (disk_allocator_type) must be one of "
                f"{', '.join(DISK_ALLOCATOR_TYPES)}, got {self.disk_allocator_type!r}"
            )
        if self.disk_allocator_type == "open-direct" and self.disk_disable_o_direct:
            raise ValueError(
                "DYN_KVBM_DISK_ALLOCATOR_TYPE=open-direct requires O_DIRECT but "
                "DYN_KVBM_DISK_DISABLE_O_DIRECT disables it; set only one of them"
            )
        if self.g2_blocks is not None:
            self._g2_origin = "g2_blocks"
        elif self.cpu_cache_gb is not None:
            self._g2_origin = "cpu_cache_gb"
            self.g2_blocks = max(1, int(self.cpu_cache_gb * _GB) // layout.block_bytes)
        else:
            self.g2_blocks = 4 * self.g1_blocks
        if self.g3_blocks is None and self.disk_cache_gb is not None:
            self.g3_blocks = max(1, int(self.disk_cache_gb * _GB) // layout.block_bytes)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})")
        return self

    @property
    def disk_only(self) -> bool:
        """KVBM's disk-only mode: a disk cache is configured (``disk_cache_gb`` or
        ``g3_blocks``) and no CPU cache (neither ``cpu_cache_gb`` nor ``g2_blocks`` set; the
        G2 pool then has its default size).  The vLLM connector offloads G1 → G3 directly
        and the disk-offload filter does not apply."""
        disk = self.disk_cache_gb is not None or self.g3_blocks is not None
        return disk and self._g2_origin == "default"

    @property
    def offload_filter_enabled(self) -> bool:
        """Whether G3 writes go through the disk-offload admission filter (on unless
        turned off, and never in :attr:`disk_only` mode)."""
        return self.disk_offload_filter and not self.disable_disk_offload_filter and not self.disk_only

    def namespace_suffix(self) -> str:
        """``""``, or ``"/tp<rank>of<size>"`` for a tensor-parallel rank."""
        return f"/tp{self.tp_rank}of{self.tp_size}" if self.tp_size > 1 else ""

    def volume_options(self) -> dict[str, bool]:
        """KVBM's disk options as :class:`~storage_backends.types.VolumeDescriptor` fields of
        the G3 POSIX volume: ``o_direct`` (not ``disk_disable_o_direct``),
        ``require_o_direct`` (``disk_allocator_type == "open-direct"``),
        ``zerofill_fallback`` (``disk_zerofill_fallback``)."""
        return {
            "o_direct": not self.disk_disable_o_direct,
            "require_o_direct": self.disk_allocator_type == "open-direct",
            "zerofill_fallback": self.disk_zerofill_fallback,
        }

    def g3_volume_descriptor(self, volume_id: str, root: str | Path) -> VolumeDescriptor:
        """The G3 POSIX volume (media SSD) under ``root`` with :meth:`volume_options`;
        capacity ``disk_cache_gb`` × 10^9 bytes when set, else ``g3_blocks`` × block bytes.

        Raises:
            CapacityConfigError: no disk cache configured (neither ``disk_cache_gb`` nor
                ``g3_blocks``).
        """
        if self.disk_cache_gb is not None:
            capacity = int(self.disk_cache_gb * _GB)
        elif self.g3_blocks is not None:
            capacity = self.g3_blocks * self.layout_config().block_bytes
        else:
            raise CapacityConfigError(
                "no G3 disk cache configured: set DYN_KVBM_DISK_CACHE_GB (disk_cache_gb) or "
                "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS (g3_blocks)"
            )
        return VolumeDescriptor(
            volume_id, VolumeKind.POSIX, MediaClass.SSD, capacity, root=str(root), **self.volume_options()
        )

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

    def _g2_setting(self) -> str:
        """Which setting sized G2, for error messages."""
        if self._g2_origin == "cpu_cache_gb":
            return f"from DYN_KVBM_CPU_CACHE_GB / cpu_cache_gb={self.cpu_cache_gb}"
        if self._g2_origin == "g2_blocks":
            return "from DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS / g2_blocks"
        return f"the default 4 x g1_blocks={self.g1_blocks}"

    def check_memory(self, available: int | None = None, g1: bool = True) -> None:
        """Refuse host pools larger than the memory available, before anything is allocated:
        the G2 pool, and G1 + G2 when the G1 pool is on the CPU (no CUDA device).

        Args:
            available: bytes available (default :func:`available_memory_bytes`; when that
                is unknown nothing is checked).
            g1: count a G1 pool too (``False`` when the engine keeps G1 itself).

        Raises:
            CapacityConfigError: naming the tier, the bytes and the setting, e.g. ``"G2
                host pool of 12.00 GiB (g2_blocks=1464843, from DYN_KVBM_CPU_CACHE_GB /
                cpu_cache_gb=12.0) exceeds the available memory 8.00 GiB"``.
        """
        avail = available_memory_bytes() if available is None else available
        if avail is None:
            return
        g2 = self.g2_blocks
        assert g2 is not None
        bb = self.layout_config().block_bytes
        g2_bytes = g2 * bb
        if g2_bytes > avail:
            raise CapacityConfigError(
                f"G2 host pool of {_gib(g2_bytes)} ({g2_bytes} bytes; g2_blocks={g2}, {self._g2_setting()}) "
                f"exceeds the available memory {_gib(avail)} ({avail} bytes)"
            )
        if g1 and default_device("g1")[0].type == "cpu":
            g1_bytes = self.g1_blocks * bb
            if g1_bytes + g2_bytes > avail:
                raise CapacityConfigError(
                    f"G1 pool on the CPU ({_gib(g1_bytes)}, g1_blocks={self.g1_blocks}) plus G2 host pool "
                    f"({_gib(g2_bytes)}, g2_blocks={g2}, {self._g2_setting()}) exceed the available memory "
                    f"{_gib(avail)} ({avail} bytes)"
                )

    def check_capacities(self, g1: bool = True) -> None:
        """Refuse tier capacities that shrink from G1 to G2 to G3.

        Args:
            g1: check G1 against G2 too (``False`` when the engine keeps G1 itself: an
                engine's G1 may be larger than the host pool behind it).

        Raises:
            CapacityConfigError: naming the numbers, e.g. ``"G1 has 64 blocks but G2
                only 32"``.
        """
        g2 = self.g2_blocks
        assert g2 is not None
        if g1 and g2 < self.g1_blocks:
            raise CapacityConfigError(
                f"tier capacities must not shrink from G1 to G2: G1 has {self.g1_blocks} blocks "
                f"but G2 only {g2} (set g2_blocks >= {self.g1_blocks})"
            )
        if self.g3_blocks is not None and self.g3_blocks < g2:
            raise CapacityConfigError(
                f"tier capacities must not shrink from G2 to G3: G2 has {g2} blocks "
                f"but G3 only {self.g3_blocks} (set g3_blocks >= {g2})"
            )

