"""Parallel modes with 2 real processes (torch.multiprocessing + gloo on a free TCP port):
replicated mode loads once on rank 0 and every rank ends with identical blocks; tensor
parallel ranks hold their own head shards under the same hashes and agree on one prefix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from event_plane import NullPublisher
from kvbm_runtime import BlockManager, RuntimeConfig, fill_synthetic_kv, synthetic_block_bytes, synthetic_kv
from kvbm_runtime.parallel import (
    ParallelConfigError,
    ReplicatedLoader,
    TensorParallelWorker,
    head_shard,
    init_group,
    shard_config,
)
from storage_backends import SqliteCatalog, StorageAgent, free_port
from storage_backends.types import MediaClass, VolumeDescriptor, VolumeKind

WORLD = 2
TOKENS = list(range(40, 56))  # 4 blocks of 4


def config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "it/parallel",
        "page_size": 4,
        "inner_dim": 16,
        "g1_blocks": 8,
        "g2_blocks": 16,
        "disk_offload_filter": False,
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


def _init(rank: int, port: int) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.set_num_threads(1)
    init_group(config(leader_worker_init_timeout_secs=60), rank, WORLD, f"tcp://127.0.0.1:{port}", backend="gloo")


def _ranks(rank: int, port: int, workdir: str) -> None:
    """Both scenarios in one process group (process start-up dominates the cost)."""
    _init(rank, port)
    try:
        _replicated(rank, workdir)
        _tensor_parallel(rank, workdir)
    finally:
        dist.destroy_process_group()


def _replicated(rank: int, workdir: str) -> None:
    store = None
    if rank == 0:
        # rank 0: blocks 0-1 in its G2 (G1 emptied), blocks 2-3 only on the volume
        store = StorageAgent(SqliteCatalog(f"{workdir}/catalog.sqlite"), "replicated")
        store.register_volume(
            VolumeDescriptor(id="nvme0", kind=VolumeKind.POSIX, media=MediaClass.NVME,
                             capacity_bytes=16 << 20, root=f"{workdir}/nvme0", segment_bytes=1 << 20)
        )
        BlockManager(config(), NullPublisher("writer"), store, "nvme0").serve(TOKENS, fill_synthetic_kv)
        mgr = BlockManager(config(), NullPublisher("rank0"), store, "nvme0")
        mgr.serve(TOKENS[:8], fill_synthetic_kv)
        mgr.g1.evict()
    else:
        mgr = BlockManager(config(), NullPublisher("rank1"))  # no storage at all on rank 1
    hashes = mgr.sequence_hashes(TOKENS)
    loader = ReplicatedLoader(mgr)
    res = loader.onboard(hashes)
    blocks = torch.stack([mgr.g1.layout.read_bytes(h.block_id) for h in res.blocks])
    for h in res.blocks:
        h.release()
    # a second onboard finds everything in every G1: nothing is loaded or sent
    again = loader.onboard(hashes)
    for h in again.blocks:
        h.release()
    torch.save(
        {
            "prefix": res.prefix,
            "loads": (res.loaded_g2, res.loaded_g3),
            "again": (again.prefix, again.loaded_g2, again.loaded_g3, again.broadcast_bytes),
            "sent": res.broadcast_bytes,
            "blocks": blocks,
            "hashes": hashes,
            "g2": sorted(mgr.resident("g2")),
            "shape": mgr.layout_config.block_shape,
        },
        f"{workdir}/replicated-{rank}.pt",
    )
    if store is not None:
        store.close()


def _tensor_parallel(rank: int, workdir: str) -> None:
    full = config()
    mgr = BlockManager(shard_config(full, rank, WORLD, num_heads=4), NullPublisher(f"tp{rank}"))
    hashes = mgr.sequence_hashes(TOKENS)
    shape = (full.num_layers, full.outer_dim, full.page_size, full.inner_dim)

    def fill(h: int, view: torch.Tensor) -> None:  # this rank's heads of the full block
        view.copy_(head_shard(synthetic_kv(h, shape, view.dtype), rank, WORLD))

    if rank == 1:  # rank 1 alone already holds the first two blocks
        mgr.serve(TOKENS[:8], fill)
    tp = TensorParallelWorker(mgr)
    res = tp.serve(TOKENS, fill)
    shards = torch.stack([mgr.read_block("g1", h).view(torch.float16).view(shape[:-1] + (8,)) for h in hashes])
    torch.save(
        {"hits": res.hits, "computed": res.computed, "hashes": hashes, "shards": shards, "namespace": mgr.namespace},
        f"{workdir}/tp-{rank}.pt",
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("parallel")
    mp.spawn(_ranks, args=(free_port(), str(workdir)), nprocs=WORLD, join=True)
    return workdir


def test_replicated_mode_loads_once_and_ranks_hold_identical_blocks(results: Path) -> None:
    r0 = torch.load(results / "replicated-0.pt")
    r1 = torch.load(results / "replicated-1.pt")
    assert r0["hashes"] == r1["hashes"] and r0["prefix"] == r1["prefix"] == 4
    assert r0["loads"] == (2, 2)  # rank 0 read 2 blocks from G2 and 2 from the volume
    assert r1["loads"] == (0, 0) and r1["g2"] == []  # rank 1 read nothing anywhere
    assert r0["sent"] == r1["sent"] == 4 * r0["blocks"].shape[1]
    assert torch.equal(r0["blocks"], r1["blocks"])
    expected = torch.stack([synthetic_block_bytes(h, r0["shape"]) for h in r0["hashes"]])
    assert torch.equal(r0["blocks"], expected)
    assert r0["again"] == r1["again"] == (4, 0, 0, 0)


def test_tensor_parallel_ranks_agree_on_the_prefix_and_hold_their_shards(results: Path) -> None:
    t0 = torch.load(results / "tp-0.pt")
    t1 = torch.load(results / "tp-1.pt")
    assert t0["hashes"] == t1["hashes"]  # same sequence hashes on every rank
    assert t0["namespace"] != t1["namespace"] and t0["namespace"].endswith("/tp0of2")
    # rank 1 could reuse 2 blocks, rank 0 none: both compute all 4 (agreed prefix 0)
    assert (t0["hits"], t0["computed"]) == (t1["hits"], t1["computed"]) == (0, 4)
    full = torch.cat([t0["shards"], t1["shards"]], dim=-1)
    shape = (2, 2, 4, 16)
    assert torch.equal(full, torch.stack([synthetic_kv(h, shape) for h in t0["hashes"]]))


def test_shard_config_refuses_uneven_splits() -> None:
    with pytest.raises(ParallelConfigError, match="cannot be split over 3 ranks"):
        shard_config(config(), 0, 3, num_heads=4)
    with pytest.raises(ParallelConfigError, match="rank 2 outside"):
        shard_config(config(), 2, 2, num_heads=4)
    cfg = shard_config(config(), 1, 2, num_heads=4)
    assert (cfg.inner_dim, cfg.tp_rank, cfg.tp_size, cfg.namespace_suffix()) == (8, 1, 2, "/tp1of2")
