#!/usr/bin/env python
"""Runtime benchmark: our block pool and transfer paths against bare references.

    python bench/runtime.py              # full run (about 1 minute on 2 cores)
    python bench/runtime.py --quick      # smaller totals, 1 run: a smoke check
    python bench/runtime.py --runs 7 --dir /mnt/nvme/kvbench

Prints, side by side in one run, medians of ``--runs`` runs:

1. Pool, per block: *allocate + register + release* (a request of 16 new blocks: take
   Reset blocks or evict the least valuable inactive ones, give each its identity,
   register it (Store event), drop the strong handle → inactive) and *match_blocks* of a
   registered 16-block prefix (+ release of the handles), against a bare reference doing
   the same bookkeeping with a deque free list, a dict registry and an OrderedDict LRU —
   no handles, no states, no events.  Goal: ours within 3x of the reference.
2. Offload throughput, GB/s: G1 → G2 through the transfer manager (reserve G2 blocks,
   wait for the step, weak → strong upgrade, copy, register, Store events) against one
   plain ``torch`` copy of the same bytes; G2 → G3 through the transfer manager into a
   NIXL POSIX volume (``StorageAgent.put``: checksums, segment packing, fsync, catalog)
   against a plain ``write`` + ``fsync`` of the same bytes into a file in the same
   directory.  Goal: ours >= 90 % of the reference.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import torch  # noqa: E402

from event_plane import NullPublisher  # noqa: E402
from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, RuntimeMetrics, make_layout  # noqa: E402
from kvbm_runtime.layout import MemoryKind  # noqa: E402
from kvbm_runtime.transfer import HostOffloadItem, StepEvent, StorageOffloadItem, TransferManager  # noqa: E402
from storage_backends import BlockKey, MediaClass, SqliteCatalog, StorageAgent, VolumeDescriptor, VolumeKind  # noqa: E402

REQ_BLOCKS = 16
SALT = 0x5EED


# ---------------------------------------------------------------------------- pool


class ListSink:
    """An event sink that keeps the events in a list (pool cost without the publisher's)."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def publish(self, events: list[object]) -> None:
        self.events.extend(events)


class BarePool:
    """Reference: the same bookkeeping as a pool, without lifecycle, handles or events."""

    def __init__(self, num_blocks: int) -> None:
        self.free: deque[int] = deque(range(num_blocks))
        self.registry: dict[int, int] = {}
        self.lru: OrderedDict[int, int] = OrderedDict()  # inactive: hash -> block id
        self.owner: dict[int, int] = {}  # block id -> hash

    def allocate_register_release(self, hashes: list[int]) -> None:
        ids = []
        for _ in hashes:
            if self.free:
                ids.append(self.free.popleft())
            else:
                h, b = self.lru.popitem(last=False)
                del self.registry[h]
                ids.append(b)
        for h, b in zip(hashes, ids):
            if h in self.registry:
                self.free.append(b)
                continue
            self.registry[h] = b
            self.owner[b] = h
        for h in hashes:
            self.lru[h] = self.registry[h]

    def match_release(self, hashes: list[int]) -> int:
        got = []
        for h in hashes:
            b = self.registry.get(h)
            if b is None:
                break
            self.lru.pop(h, None)
            got.append((h, b))
        for h, b in got:
            self.lru[h] = b
        return len(got)


def ours_churn(pool: BlockPool, requests: list[list[BlockMeta]]) -> None:
    for metas in requests:
        pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas)))


def ours_match(pool: BlockPool, prefix: list[int], rounds: int) -> None:
    for _ in range(rounds):
        pool.release_blocks(pool.match_blocks(prefix))


def identities(hashes: list[int]) -> list[BlockMeta]:
    return [BlockMeta(h, hashes[i - 1] if i else None, hashes[0], SALT) for i, h in enumerate(hashes)]


