#!/usr/bin/env python
"""Runtime benchmark: our block pool and transfer paths against bare references.

    python bench/runtime.py              # full run (about 1 minute on 2 cores)
    python bench/runtime.py --quick      # smaller totals, 1 run: a smoke check
    python bench/runtime.py --runs 7 --dir /mnt/nvme/kvbench
    python bench/runtime.py --pool-only --req-blocks 64
    python bench/runtime.py --offload-only --block-kib 256 --g12-rounds 1
    python bench/runtime.py --offload-only --no-storage --offload-mib 1024   # G1 <-> G2 only
    python bench/runtime.py --device cuda    # G1 on cuda:0 (exits 0 saying so without CUDA)

Prints, side by side in one run, medians of ``--runs`` runs:

1. Pool, per block, through the public API an engine uses, in batch calls of
   ``--req-blocks`` (16) blocks per request: ``allocate_complete(metas)`` (take Reset
   blocks or evict the least valuable inactive ones, give each its identity),
   ``register_blocks`` (Store event per new hash, dedup) and ``release_blocks`` (→ the
   frequency-aware inactive set); and ``match_blocks`` of a registered prefix followed by
   ``release_blocks``.  Against a bare reference making the same calls with the same work
   per block: a deque free list, a dict registry (hash → block, dedup) and an OrderedDict
   LRU, without handles, states, lock or events.  Goal: ours within 3x.  Also printed: the
   one-block calls (``allocate_complete([m])``, ``register``, ``h.release()``) against the
   reference called per block, and the batch calls with the events going through the
   event plane as a worker publishes them: the publisher ``null://`` makes (events off:
   the pool builds none, the publisher only counts them) and the one ``zmq://`` makes
   (the pool's events encoded straight from the block identities by the compiled encoder,
   batched, sent), bound to a local TCP socket with its replay socket, with a subscriber in
   another process that must receive every batch.  Pool figures are CPU time of the process (all
   its threads; a shared machine's other processes do not count), after a
   ``gc.collect()``, which side goes first alternating between runs.
2. Offload throughput, GB/s: G1 → G2 through the transfer manager (reserve G2 blocks,
   wait for the step, weak → strong upgrade, copy, register, Store events) against one
   plain ``torch`` copy of the same bytes, timed right before and right after ours,
   ``--g12-rounds`` (3) times per run on the same manager, in wall-clock time and in CPU
   time of the process (steady on a shared machine, where the wall clock of a memory copy
   swings with other processes); G2 → G3 (wall clock) through the transfer manager into a
   NIXL POSIX volume (``StorageAgent.put``: checksums, segment packing, fsync, catalog)
   against a plain ``write`` + ``fsync`` of the same bytes into a file in the same
   directory, and against ``StorageAgent.put`` called directly; G2 -> G1 onboard
   (``onboard_from_host`` of the offloaded blocks into an engine-owned G1 layout) against a
   plain copy of the same bytes, timed like G1 -> G2.  A one-block transfer on each path
   first starts the transfer manager's worker threads.  ``--device cuda`` puts G1 on
   ``cuda:0`` (G2 and the references pinned; the reference is ``copy_(non_blocking=True)``
   + synchronize).  Goals: G1 <-> G2 >= 95 % of the plain copy on the CPU, >= 90 % on CUDA;
   G2 -> G3 >= 90 %.  ``KVBENCH_SAMPLES=1`` prints every offload sample.
"""


from __future__ import annotations

import argparse
import gc
import os
import select
import shutil
import statistics
import subprocess
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

