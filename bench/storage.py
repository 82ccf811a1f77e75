#!/usr/bin/env python
"""Storage benchmark: our agent (NIXL POSIX / NIXL OBJ) against plain I/O of the same bytes.

    python bench/storage.py                 # full run (about 70 s on 2 cores)
    python bench/storage.py --quick         # smaller totals and 1 run, a smoke check
    python bench/storage.py --dir /mnt/nvme/kvbench --runs 5
    taskset -c 0 python bench/storage.py    # pinned to one core (earlier rounds, docs/benchmarks-history.md)
    python bench/storage.py --ab-old /tmp/old   # gets of another storage_backends, A/B

For block sizes 64 KiB, 1 MiB and 16 MiB it prints put and get GB/s, median of ``--runs``
runs, side by side with a plain baseline on the same bytes, and the ratio (the median of
the per-run ratios: ours and the baseline run back to back, under the same load).  POSIX
reads are timed twice per run, interleaved, keeping the best of each kind:

* POSIX, same directory: ``StorageAgent.put`` (XXH3 per block, packed into 64 MiB
  segment files, one NIXL POSIX WRITE each, fsync of file and directory, SQLite catalog
  commit) against a plain sequential ``writev`` of the same bytes into files of the same
  size, each fsync-ed, directory fsync-ed (the same durability: data and names on disk
  before returning).  ``StorageAgent.get(out=...)`` (catalog lookup; what the page
  cache holds copied by ``preadv2(RWF_NOWAIT)`` in 1 MiB groups, each hashed at once,
  the rest by NIXL READs of 4 MiB pieces, straight into the caller's tensors; XXH3 check
  of every block) against a plain
  ``readv`` of the same files into the same tensors (one call per 64 MiB file), twice:
  hot (page cache, the files were just written) and cold (both file sets evicted with
  ``POSIX_FADV_DONTNEED`` first, so the bytes come from the disk).  Goal: ours >= 80 %
  of plain.  A third column, the floor, is the faster of two plain *verified* reads
  (``readv`` then XXH3 of every block; or ``preadv`` of 1 MiB pieces, each hashed at
  once): what verifying every block costs without NIXL, a catalog or Python per block.
  Hot gets of ours are page-cache copies (no NIXL), cold gets mostly NIXL reads.
* S3, same endpoint (a ``moto_server`` the script starts on loopback): ``put`` into 16 MiB
  segment objects through NIXL OBJ (up to 8 segment PUTs at once in one NIXL WRITE, no
  HEAD after them) against boto3
  ``put_object`` of the same bytes (prepared as ``bytes`` outside the timed part), (a) one
  object per block, what a per-block offloader does (timed in the first run only: slow
  and steady), (b) packed into objects of the same 16 MiB as ours, one after the other,
  and (c) those objects by 4 threads.  ``get``
  (one NIXL READ per 64 MiB batch: a ranged GET per segment, up to 8 at once; XXH3
  check) against boto3 ``get_object(...).read()`` of the same objects, the same three
  ways.  ``get(keys, out=...)`` copies each verified block out of a staging buffer into
  the caller's tensors (blocks under 4 MiB; larger ones are read straight into them);
  ``get(keys)`` (column "new") returns new tensors, as boto3's ``read()`` returns new
  bytes (blocks under 4 MiB: views of one new buffer per read, no copy out).  Each get
  is timed ``S3_GET_TRIES`` times per run, interleaved with boto3's, keeping the best of
  each kind (puts once: each makes new objects).  moto keeps objects in memory and costs
  ~9 ms per request, so totals are smaller there (``--s3-mib``, 64 MiB: four segment
  objects); 64 KiB blocks are also run with 16 MiB, one object each way, where each
  figure is a single moto request (closer to a latency than to a throughput).  Goal:
  ours >= 100 % of boto3.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from bench._report import Report, add_json_option  # noqa: E402

from storage_backends import (  # noqa: E402
    BlockKey,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
    start_local_s3,
)

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 16 * MiB]
POSIX_SEGMENT = 64 * MiB
S3_SEGMENT = 16 * MiB
S3_GET_TRIES = 3  # S3 gets timed per run, interleaved, best kept
BOTO_THREADS = 4  # boto3/seg x4: the same objects fetched by 4 threads (ours: up to 8 GETs at once)


def fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def groups(n_blocks: int, block: int, segment: int) -> list[range]:
    """Block indexes per segment, as ``StorageAgent`` packs them (fill up to ``segment``)."""
    per = max(1, segment // block)
    return [range(i, min(i + per, n_blocks)) for i in range(0, n_blocks, per)]


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- POSIX
def plain_write(d: Path, blocks: list[np.ndarray], segs: list[range]) -> list[Path]:
    paths = []
    for j, g in enumerate(segs):
        p = d / f"plain-{j:06d}"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            bufs = [blocks[i] for i in g]
            want = sum(b.nbytes for b in bufs)
            done = 0
            while done < want:  # writev, resuming after a short write
                n = os.writev(fd, bufs)
                done += n
                while bufs and n >= bufs[0].nbytes:
                    n -= bufs[0].nbytes
                    bufs = bufs[1:]
                if bufs and n:
                    bufs[0] = bufs[0][n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        paths.append(p)
    fsync_dir(d)
    return paths


def plain_read(paths: list[Path], outs: list[np.ndarray], segs: list[range]) -> None:
    for p, g in zip(paths, segs):
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = os.readv(fd, [outs[i] for i in g])
            if got != sum(outs[i].nbytes for i in g):
                raise OSError(f"short read of {p}")
        finally:
            os.close(fd)


def plain_read_xxh3(paths: list[Path], outs: list[np.ndarray], segs: list[range]) -> None:
    """A plain verified read: :func:`plain_read`, then XXH3-64 of every block (what ``get``
    must do on top of moving the bytes)."""
    plain_read(paths, outs, segs)
    for o in outs:
        xxhash.xxh3_64_intdigest(o)


def plain_read_xxh3_pieces(paths: list[Path], outs: list[np.ndarray], segs: list[range], piece: int = MiB) -> None:
    """The other plain verified read: ``preadv`` of at most ``piece`` bytes at a time, each
    hashed right away while it is in the CPU cache (what ``get`` does, with plain
    syscalls; a block larger than ``piece`` is read and hashed in ``piece`` chunks)."""
    for p, g in zip(paths, segs):
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pos, i, idx = 0, 0, list(g)
            while i < len(idx):
                first = outs[idx[i]]
                if first.nbytes > piece:
                    h = xxhash.xxh3_64()
                    for c in range(0, first.nbytes, piece):
                        view = first[c : c + piece]
                        if os.preadv(fd, [view], pos + c) != view.nbytes:
                            raise OSError(f"short read of {p}")
                        h.update(view)
                    h.intdigest()
                    pos, i = pos + first.nbytes, i + 1
                    continue
                bufs, size = [], 0
                while i < len(idx) and size + outs[idx[i]].nbytes <= piece:
                    bufs.append(outs[idx[i]])
                    size += outs[idx[i]].nbytes
                    i += 1
                if os.preadv(fd, bufs, pos) != size:
                    raise OSError(f"short read of {p}")
                for b in bufs:
                    xxhash.xxh3_64_intdigest(b)
                pos += size
        finally:
            os.close(fd)


def drop_cache(paths: list[Path]) -> None:
    """Evict these (fsync-ed, clean) files from the page cache: POSIX_FADV_DONTNEED."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_posix(base: Path, block: int, total: int, runs: int) -> dict[str, list[float]]:
    n = total // block
    data = torch.randint(0, 256, (n * block,), dtype=torch.uint8)
    blocks_t = [data[i * block:(i + 1) * block] for i in range(n)]
    blocks_np = [b.numpy() for b in blocks_t]
    outs_t = [torch.empty(block, dtype=torch.uint8) for _ in range(n)]
    outs_np = [o.numpy() for o in outs_t]
    segs = groups(n, block, POSIX_SEGMENT)
    vol_dir = base / "vol"
    plain_dir = vol_dir / "plain"
    plain_dir.mkdir(parents=True, exist_ok=True)
    cat = SqliteCatalog(base / "catalog.sqlite")
    res: dict[str, list[float]] = {k: [] for k in ("ours_put", "plain_put", "ours_get", "plain_get", "floor_get",
                                                   "ours_cold", "plain_cold", "floor_cold")}
    with StorageAgent(cat, name=f"bench-posix-{block}") as agent:
        agent.register_volume(VolumeDescriptor("bench", VolumeKind.POSIX, MediaClass.NVME, 1 << 40,
                                               root=str(vol_dir), segment_bytes=POSIX_SEGMENT))
        for r in range(runs + 1):  # run 0 warms up (NIXL registrations, staging buffer)
            ns = f"bench-{uuid.uuid4().hex}"  # one model fingerprint per run, as in serving
            keys = [BlockKey(ns, i) for i in range(n)]
            t_put = timed(lambda: agent.put(list(zip(keys, blocks_t)), "bench"))
            paths: list[Path] = []
            t_plain_put = timed(lambda: paths.extend(plain_write(plain_dir, blocks_np, segs)))
            ours_files = sorted((vol_dir / "bench").glob("seg-*"))
            # Each read is timed twice, interleaved, and its best time kept (the floor:
            # best of its two ways), so that every column gets the same two chances at a
            # quiet moment of the shared machine.
            hot: dict[str, list[float]] = {k: [] for k in ("ours", "plain", "floor")}
            cold: dict[str, list[float]] = {k: [] for k in ("ours", "plain", "floor")}
            for i in range(2):
                hot["ours"].append(timed(lambda: agent.get(keys, out=outs_t)))
                if not all(torch.equal(o, b) for o, b in zip(outs_t[:: max(1, n // 16)], blocks_t[:: max(1, n // 16)])):
                    raise AssertionError("our get returned wrong bytes")
                hot["plain"].append(timed(lambda: plain_read(paths, outs_np, segs)))
                floor = plain_read_xxh3 if i == 0 else plain_read_xxh3_pieces
                hot["floor"].append(timed(lambda: floor(paths, outs_np, segs)))
            for i in range(2):
                for kind, fn in (("ours", lambda: agent.get(keys, out=outs_t)),
                                 ("plain", lambda: plain_read(paths, outs_np, segs)),
                                 ("floor", lambda: (plain_read_xxh3 if i == 0 else plain_read_xxh3_pieces)(
                                     paths, outs_np, segs))):
                    drop_cache(ours_files + paths)
                    cold[kind].append(timed(fn))
            t_get, t_plain_get, t_floor_get = (min(hot[k]) for k in ("ours", "plain", "floor"))
            t_cold, t_plain_cold, t_floor_cold = (min(cold[k]) for k in ("ours", "plain", "floor"))
            agent.delete(keys)
            for p in paths:
                p.unlink()
            if r:
                for k, t in (("ours_put", t_put), ("plain_put", t_plain_put), ("ours_get", t_get),
                             ("plain_get", t_plain_get), ("floor_get", t_floor_get), ("ours_cold", t_cold),
                             ("plain_cold", t_plain_cold), ("floor_cold", t_floor_cold)):
                    res[k].append(total / t / 1e9)
    cat.close()
    return res


# ---------------------------------------------------------------------------- S3
def bench_s3(base: Path, s3: object, block: int, total: int, runs: int, per_block_baseline: bool) -> dict[str, list[float]]:
    import boto3
    from botocore.config import Config

    n = total // block
    data = torch.randint(0, 256, (n * block,), dtype=torch.uint8)
    blocks_t = [data[i * block:(i + 1) * block] for i in range(n)]
    outs_t = [torch.empty(block, dtype=torch.uint8) for _ in range(n)]
    segs = groups(n, block, S3_SEGMENT)
    # boto3 wants bytes: prepared once, outside the timed part (in boto3's favour)
    block_bodies = [b.numpy().tobytes() for b in blocks_t]
    seg_bodies = [b"".join(block_bodies[i] for i in g) for g in segs]
    bucket = f"kvbench-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,  # type: ignore[attr-defined]
                          aws_secret_access_key=s3.secret_key, region_name="us-east-1",  # type: ignore[attr-defined]
                          config=Config(s3={"addressing_style": "path"}))
    cat = SqliteCatalog(base / f"catalog-s3-{block}-{total}.sqlite")
    res: dict[str, list[float]] = {k: [] for k in ("ours_put", "boto_put_block", "boto_put_seg", "boto_put_mt",
                                                   "ours_get", "ours_get_new", "boto_get_block", "boto_get_seg",
                                                   "boto_get_mt")}
    pool = ThreadPoolExecutor(BOTO_THREADS)
    with StorageAgent(cat, name=f"bench-s3-{block}") as agent:
        agent.register_volume(VolumeDescriptor(
            "obj", VolumeKind.S3, MediaClass.OBJECT, 1 << 40, endpoint=s3.endpoint, bucket=bucket,  # type: ignore[attr-defined]
            prefix="bench", segment_bytes=S3_SEGMENT, access_key=s3.access_key, secret_key=s3.secret_key))  # type: ignore[attr-defined]
        for r in range(runs + 1):
            ns = f"bench-{uuid.uuid4().hex}"
            keys = [BlockKey(ns, i) for i in range(n)]
            t_put = timed(lambda: agent.put(list(zip(keys, blocks_t)), "obj"))

            def boto_put_blocks() -> None:
                for i, body in enumerate(block_bodies):
                    client.put_object(Bucket=bucket, Key=f"plain/{r}/b{i}", Body=body)

            def boto_put_segs() -> None:
                for j, body in enumerate(seg_bodies):
                    client.put_object(Bucket=bucket, Key=f"plain/{r}/s{j}", Body=body)

            def boto_put_segs_mt() -> None:
                list(pool.map(lambda j: client.put_object(Bucket=bucket, Key=f"plain/{r}/m{j}", Body=seg_bodies[j]),
                              range(len(seg_bodies))))

            def boto_get_segs_mt() -> None:
                list(pool.map(lambda j: client.get_object(Bucket=bucket, Key=f"plain/{r}/m{j}")["Body"].read(),
                              range(len(seg_bodies))))

            def boto_get_blocks() -> None:
                for i in range(n):
                    client.get_object(Bucket=bucket, Key=f"plain/{r}/b{i}")["Body"].read()

            def boto_get_segs() -> None:
                for j in range(len(segs)):
                    client.get_object(Bucket=bucket, Key=f"plain/{r}/s{j}")["Body"].read()

            blk = per_block_baseline and r == 1  # slow and steady (one request per block): one timed run
            t_bpb = timed(boto_put_blocks) if blk else float("nan")
            t_bps = timed(boto_put_segs)
            t_bpm = timed(boto_put_segs_mt)
            got: list[torch.Tensor] = []
            # gets are timed S3_GET_TRIES times, interleaved, each kind keeping its best (a
            # request to moto swings by +-30 % from one to the next; the same chances for all)
            gets: dict[str, list[float]] = {k: [] for k in ("out", "new", "seg", "mt")}
            for _ in range(S3_GET_TRIES):
                gets["out"].append(timed(lambda: agent.get(keys, out=outs_t)))
                gets["new"].append(timed(lambda: got.extend(agent.get(keys))))
                for res_t in (got, outs_t):
                    if not all(torch.equal(o, b) for o, b in zip(res_t[:: max(1, n // 16)], blocks_t[:: max(1, n // 16)])):
                        raise AssertionError("our S3 get returned wrong bytes")
                got.clear()
                gets["seg"].append(timed(boto_get_segs))
                gets["mt"].append(timed(boto_get_segs_mt))
            t_get_out, t_get, t_bgs, t_bgm = (min(gets[k]) for k in ("out", "new", "seg", "mt"))
            t_bgb = timed(boto_get_blocks) if blk else float("nan")
            agent.delete(keys)
            for key in [f"plain/{r}/b{i}" for i in range(n)] if blk else []:
                client.delete_object(Bucket=bucket, Key=key)
            for j in range(len(segs)):
                client.delete_object(Bucket=bucket, Key=f"plain/{r}/s{j}")
                client.delete_object(Bucket=bucket, Key=f"plain/{r}/m{j}")
            if r:
                for k, t in (("ours_put", t_put), ("boto_put_block", t_bpb), ("boto_put_seg", t_bps),
                             ("boto_put_mt", t_bpm), ("ours_get", t_get_out), ("ours_get_new", t_get),
                             ("boto_get_block", t_bgb),
                             ("boto_get_seg", t_bgs), ("boto_get_mt", t_bgm)):
                    if t == t:  # not NaN
                        res[k].append(total / t / 1e9)
    pool.shutdown()
    cat.close()
    return res


# ---------------------------------------------------------------------------- A/B
def load_other(tree: Path) -> object:
    """Import ``tree/storage_backends`` as the module ``storage_backends_ab_other`` (its
    imports are relative), beside the ``storage_backends`` of this tree."""
    pkg = tree / "storage_backends"
    spec = importlib.util.spec_from_file_location(
        "storage_backends_ab_other", pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"no storage_backends package under {tree}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def ab_agents(base: Path, versions: dict[str, object], block: int, n: int, blocks_t: list[torch.Tensor],
              volume: Callable[[object, str], object]) -> dict[str, tuple[object, list[object]]]:
    """Per version: an agent on its own SQLite catalog with volume ``volume(module, name)``,
    holding the ``n`` blocks under a fresh namespace."""
    out = {}
    for name, m in versions.items():
        cat = m.SqliteCatalog(base / f"ab-{name}-{block}.sqlite")  # type: ignore[attr-defined]
        agent = m.StorageAgent(cat, name=f"ab-{name}-{block}")  # type: ignore[attr-defined]
        desc = volume(m, name)
        agent.register_volume(desc)
        keys = [m.BlockKey(f"ab-{uuid.uuid4().hex}", i) for i in range(n)]  # type: ignore[attr-defined]
        agent.put(list(zip(keys, blocks_t)), desc.id)  # type: ignore[attr-defined]
        out[name] = (agent, keys)
    return out


def ab_rounds(agents: dict[str, tuple[object, list[object]]], outs_t: list[torch.Tensor], ref: Callable[[], object],
              runs: int) -> dict[str, list[float]]:
    """Time ``get(keys, out=outs_t)`` of each version and ``ref()`` per round, the two
    versions in alternating order (round 0 warms up, not kept)."""
    res: dict[str, list[float]] = {k: [] for k in (*agents, "ref")}
    names = list(agents)
    for r in range(runs + 1):
        for name in names if r % 2 else names[::-1]:
            agent, keys = agents[name]
            t = timed(lambda: agent.get(keys, out=outs_t))  # type: ignore[attr-defined]  # noqa: B023
            if r:
                res[name].append(t)
        t = timed(ref)
        if r:
            res["ref"].append(t)
    return res


def ab_line(what: str, res: dict[str, list[float]], ref_name: str) -> str:
    ms = {k: med(v) * 1e3 for k, v in res.items()}
    return (f"{what:>24} | new {ms['new']:7.1f} ms  other {ms['other']:7.1f} ms  {ref_name} {ms['ref']:7.1f} ms | "
            f"new/other time {med([a / b for a, b in zip(res['new'], res['other'])]):.2f} | of {ref_name}: "
            f"other {ratio(res, 'ref', 'other'):.0%}  new {ratio(res, 'ref', 'new'):.0%}")


def bench_ab(base: Path, other_tree: Path, runs: int, posix_mib: int, s3: bool) -> None:
    """Gets of this tree's ``storage_backends`` ("new") and of ``other_tree``'s ("other")
    in one process, interleaved, against the plain reference of the same run: hot POSIX
    gets (``readv``) at every block size, and S3 gets of 64 KiB blocks (one 16 MiB
    segment object; boto3 ``get_object`` of an object of the same bytes)."""
    import storage_backends as new_mod

    versions = {"new": new_mod, "other": load_other(other_tree)}
    print(f"\n## A/B: gets of this tree (new) and of {other_tree} (other), one process, {runs} rounds, "
          "alternating order; medians; 'of ...' = median per-round ratio reference/ours")
    for block in SIZES:
        n = posix_mib * MiB // block
        data = torch.randint(0, 256, (n * block,), dtype=torch.uint8)
        blocks_t = [data[i * block:(i + 1) * block] for i in range(n)]
        outs_t = [torch.empty(block, dtype=torch.uint8) for _ in range(n)]
        outs_np = [o.numpy() for o in outs_t]
        segs = groups(n, block, POSIX_SEGMENT)
        d = base / f"ab-posix-{block}"
        (d / "plain").mkdir(parents=True)
        paths = plain_write(d / "plain", [b.numpy() for b in blocks_t], segs)
        agents = ab_agents(d, versions, block, n, blocks_t, lambda m, name: m.VolumeDescriptor(  # type: ignore[attr-defined]
            "ab", m.VolumeKind.POSIX, m.MediaClass.NVME, 1 << 40, root=str(d / name),  # type: ignore[attr-defined]
            segment_bytes=POSIX_SEGMENT))
        res = ab_rounds(agents, outs_t, lambda: plain_read(paths, outs_np, segs), runs)
        if not all(torch.equal(o, b) for o, b in zip(outs_t, blocks_t)):
            raise AssertionError("A/B get returned wrong bytes")
        print(ab_line(f"POSIX hot {fmt_size(block)} x {n}", res, "readv"), flush=True)
        for agent, _ in agents.values():
            agent.close()  # type: ignore[attr-defined]
        shutil.rmtree(d, ignore_errors=True)
    if not s3:
        return
    import boto3
    from botocore.config import Config

    srv = start_local_s3()
    try:
        block, n = 64 * KiB, 16 * MiB // (64 * KiB)
        data = torch.randint(0, 256, (n * block,), dtype=torch.uint8)
        blocks_t = [data[i * block:(i + 1) * block] for i in range(n)]
        outs_t = [torch.empty(block, dtype=torch.uint8) for _ in range(n)]
        bucket = f"kvbench-ab-{uuid.uuid4().hex[:12]}"
        agents = ab_agents(base, versions, block, n, blocks_t, lambda m, name: m.VolumeDescriptor(  # type: ignore[attr-defined]
            "obj", m.VolumeKind.S3, m.MediaClass.OBJECT, 1 << 40, endpoint=srv.endpoint, bucket=bucket,  # type: ignore[attr-defined]
            prefix=name, segment_bytes=S3_SEGMENT, access_key=srv.access_key, secret_key=srv.secret_key))
        client = boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=srv.access_key,
                              aws_secret_access_key=srv.secret_key, region_name="us-east-1",
                              config=Config(s3={"addressing_style": "path"}))
        client.put_object(Bucket=bucket, Key="plain", Body=data.numpy().tobytes())
        res = ab_rounds(agents, outs_t, lambda: client.get_object(Bucket=bucket, Key="plain")["Body"].read(),
                        2 * runs)
        if not all(torch.equal(o, b) for o, b in zip(outs_t, blocks_t)):
            raise AssertionError("A/B S3 get returned wrong bytes")
        print(ab_line(f"S3 {fmt_size(block)} x {n}", res, "boto3"), flush=True)
        for agent, _ in agents.values():
            agent.close()  # type: ignore[attr-defined]
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- report
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(r: dict[str, list[float]], ours: str, ref: str) -> float:
    """Median over runs of ours / reference, each pair measured back to back in one run
    (steadier than a ratio of medians on a shared machine)."""
    return med([a / b for a, b in zip(r[ours], r[ref])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None,
                    help="directory for the POSIX volume and the plain files (default: a temp dir under .kvadvisor/)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per figure (median reported), after one warm-up")
    ap.add_argument("--posix-mib", type=int, default=256, help="MiB written per block size and run, POSIX")
    ap.add_argument("--s3-mib", type=int, default=64, help="MiB written per block size and run, S3 (64 KiB blocks also with 16 MiB: one object)")
    ap.add_argument("--quick", action="store_true", help="1 run, small totals")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 part")
    ap.add_argument("--no-posix", action="store_true", help="skip the POSIX part")
    ap.add_argument("--ab-old", type=Path, default=None, metavar="TREE",
                    help="instead of the tables: gets of this tree's storage_backends and of TREE/storage_backends "
                         "(e.g. a `git archive` of an older commit) in one process, interleaved (--runs rounds)")
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("storage", "storage agent puts and verified gets (NIXL POSIX, NIXL OBJ on S3) against plain "
                    "writev+fsync / readv and boto3")
    if args.quick:
        args.runs, args.posix_mib, args.s3_mib = 1, 64, 32
    parent = args.dir or (ROOT / ".kvadvisor")
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=parent))
    print(f"# storage bench: {args.runs} run(s) per figure (median), dir {base}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    t_start = time.perf_counter()
    try:
        if args.ab_old is not None:
            bench_ab(base, args.ab_old.resolve(), args.runs, args.posix_mib, not args.no_s3)
            report.extra["ab_old"] = str(args.ab_old)
            report.write(args.json)
            return
        print("\n## POSIX (NIXL POSIX, 64 MiB segments) vs plain writev+fsync / readv, same directory; goal >= 80 %")
        print("   hot = page cache (just written); cold = after POSIX_FADV_DONTNEED of both file sets;")
        print("   floor = the faster plain verified read: readv then XXH3-64 of every block, or preadv of 1 MiB")
        print("   pieces each hashed at once (the same bytes and work as ours, with plain syscalls)")
        print(f"{'block':>7} {'MiB':>5} | {'ours put':>8} {'plain':>7} {'ratio':>6} | {'ours hot':>8} {'plain':>7} "
              f"{'ratio':>6} {'floor':>7} {'/floor':>6} | {'ours cold':>9} {'plain':>7} {'ratio':>6} {'floor':>7} "
              f"{'/floor':>6}   (GB/s)")
        for block in [] if args.no_posix else SIZES:
            r = bench_posix(base / f"posix-{block}", block, args.posix_mib * MiB, args.runs)
            op, pp, og, pg, fg, oc, pc, fc = (med(r[k]) for k in (
                "ours_put", "plain_put", "ours_get", "plain_get", "floor_get", "ours_cold", "plain_cold", "floor_cold"))
            print(f"{fmt_size(block):>7} {args.posix_mib:>5} | {op:8.3f} {pp:7.3f} {ratio(r, 'ours_put', 'plain_put'):6.0%} | "
                  f"{og:8.3f} {pg:7.3f} {ratio(r, 'ours_get', 'plain_get'):6.0%} {fg:7.3f} "
                  f"{ratio(r, 'ours_get', 'floor_get'):6.0%} | {oc:9.3f} {pc:7.3f} {ratio(r, 'ours_cold', 'plain_cold'):6.0%} "
                  f"{fc:7.3f} {ratio(r, 'ours_cold', 'floor_cold'):6.0%}", flush=True)
            for kind, ours_k, plain_k, plain_name in (("put", "ours_put", "plain_put", "writev + fsync"),
                                                      ("hot get", "ours_get", "plain_get", "readv (page cache)"),
                                                      ("cold get", "ours_cold", "plain_cold", "readv (from disk)")):
                q = ratio(r, ours_k, plain_k)
                report.add(f"POSIX {kind}, {fmt_size(block)} blocks", med(r[ours_k]), med(r[plain_k]), ratio=q,
                           unit="GB/s", reference_name=f"plain {plain_name} of the same bytes", goal=">= 80 %",
                           met=q >= 0.8, headline=kind == "hot get" and block == SIZES[0])
        if not args.no_s3:
            s3 = start_local_s3()
            try:
                print("\n## S3 (NIXL OBJ, 16 MiB segment objects) vs boto3 on the same moto_server; goal >= 100 %")
                print("   boto3/blk = one object per block; boto3/seg = the same 16 MiB objects as ours, one after the")
                print(f"   other; x{BOTO_THREADS} = those objects by {BOTO_THREADS} threads")
                print("   ours get = get(keys, out=tensors), into the caller's tensors; new = get(keys), new tensors")
                print("   (as boto3's read() returns new bytes), its ratio to boto3/seg")
                print(f"{'block':>7} {'MiB':>5} | {'ours put':>8} {'blk':>6} {'ratio':>6} {'seg':>6} {'ratio':>6} "
                      f"{f'x{BOTO_THREADS}':>6} {'ratio':>6} | {'ours get':>8} {'blk':>6} {'ratio':>6} {'seg':>6} "
                      f"{'ratio':>6} {f'x{BOTO_THREADS}':>6} {'ratio':>6} | {'new':>6} {'ratio':>6}   (GB/s)")
                # 64 KiB twice: one 16 MiB object (a single moto request each way: latency
                # more than throughput), then the same total as the other sizes
                for block, total_mib in [(64 * KiB, 16)] + [(b, args.s3_mib) for b in SIZES]:
                    r = bench_s3(base, s3, block, total_mib * MiB, args.runs, per_block_baseline=True)
                    cols = [f"{fmt_size(block):>7} {total_mib:>5} |"]
                    for op in ("put", "get"):
                        cols.append(f"{med(r[f'ours_{op}']):8.3f}")
                        for ref in ("block", "seg", "mt"):
                            cols.append(f"{med(r[f'boto_{op}_{ref}']):6.3f} {ratio(r, f'ours_{op}', f'boto_{op}_{ref}'):6.0%}")
                        cols.append("|")
                    cols.append(f"{med(r['ours_get_new']):6.3f} {ratio(r, 'ours_get_new', 'boto_get_seg'):6.0%}")
                    print(" ".join(cols), flush=True)
                    for op in ("put", "get"):
                        q = ratio(r, f"ours_{op}", f"boto_{op}_seg")
                        report.add(f"S3 {op}, {fmt_size(block)} blocks, {total_mib} MiB", med(r[f"ours_{op}"]),
                                   med(r[f"boto_{op}_seg"]), ratio=q, unit="GB/s",
                                   reference_name="boto3 on the same 16 MiB objects, one after the other",
                                   goal=">= 100 %", met=q >= 1.0)
            finally:
                s3.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n# total {time.perf_counter() - t_start:.0f} s")
    report.write(args.json)


if __name__ == "__main__":
    main()