def _medians(pairs: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(median of ours, median of the reference, median of the per-run ratios)."""
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a / b for a, b in pairs),
    )


def time_it(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_pool(runs: int, n_requests: int, pool_blocks: int, match_rounds: int) -> dict[str, tuple[float, float]]:
    cfg = LayoutConfig(num_layers=1, outer_dim=1, page_size=16, inner_dim=8, dtype=torch.float16)
    out: dict[str, list[tuple[float, float]]] = {"churn": [], "churn_sink": [], "match": []}
    for run in range(runs):
        base = (run + 1) << 40
        requests = [[base + r * REQ_BLOCKS + k for k in range(REQ_BLOCKS)] for r in range(n_requests)]
        metas = [identities(h) for h in requests]  # identities are inputs for both sides
        n_blocks = n_requests * REQ_BLOCKS
        pub = NullPublisher("bench-pool")
        pool = BlockPool("g2", make_layout("FullyContiguous", cfg, pool_blocks, torch.device("cpu"), MemoryKind.SYSTEM), pub)
        bare = BarePool(pool_blocks)
        # interleave so both see the same machine state
        t_ours = time_it(lambda: (ours_churn(pool, metas), pub.flush()))
        t_bare = time_it(lambda: [bare.allocate_register_release(h) for h in requests])
        out["churn"].append((t_ours / n_blocks * 1e6, t_bare / n_blocks * 1e6))
        # the same pool work with events appended to a list (no validation / encoding)
        sink = ListSink()
        pool2 = BlockPool("g2", make_layout("FullyContiguous", cfg, pool_blocks, torch.device("cpu"), MemoryKind.SYSTEM), sink)
        metas2 = [identities([h + (1 << 39) for h in r]) for r in requests]
        t_sink = time_it(lambda: ours_churn(pool2, metas2))
        out["churn_sink"].append((t_sink / n_blocks * 1e6, t_bare / n_blocks * 1e6))
        assert len(sink.events) == n_blocks + max(0, n_blocks - pool_blocks)
        prefix = requests[-1]  # registered (the last request is never evicted)
        t_ours = time_it(lambda: ours_match(pool, prefix, match_rounds))
        t_bare = time_it(lambda: [bare.match_release(prefix) for _ in range(match_rounds)])
        n = match_rounds * len(prefix)
        out["match"].append((t_ours / n * 1e6, t_bare / n * 1e6))
        st = pool.stats()
        assert st.stores_published == n_blocks and st.removes_published == max(0, n_blocks - pool_blocks), st
        pub.close()
    return {k: _medians(v) for k, v in out.items()}


# ---------------------------------------------------------------------------- offload


def bench_offload(runs: int, total_mib: int, block_kib: int, workdir: Path) -> dict[str, tuple[float, float]]:
    workdir.mkdir(parents=True, exist_ok=True)
    inner = 256
    page = 16
    layers = max(1, block_kib * 1024 // (2 * page * inner * 2))
    cfg = LayoutConfig(num_layers=layers, outer_dim=2, page_size=page, inner_dim=inner, dtype=torch.float16)
    bb = cfg.block_bytes
    n = max(1, total_mib * (1 << 20) // bb)
    g1 = BlockPool("g1", make_layout("FullyContiguous", cfg, n, tier="g1"))
    g1.layout.storage.random_(0, 256)
    res: dict[str, list[tuple[float, float]]] = {"g1_g2": [], "g2_g3": [], "g2_g3_put": []}
    for run in range(runs):
        pub = NullPublisher("bench-offload")
        g2 = BlockPool("g2", make_layout("FullyContiguous", cfg, n, tier="g2"), pub)
        vol_dir = workdir / f"run{run}"
        agent = StorageAgent(SqliteCatalog(str(workdir / f"catalog{run}.sqlite")), f"bench-{run}")
        agent.register_volume(
            VolumeDescriptor(id="nvme", kind=VolumeKind.POSIX, media=MediaClass.NVME, capacity_bytes=8 * n * bb,
                             root=str(vol_dir), segment_bytes=64 << 20)
        )
        tm = TransferManager(g2, pub, RuntimeMetrics(f"bench-{run}"), agent, "nvme", max_batch_blocks=n)
        # register G1 blocks (identities), then offload all of them as one step
        hashes = [((run + 1) << 48) + i for i in range(n)]
        metas = [BlockMeta(h, hashes[i - 1] if i else None, hashes[0], SALT) for i, h in enumerate(hashes)]
        handles = g1.register_blocks([mb.init_from(m) for mb, m in zip(g1.allocate(n), metas)])
        items = [HostOffloadItem(m, g1.layout, h.block_id, h.weak()) for m, h in zip(metas, handles)]
        ref = torch.zeros_like(g2.layout.storage)  # written once: no first-touch page faults
        first_ref = run % 2 == 1  # alternate which side goes first
        if first_ref:
            t_ref = time_it(lambda: ref.copy_(g1.layout.storage))
        t0 = time.perf_counter()
        host = tm.offload_to_host(items, StepEvent.completed()).result()
        t_ours = time.perf_counter() - t0
        assert host.copied == n
        if not first_ref:
            t_ref = time_it(lambda: ref.copy_(g1.layout.storage))
        res["g1_g2"].append((n * bb / t_ours / 1e9, n * bb / t_ref / 1e9))
        # G2 -> G3 through the transfer manager vs write+fsync of the same bytes, and vs the
        # storage agent alone on the same bytes (other keys): what the transfer manager adds
        sitems = [StorageOffloadItem(m, BlockKey("bench", m.sequence_hash), (w,)) for m, w in zip(metas, host.blocks)]
        data = g2.layout.storage.numpy()
        stride = g2.layout.block_stride
        direct = [(BlockKey("direct", m.sequence_hash), g2.layout.storage[i * stride : i * stride + bb]) for i, m in enumerate(metas)]

        def plain_write() -> None:
            fd = os.open(str(vol_dir / "plain.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                pos = 0
                while pos < len(view):
                    pos += os.write(fd, view[pos:])
                os.fsync(fd)
            finally:
                os.close(fd)
            dfd = os.open(str(vol_dir), os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(dfd)
            os.close(dfd)

        if first_ref:
            t_ref = time_it(plain_write)
            t_put = time_it(lambda: agent.put(direct, "nvme"))
        t0 = time.perf_counter()
        stored = tm.offload_to_storage(sitems, StepEvent.completed()).result()
        t_ours = time.perf_counter() - t0
        assert stored.written == n and stored.error is None
        if not first_ref:
            t_ref = time_it(plain_write)
            t_put = time_it(lambda: agent.put(direct, "nvme"))
        res["g2_g3"].append((n * bb / t_ours / 1e9, n * bb / t_ref / 1e9))
        res["g2_g3_put"].append((n * bb / t_ours / 1e9, n * bb / t_put / 1e9))
        for h in handles:
            h.release()
        g1.evict()
        tm.close()
        agent.close()
        pub.close()
        shutil.rmtree(vol_dir, ignore_errors=True)
    return {k: _medians(v) for k, v in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="directory for the G3 volume (default: a temp dir)")
    ap.add_argument("--offload-mib", type=int, default=128)
    ap.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048],
                    help="block sizes (2048 KiB = a Llama-3-8B block of 16 tokens in fp16)")
    args = ap.parse_args()
    runs = 1 if args.quick else args.runs
    n_requests = 500 if args.quick else 4000
    total = 32 if args.quick else args.offload_mib
    torch.set_num_threads(1)

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}, "
          f"medians of {runs} runs (ratio = median of the per-run ratios)")
    pool_blocks = 2048 if args.quick else 8192
    pool = bench_pool(runs, n_requests, pool_blocks=pool_blocks, match_rounds=2000 if not args.quick else 200)
    print(f"\n1. pool, per block (requests of {REQ_BLOCKS} blocks, {n_requests * REQ_BLOCKS} blocks through a {pool_blocks}-block pool)")
    print(f"{'operation':<34}{'ours µs':>10}{'bare µs':>10}{'ratio':>8}   goal <= 3x")
    for key, label in (
        ("churn", "allocate+register+release"),
        ("churn_sink", "  same, events to a list"),
        ("match", "match_blocks (+ release)"),
    ):
        ours, bare, ratio = pool[key]
        print(f"{label:<34}{ours:>10.2f}{bare:>10.2f}{ratio:>7.2f}x   {'met' if ratio <= 3 else 'NOT met'}")

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvbench-rt-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        offs = {kib: bench_offload(runs, total, kib, base / f"b{kib}") for kib in args.block_kib}
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n2. offload throughput, {total} MiB per run (one step, one batch)")
    print(f"{'path':<34}{'block':>9}{'ours GB/s':>11}{'ref GB/s':>10}{'ratio':>8}   goal >= 90 %")
    for kib, off in offs.items():
        for key, label in (
            ("g1_g2", "G1 -> G2 vs torch copy"),
            ("g2_g3", "G2 -> G3 vs write+fsync"),
            ("g2_g3_put", "G2 -> G3 vs StorageAgent.put"),
        ):
            ours, ref, ratio = off[key]
            print(f"{label:<34}{kib:>6} KiB{ours:>11.2f}{ref:>10.2f}{ratio:>7.0%}    {'met' if ratio >= 0.9 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