from bench._report import Report, add_json_option  # noqa: E402
from event_plane import EventType, KVEvent, NullPublisher  # noqa: E402
from event_plane.zmq_transport import ZmqPublisher  # noqa: E402
from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, RuntimeMetrics, make_layout  # noqa: E402
from kvbm_runtime.layout import MemoryKind  # noqa: E402
from kvbm_runtime.transfer import HostOffloadItem, HostOffloadResult, StepEvent, StorageOffloadItem, TransferManager  # noqa: E402
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
    """Reference: the same bookkeeping as a pool, without lifecycle, handles, lock or events.

    The same calls an engine makes, with the same work per block: ``allocate`` takes ids
    from a free list, evicting the least recently used inactive block (and forgetting its
    hash) when the list is empty; ``register`` records hash → block id (a hash already
    present dedups: the new id goes back to the free list); ``release`` moves blocks to the
    inactive LRU; ``match`` walks hashes to the first miss, taking hits out of the LRU.
    """

    def __init__(self, num_blocks: int) -> None:
        self.free: deque[int] = deque(range(num_blocks))
        self.registry: dict[int, int] = {}  # hash -> block id
        self.lru: OrderedDict[int, int] = OrderedDict()  # inactive: hash -> block id
        self.owner: dict[int, int] = {}  # block id -> hash

    def allocate(self, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            if self.free:
                ids.append(self.free.popleft())
            else:
                h, b = self.lru.popitem(last=False)
                del self.registry[h]
                ids.append(b)
        return ids

    def register(self, ids: list[int], hashes: list[int]) -> list[tuple[int, int]]:
        out = []
        for h, b in zip(hashes, ids):
            have = self.registry.get(h)
            if have is not None:
                self.free.append(b)
                out.append((h, have))
                continue
            self.registry[h] = b
            self.owner[b] = h
            out.append((h, b))
        return out

    def release(self, blocks: list[tuple[int, int]]) -> None:
        for h, b in blocks:
            self.lru[h] = b

    def match(self, hashes: list[int]) -> list[tuple[int, int]]:
        got = []
        for h in hashes:
            b = self.registry.get(h)
            if b is None:
                break
            self.lru.pop(h, None)
            got.append((h, b))
        return got


def bare_churn(bare: BarePool, requests: list[list[int]]) -> None:
    for hashes in requests:
        bare.release(bare.register(bare.allocate(len(hashes)), hashes))


def bare_churn_single(bare: BarePool, requests: list[list[int]]) -> None:
    for hashes in requests:
        for h in hashes:
            bare.release(bare.register(bare.allocate(1), [h]))


def bare_match(bare: BarePool, prefix: list[int], rounds: int) -> None:
    for _ in range(rounds):
        bare.release(bare.match(prefix))


def bare_match_single(bare: BarePool, prefix: list[int], rounds: int) -> None:
    for _ in range(rounds):
        for blk in bare.match(prefix):
            bare.release([blk])


def ours_churn(pool: BlockPool, requests: list[list[BlockMeta]]) -> None:
    """Batch calls, one per request: what an engine does per scheduler step."""
    for metas in requests:
        pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas)))


def ours_churn_single(pool: BlockPool, requests: list[list[BlockMeta]]) -> None:
    """The one-block calls: ``allocate_complete([m])``, ``register``, ``release``."""
    for metas in requests:
        for m in metas:
            (mb,) = pool.allocate_complete([m])
            pool.register(mb).release()


def ours_match(pool: BlockPool, prefix: list[int], rounds: int) -> None:
    for _ in range(rounds):
        pool.release_blocks(pool.match_blocks(prefix))


def ours_match_single(pool: BlockPool, prefix: list[int], rounds: int) -> None:
    for _ in range(rounds):
        for h in pool.match_blocks(prefix):
            h.release()


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
    """Wall-clock seconds of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def wall_cpu_it(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process) of ``fn()``."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    return t, time.process_time() - c0


def cpu_time_it(fn: Callable[[], object]) -> float:
    """CPU seconds of this process during ``fn()`` (all its threads): on a shared machine
    this leaves out the time other processes hold the core, which wall-clock time of a
    single-threaded loop counts as ours."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _timed_pair(run: int, ours: Callable[[], object], ref: Callable[[], object]) -> tuple[float, float]:
    """CPU seconds of ``ours`` and ``ref``, one after the other (which goes first
    alternates with ``run``), each after a ``gc.collect()`` so both start from the same heap."""
    order = (ours, ref) if run % 2 == 0 else (ref, ours)
    t: dict[int, float] = {}
    for fn in order:
        gc.collect()
        t[id(fn)] = cpu_time_it(fn)
    return t[id(ours)], t[id(ref)]


