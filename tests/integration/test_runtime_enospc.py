"""Case C14 through the runtime: the G3 volume fills up part-way through an offload.

The 1 MiB filesystem (a real tmpfs, or the injected short writer where mounting is
refused) comes from ``test_storage_enospc``.  Blocks that landed get exactly one Store;
the one that did not gets none, keeps its host copy, and is reported as ENOSPC.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from event_plane import KVEvent, NullPublisher
from kvadvisor.demo import DemoReport
from kvbm_runtime import BlockManager, RuntimeConfig, fill_synthetic_kv
from storage_backends import SqliteCatalog, StorageAgent, VolumeFullError
from test_storage_enospc import _CAN_MOUNT, _agent, _inject_short_writer, small_fs  # noqa: F401 - fixture

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _config() -> RuntimeConfig:
    # fp16 [4 layers, 2, 16 tokens, 1024] = 256 KiB per block
    return RuntimeConfig(model_name="c14/model", num_layers=4, outer_dim=2, page_size=16, inner_dim=1024,
                         g1_blocks=8, g2_blocks=8, disk_offload_filter=False)


def test_c14_offload_filling_the_volume_publishes_stores_only_for_landed_blocks(
    tmp_path: Path, small_fs: Path,
) -> None:
    agent, cat = _agent(tmp_path, small_fs, "c14-runtime")
    events: list[KVEvent] = []
    pub = NullPublisher("c14", on_flush=lambda batch, payload: events.extend(batch.events))
    mgr = BlockManager(_config(), pub, agent, "tiny")
    try:
        if not _CAN_MOUNT:
            _inject_short_writer(agent._vol("tiny"))  # type: ignore[attr-defined]
        assert mgr.block_bytes == 256 << 10
        r = mgr.serve(list(range(4 * 16)), fill_synthetic_kv)  # 4 x 256 KiB: 3 fit
        mgr.flush()
        pub.flush()
        hs = r.sequence_hashes
        keys = [mgr.block_key(h) for h in hs]
        assert agent.exists(keys) == [True, True, True, False]
        # one Store per landed block, in order, with its sequence parent; none for block 3
        tiny = [(e.sequence_hash, e.parent_hash) for e in events if e.type == 0 and e.storage_location == "tiny"]
        assert tiny == [(hs[0], None), (hs[1], hs[0]), (hs[2], hs[1])]
        assert r.stored_g3 == 3 and r.offloaded_bytes == (4 + 3) * mgr.block_bytes
        # the move reports ENOSPC for block 3 only
        assert [(e.position, e.sequence_hash, e.stage, e.error) for e in r.errors] == [
            (3, hs[3], "offload", VolumeFullError.__name__)
        ]
        assert "[Errno 28]" in r.errors[0].message and errno.ENOSPC == 28
        # the demo's report counts it among the blocks the workers could not offload
        report = DemoReport()
        report.add_served(r)
        assert (report.blocks, report.computed_blocks, report.offload_failed) == (4, 4, {VolumeFullError.__name__: 1})
        # the host copy of every block stays registered (block 3 is only there)
        assert mgr.resident("g2") == set(hs)
        # a later worker gets blocks 0-2 from the volume and recomputes block 3
        other = BlockManager(_config(), NullPublisher("later"), agent, "tiny")
        try:
            r2 = other.serve(list(range(4 * 16)), fill_synthetic_kv)
            assert (r2.hits_g3, r2.computed, r2.stored_g3) == (3, 1, 0)
            assert [e.position for e in r2.errors] == [3]
        finally:
            other.close()
    finally:
        mgr.close()
        agent.close()
        cat.close()


def test_offload_into_a_volume_with_no_room_at_all_reports_every_block(tmp_path: Path) -> None:
    """A put that stores nothing: every submitted block is reported, no Store is published."""
    from storage_backends import MediaClass, VolumeDescriptor, VolumeKind

    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    agent = StorageAgent(cat, name="c14-none")
    # the catalog's capacity (64 KiB) is smaller than one block
    agent.register_volume(VolumeDescriptor("wee", VolumeKind.POSIX, MediaClass.SSD, 64 << 10, root=str(tmp_path / "wee"),
                                           segment_bytes=256 << 10))
    events: list[KVEvent] = []
    pub = NullPublisher("none", on_flush=lambda batch, payload: events.extend(batch.events))
    mgr = BlockManager(_config(), pub, agent, "wee")
    try:
        r = mgr.serve(list(range(2 * 16)), fill_synthetic_kv)
        pub.flush()
        assert r.stored_g3 == 0
        assert [(e.position, e.error) for e in r.errors] == [(0, "VolumeFullError"), (1, "VolumeFullError")]
        assert [e for e in events if e.storage_location == "wee"] == []
        assert mgr.resident("g2") == set(r.sequence_hashes)
    finally:
        mgr.close()
        agent.close()
        cat.close()
