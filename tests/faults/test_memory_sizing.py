"""Finding 8: memory sized from configuration is refused before it is allocated, naming
what, the bytes and the setting: a G1/G2 pool, the G3 -> G1 bounce buffer, a volume's
staging buffer (``segment_bytes``). 1 PiB is asked for, so without the checks the raw
allocator error comes back at once (no memory is touched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from event_plane import make_publisher
from kvbm_runtime import BlockManager, RuntimeConfig
from kvbm_runtime.errors import CapacityConfigError
from kvbm_runtime.layout import make_layout
from storage_backends import MediaClass, SqliteCatalog, StorageAgent, VolumeConfigError, VolumeDescriptor, VolumeKind

PIB = 1 << 50


def _cfg(**kw: int) -> RuntimeConfig:
    return RuntimeConfig(model_name="faults/memory", num_layers=2, outer_dim=2, page_size=16, inner_dim=64,
                         kv_dtype="float16", g1_blocks=8, g2_blocks=kw.pop("g2_blocks", 32), **kw)


def test_a_pool_larger_than_memory_is_refused_naming_tier_bytes_and_setting() -> None:
    lc = _cfg().layout_config()
    n = PIB // lc.block_bytes
    with pytest.raises(CapacityConfigError) as ei:
        make_layout("FullyContiguous", lc, n, tier="g2")
    msg = str(ei.value)
    assert "G2 pool" in msg and f"num_blocks={n}" in msg and str(n * lc.block_bytes) in msg and "available" in msg


def test_a_bounce_buffer_larger_than_memory_is_refused() -> None:
    cfg = _cfg(bounce_blocks=PIB // _cfg().layout_config().block_bytes)
    pub = make_publisher("null://", "faults-w0")
    try:
        with pytest.raises(CapacityConfigError, match=r"bounce buffer.*bounce_blocks=\d+"):
            BlockManager(cfg, pub)
    finally:
        pub.close()


def test_a_volume_whose_segment_does_not_fit_in_memory_is_refused(tmp_path: Path) -> None:
    agent = StorageAgent(SqliteCatalog(tmp_path / "catalog.sqlite"), "faults-mem")
    try:
        desc = VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 2 * PIB, root=str(tmp_path / "fast"),
                                segment_bytes=PIB)
        with pytest.raises(VolumeConfigError, match=rf"staging buffer of volume 'fast'.*segment_bytes={PIB}"):
            agent.register_volume(desc)
        assert agent.volumes() == []
    finally:
        agent.close()
        agent.catalog.close()


def test_the_refusal_names_the_device_and_the_memory_it_has() -> None:
    from storage_backends.memory_budget import MemoryBudgetError, check_allocation

    with pytest.raises(MemoryBudgetError, match=r"G1 pool needs 2\.00 GiB .*num_blocks=8 .* cuda:0 has 1\.00 GiB"):
        check_allocation("G1 pool", 2 << 30, "num_blocks=8 x 268435456 bytes per block", "cuda:0", available=1 << 30)
    check_allocation("G1 pool", 1 << 30, "num_blocks=4", "cuda:0", available=1 << 30)  # exactly fits: allowed