_SUB_CHILD = r"""
import sys, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.RCVHWM, 0)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
sub.recv_multipart()
print("ready", flush=True)
first, last = map(int, sys.stdin.readline().split())
seen = set()
while len(seen) < last - first + 1 and sub.poll(10000):
    seq = int.from_bytes(sub.recv_multipart()[1], "big")
    if first <= seq <= last:
        seen.add(seq)
print(len(seen), flush=True)
"""


class SubscriberProcess:
    """A ZMQ SUB socket in another process (as an advisor would be), connected to ``pub``:
    probe batches are published until it has one (ZMQ drops messages sent before the
    subscription reached the publisher); :meth:`count` then says how many of a range of
    seqs it received."""

    def __init__(self, pub: ZmqPublisher) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SUB_CHILD, pub.endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        # The subscriber stands in for an advisor, a separate service: it must not share
        # the benchmarked process's pinned core (it inherits `taskset -c 0`), where its
        # receive loop would take cache and time slices from the worker being measured.
        mine = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - mine
        if others:
            os.sched_setaffinity(self.proc.pid, others)
        probe = 1 << 62
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            pub.publish_valid([KVEvent(EventType.STORE, probe, probe, None, 1, "probe")])
            probe += 1
            pub.flush()
            if select.select([self.proc.stdout], [], [], 0.05)[0]:
                assert self.proc.stdout.readline().strip() == "ready"
                return
        self.proc.kill()
        raise RuntimeError(f"no subscriber connection to {pub.endpoint}")

    def count(self, first: int, last: int) -> int:
        """Batches with seq in ``[first, last]`` the subscriber received (waits for them)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{first} {last}\n")
        self.proc.stdin.flush()
        got = int(self.proc.stdout.readline())
        self.proc.wait(10)
        return got


def bench_pool(
    runs: int, n_requests: int, pool_blocks: int, match_rounds: int, req_blocks: int = REQ_BLOCKS
) -> dict[str, tuple[float, float, float]]:
    cfg = LayoutConfig(num_layers=1, outer_dim=1, page_size=16, inner_dim=8, dtype=torch.float16)
    keys = ("churn", "churn_null", "churn_zmq", "churn_single", "match", "match_single")
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in keys}

    def new_pool(sink: object) -> BlockPool:
        layout = make_layout("FullyContiguous", cfg, pool_blocks, torch.device("cpu"), MemoryKind.SYSTEM)
        return BlockPool("g2", layout, sink)  # type: ignore[arg-type]

    n_blocks = n_requests * req_blocks
    n_evict = max(0, n_blocks - pool_blocks)
    for run in range(runs):
        # identities are inputs, built outside the timed part, distinct for every pass
        def workload(tag: int) -> tuple[list[list[int]], list[list[BlockMeta]]]:
            base = ((run + 1) << 44) + (tag << 40)
            requests = [[base + r * req_blocks + k for k in range(req_blocks)] for r in range(n_requests)]
            return requests, [identities(h) for h in requests]

        # 1. batch calls, events handed to a list: the pool's own cost
        requests, metas = workload(1)
        sink = ListSink()
        pool = new_pool(sink)
        bare = BarePool(pool_blocks)
        t = _timed_pair(run, lambda: ours_churn(pool, metas), lambda: bare_churn(bare, requests))
        out["churn"].append((t[0] / n_blocks * 1e6, t[1] / n_blocks * 1e6))
        assert len(sink.events) == n_blocks + n_evict, len(sink.events)
        st = pool.stats()
        assert st.stores_published == n_blocks and st.removes_published == n_evict, st
        # matching a registered 16-block prefix (the last request is never evicted)
        prefix = requests[-1]
        probe, bare_probe = pool.match_blocks(prefix), bare.match(prefix)
        assert len(probe) == len(bare_probe) == req_blocks
        pool.release_blocks(probe)
        bare.release(bare_probe)
        n = match_rounds * req_blocks
        t = _timed_pair(run, lambda: ours_match(pool, prefix, match_rounds), lambda: bare_match(bare, prefix, match_rounds))
        out["match"].append((t[0] / n * 1e6, t[1] / n * 1e6))
        t = _timed_pair(
            run, lambda: ours_match_single(pool, prefix, match_rounds), lambda: bare_match_single(bare, prefix, match_rounds)
        )
        out["match_single"].append((t[0] / n * 1e6, t[1] / n * 1e6))

        # 2. the same batch calls through the event plane, as a worker publishes: the null
        #    publisher of ``null://`` (events off: the pool builds none, the publisher counts
        #    them, no batch) and the ZMQ publisher of ``zmq://`` bound to a local socket, with
        #    its replay socket and a subscriber connected (its sends are real TCP writes)
        for key, tag in (("churn_null", 2), ("churn_zmq", 4)):
            requests, metas = workload(tag)
            if key == "churn_null":
                pub = NullPublisher("bench-pool")
                sub = None
            else:
                pub = ZmqPublisher("bench-pool", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
                sub = SubscriberProcess(pub)
            pool = new_pool(pub)
            bare = BarePool(pool_blocks)
            st0 = pub.stats()  # the connection probes
            t = _timed_pair(run, lambda: (ours_churn(pool, metas), pub.flush()), lambda: bare_churn(bare, requests))
            out[key].append((t[0] / n_blocks * 1e6, t[1] / n_blocks * 1e6))
            st = pub.stats()
            assert st.events - st0.events == n_blocks + n_evict and st.dropped == 0, st
            if sub is None:
                assert st.batches == st0.batches, st  # events off: nothing batched
            if sub is not None:
                sent = st.batches - st0.batches
                assert sub.count(st0.batches, st.batches - 1) == sent, "the subscriber missed batches"
            pub.close()

        # 3. one-block calls
        requests, metas = workload(3)
        sink = ListSink()
        pool = new_pool(sink)
        bare = BarePool(pool_blocks)
        t = _timed_pair(run, lambda: ours_churn_single(pool, metas), lambda: bare_churn_single(bare, requests))
        out["churn_single"].append((t[0] / n_blocks * 1e6, t[1] / n_blocks * 1e6))
        assert len(sink.events) == n_blocks + n_evict
    return {k: _medians(v) for k, v in out.items()}


# ---------------------------------------------------------------------------- offload


def bench_offload(
    runs: int, total_mib: int, block_kib: int, workdir: Path, g12_rounds: int = 3,
    device: torch.device = torch.device("cpu"), storage: bool = True,
) -> dict[str, tuple[float, float, float]]:
    """Part 2 for one block size: G1 -> G2 offload and G2 -> G1 onboard (G1 on ``device``)
    against plain copies of the same bytes, and (``storage``) G2 -> G3; medians per key
    (see :func:`_medians`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    inner = 256
    page = 16
    layers = max(1, block_kib * 1024 // (2 * page * inner * 2))
    cfg = LayoutConfig(num_layers=layers, outer_dim=2, page_size=page, inner_dim=inner, dtype=torch.float16)
    bb = cfg.block_bytes
    n = max(1, total_mib * (1 << 20) // bb)
    # one extra block on each tier: a one-block offload before the timed one starts the
    # transfer manager's worker threads (a serving engine's manager is long-lived)
    g1 = BlockPool("g1", make_layout("FullyContiguous", cfg, n + 1, device, tier="g1"))
    g1.layout.storage.random_(0, 256)
    # the onboard's destination: n G1 blocks an engine owns (its KV cache), on the device
    g1_dst = make_layout("FullyContiguous", cfg, n, device, tier="g1")
    g1_dst.storage.zero_()
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in ("g1_g2", "g1_g2_cpu", "g2_g1", "g2_g1_cpu", "g2_g3", "g2_g3_put")}
    cuda = device.type == "cuda"

    def plain_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """The reference: one copy of the bytes (an asynchronous one + synchronize on CUDA)."""
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)

    def one_run(run: int) -> None:
        # every buffer of a run dies when this returns: freeing a previous run's G2 pool
        # (a 128 MiB munmap) must not land inside the next run's timed offload
        pub = NullPublisher("bench-offload")
        g2 = BlockPool("g2", make_layout("FullyContiguous", cfg, n + 1, tier="g2"), pub)
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
        warm_meta = BlockMeta(((run + 1) << 48) | (1 << 47), None, ((run + 1) << 48) | (1 << 47), SALT)
        handles = g1.register_blocks([mb.init_from(m) for mb, m in zip(g1.allocate(n + 1), [*metas, warm_meta])])
        warm_h = handles.pop()
        warm = tm.offload_to_host([HostOffloadItem(warm_meta, g1.layout, warm_h.block_id, warm_h.weak())]).result()
        tm.offload_to_storage([StorageOffloadItem(warm_meta, BlockKey("warm", warm_meta.sequence_hash), (warm.blocks[0],))]).result()
        tm.onboard_from_host(g2.upgrade_many(warm.blocks), g1_dst, [0]).result()
        items = [HostOffloadItem(m, g1.layout, h.block_id, h.weak()) for m, h in zip(metas, handles)]
        stride = g1.layout.block_stride
        assert stride == bb, (stride, bb)  # no padding: both sides move n * bb bytes
        src_bytes = g1.layout.storage[: n * stride]  # the n offloaded blocks (ids 0..n-1)
        # written once: no first-touch page faults (G2 is zeroed too); pinned like G2 on CUDA
        ref = torch.zeros(src_bytes.shape, dtype=src_bytes.dtype, pin_memory=cuda)
        first_ref = run % 2 == 1  # alternate which side goes first (G2 -> G3 below)
        # the copy is memory-bound and other processes' memory traffic moves it by tens of
        # per cent: the reference is timed right before and right after ours (mean of both)

        def g1_g2_sample() -> HostOffloadResult:
            """One G1 -> G2 offload of the n blocks between two reference copies: a wall-clock
            and a CPU-time sample (CPU time of the process: the caller's and the worker's
            threads; preemption by other processes does not count in it)."""
            w0, c0 = wall_cpu_it(lambda: plain_copy(ref, src_bytes))
            box: list[HostOffloadResult] = []
            w, c = wall_cpu_it(lambda: box.append(tm.offload_to_host(items, StepEvent.completed()).result()))
            assert box[0].copied == n, box[0]
            w1, c1 = wall_cpu_it(lambda: plain_copy(ref, src_bytes))
            res["g1_g2"].append((n * bb / w / 1e9, n * bb / ((w0 + w1) / 2) / 1e9))
            res["g1_g2_cpu"].append((n * bb / c / 1e9, n * bb / ((c0 + c1) / 2) / 1e9))
            return box[0]

        dst_bytes = g1_dst.storage[: n * stride]
        dst_ids = list(range(n))

        def g2_g1_sample(weaks: list) -> None:
            """One G2 -> G1 onboard of the n blocks (the G2 copies of ``weaks``, upgraded by
            the caller as a connector does, not timed) into the n destination blocks,
            between two reference copies of the same G2 bytes."""
            w0, c0 = wall_cpu_it(lambda: plain_copy(dst_bytes, g2_bytes))
            srcs = g2.upgrade_many(weaks)
            w, c = wall_cpu_it(lambda: tm.onboard_from_host(srcs, g1_dst, dst_ids).result())
            w1, c1 = wall_cpu_it(lambda: plain_copy(dst_bytes, g2_bytes))
            res["g2_g1"].append((n * bb / w / 1e9, n * bb / ((w0 + w1) / 2) / 1e9))
            res["g2_g1_cpu"].append((n * bb / c / 1e9, n * bb / ((c0 + c1) / 2) / 1e9))

        host = g1_g2_sample()
        g2_bytes = g2.layout.storage[stride : (n + 1) * stride]  # the n G2 copies (block 0: warm-up)
        g2_g1_sample(host.blocks)
        # G2 -> G3 through the transfer manager vs write+fsync of the same bytes, and vs the
        # storage agent alone on the same bytes (other keys): what the transfer manager adds
        sitems = [StorageOffloadItem(m, BlockKey("bench", m.sequence_hash), (w,)) for m, w in zip(metas, host.blocks)]
        assert g2.layout.block_stride == stride
        g2_handles = g2.upgrade_many([w for w in host.blocks if w is not None])
        g2_ids = [h.block_id for h in g2_handles]
        g2.release_blocks(g2_handles)
        assert g2_ids == list(range(1, n + 1))  # block 0 holds the warm-up block
        data = g2_bytes.numpy() if storage else None  # the same n blocks' bytes
        direct = [(BlockKey("direct", m.sequence_hash), g2.layout.storage[i * stride : i * stride + bb]) for i, m in zip(g2_ids, metas)]

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

        if not storage:
            pass
        elif first_ref:
            t_ref = time_it(plain_write)
            t_put = time_it(lambda: agent.put(direct, "nvme"))
        if storage:
            t0 = time.perf_counter()
            stored = tm.offload_to_storage(sitems, StepEvent.completed()).result()
            t_ours = time.perf_counter() - t0
            assert stored.written == n and stored.error is None
            if not first_ref:
                t_ref = time_it(plain_write)
                t_put = time_it(lambda: agent.put(direct, "nvme"))
            res["g2_g3"].append((n * bb / t_ours / 1e9, n * bb / t_ref / 1e9))
            res["g2_g3_put"].append((n * bb / t_ours / 1e9, n * bb / t_put / 1e9))
        # further G1 -> G2 rounds on the same (long-lived, warm) manager: the G2 copies are
        # evicted back to Reset and the same blocks offloaded again, each round between
        # two reference copies; every round is one sample
        for _ in range(g12_rounds - 1):
            g2.evict()
            g2_g1_sample(g1_g2_sample().blocks)
        for h in [*handles, warm_h]:
            h.release()
        g1.evict()
        tm.close()
        agent.close()
        pub.close()
        shutil.rmtree(vol_dir, ignore_errors=True)

    for run in range(runs):
        one_run(run)
        gc.collect()
    if os.environ.get("KVBENCH_SAMPLES"):
        print({k: [(round(a, 2), round(b, 2)) for a, b in v] for k, v in res.items()})
    return {k: _medians(v) for k, v in res.items() if v}


def print_pool(args: argparse.Namespace, runs: int, n_requests: int, report: Report) -> None:
    """Run and print part 1 (the pool) of the benchmark, and add its rows to ``report``."""
    pool_blocks = 2048 if args.quick else 8192
    rb = args.req_blocks
    n_requests = n_requests * REQ_BLOCKS // rb
    pool = bench_pool(runs, n_requests, pool_blocks, (2000 if not args.quick else 200) * REQ_BLOCKS // rb, rb)
    print(f"\n1. pool, per block (requests of {rb} blocks, {n_requests * rb} blocks through a {pool_blocks}-block pool)")
    print(f"{'operation':<40}{'ours µs':>10}{'bare µs':>10}{'ratio':>8}   goal <= 3x")
    for key, label, name in (
        ("churn", "allocate+register+release, batch", "allocate + register + release, batch calls"),
        ("churn_single", "  same, one-block calls", "allocate + register + release, one-block calls"),
        ("churn_null", "  batch, events via null:// publisher", "batch calls, events through null:// (off)"),
        ("churn_zmq", "  batch, events via zmq:// publisher", "batch calls, events through zmq://"),
        ("match", "match_blocks+release, batch", "match_blocks + release_blocks, batch"),
        ("match_single", "  same, release one by one", "match_blocks + release one by one"),
    ):
        ours, bare, ratio = pool[key]
        print(f"{label:<40}{ours:>10.2f}{bare:>10.2f}{ratio:>7.2f}x   {'met' if ratio <= 3 else 'NOT met'}")
        goal = key != "churn_single"  # one-block calls are shown, with no goal
        report.add(f"pool: {name}, requests of {rb} blocks", ours, bare, ratio=ratio, unit="µs/block",
                   reference_name="bare deque / dict / OrderedDict pool", goal="<= 3x" if goal else "",
                   met=ratio <= 3 if goal else None, better="lower", headline=key == "churn_zmq")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dir", default=None, help="directory for the G3 volume (default: a temp dir)")
    ap.add_argument("--offload-mib", type=int, default=128)
    ap.add_argument("--req-blocks", type=int, default=REQ_BLOCKS, help="blocks per request (per batch call)")
    ap.add_argument("--pool-only", action="store_true", help="skip the offload part")
    ap.add_argument("--offload-only", action="store_true", help="skip the pool part")
    ap.add_argument("--g12-rounds", type=int, default=3,
                    help="G1 -> G2 offloads per run (each between two reference copies; one sample each)")
    ap.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048],
                    help="block sizes (2048 KiB = a Llama-3-8B block of 16 tokens in fp16)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where G1 lives (cuda: cuda:0, G2 and the references pinned host memory)")
    ap.add_argument("--no-storage", action="store_true", help="skip the G2 -> G3 rows (G1 <-> G2 only)")
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("runtime", "block pool per block against a bare pool; G1 <-> G2 <-> G3 transfers against "
                    "plain copies and writes")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: no CUDA device here (torch {torch.__version__}, "
              f"cuda build {torch.version.cuda}); nothing measured")
        report.extra["device"] = "cuda requested, none available: nothing measured"
        report.write(args.json)
        return 0
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    runs = 1 if args.quick else args.runs
    n_requests = 500 if args.quick else 4000
    total = 32 if args.quick else args.offload_mib
    torch.set_num_threads(1)

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}, "
          f"medians of {runs} runs (ratio = median of the per-run ratios)")
    if not args.offload_only:
        print_pool(args, runs, n_requests, report)

    if args.pool_only:
        report.write(args.json)
        return 0
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvbench-rt-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        offs = {kib: bench_offload(runs, total, kib, base / f"b{kib}", args.g12_rounds, device, not args.no_storage)
                for kib in args.block_kib}
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    # goals: G1 <-> G2 >= 95 % of a plain copy on the CPU, >= 90 % on CUDA; G2 -> G3 >= 90 %
    g12_goal = 0.95 if device.type == "cpu" else 0.90
    print(f"\n2. offload / onboard throughput, G1 on {device}, {total} MiB per transfer (one batch); "
          f"G1 <-> G2: {runs * args.g12_rounds} samples ({args.g12_rounds} per run), G2 -> G3: {runs}")
    print(f"{'path':<34}{'block':>9}{'ours GB/s':>11}{'ref GB/s':>10}{'ratio':>8}   goal")
    for kib, off in offs.items():
        for key, label, goal in (
            ("g1_g2", "G1 -> G2 offload vs torch copy", g12_goal),
            ("g1_g2_cpu", "  same, CPU time (not wall)", None),
            ("g2_g1", "G2 -> G1 onboard vs torch copy", g12_goal),
            ("g2_g1_cpu", "  same, CPU time (not wall)", None),
            ("g2_g3", "G2 -> G3 vs write+fsync", 0.90),
            ("g2_g3_put", "  same, vs StorageAgent.put", None),
        ):
            if key not in off:
                continue
            ours, ref, ratio = off[key]
            # the goals are against plain copies / writes (wall clock); the CPU-time rows and
            # the direct put (what the transfer manager adds on top of StorageAgent.put) have none
            verdict = "(no goal)" if goal is None else (f">= {goal:.0%} " + ("met" if ratio >= goal else "NOT met"))
            print(f"{label:<34}{kib:>6} KiB{ours:>11.2f}{ref:>10.2f}{ratio:>7.0%}    {verdict}")
            first = kib == next(iter(offs)) and key == "g1_g2"
            if first:  # the offload row outranks the pool's as the headline
                for f in report.figures:
                    f.headline = False
            report.add(f"{label.strip()}, {kib} KiB blocks, G1 on {device}", ours, ref, ratio=ratio, unit="GB/s",
                       reference_name="plain copy / write + fsync / direct put of the same bytes",
                       goal="" if goal is None else f">= {goal:.0%}", met=None if goal is None else ratio >= goal,
                       headline=first)
    report.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
