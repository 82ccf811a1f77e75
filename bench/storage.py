#!/usr/bin/env python
"""Storage benchmark: our agent (NIXL POSIX / NIXL OBJ) against plain I/O of the same bytes.

    python bench/storage.py                 # full run (about 2 minutes on 2 cores)
    python bench/storage.py --quick         # smaller totals and 1 run, a smoke check
    python bench/storage.py --dir /mnt/nvme/kvbench --runs 5

For block sizes 64 KiB, 1 MiB and 16 MiB it prints put and get GB/s, median of ``--runs``
runs, side by side with a plain baseline on the same bytes, and the ratio:

* POSIX, same directory: ``StorageAgent.put`` (XXH3 per block, packed into 64 MiB
  segment files, one NIXL POSIX WRITE each, fsync of file and directory, SQLite catalog
  commit) against a plain sequential ``writev`` of the same bytes into files of the same
  size, each fsync-ed, directory fsync-ed (the same durability: data and names on disk
  before returning).  ``StorageAgent.get(out=...)`` (one NIXL READ per 64 MiB batch, XXH3
  check of every block, copy into the caller's tensors) against a plain ``readv`` of the
  same files into the same tensors, twice: hot (page cache, the files were just written)
  and cold (both file sets evicted with ``POSIX_FADV_DONTNEED`` first, so the bytes come
  from the disk).  Goal: ours >= 80 % of plain.
* S3, same endpoint (a ``moto_server`` the script starts on loopback): ``put`` into 16 MiB
  segment objects through NIXL OBJ (+ a HEAD to check the length) against boto3
  ``put_object`` of the same bytes (prepared as ``bytes`` outside the timed part), (a) one
  object per block, what a per-block offloader does, and (b) packed into objects of the
  same 16 MiB as ours.  ``get`` (coalesced ranged
  GETs through NIXL OBJ, XXH3 check) against boto3 ``get_object(...).read()`` of the same
  objects.  moto keeps objects in memory and costs ~9 ms per request, so totals are
  smaller there.  Goal: ours >= 100 % of boto3.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402
import torch  # noqa: E402

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
    res: dict[str, list[float]] = {k: [] for k in ("ours_put", "plain_put", "ours_get", "plain_get",
                                                   "ours_cold", "plain_cold")}
    with StorageAgent(cat, name=f"bench-posix-{block}") as agent:
        agent.register_volume(VolumeDescriptor("bench", VolumeKind.POSIX, MediaClass.NVME, 1 << 40,
                                               root=str(vol_dir), segment_bytes=POSIX_SEGMENT))
        for r in range(runs + 1):  # run 0 warms up (NIXL registrations, staging buffer)
            keys = [BlockKey(f"bench-{uuid.uuid4().hex}", i) for i in range(n)]
            t_put = timed(lambda: agent.put(list(zip(keys, blocks_t)), "bench"))
            paths: list[Path] = []
            t_plain_put = timed(lambda: paths.extend(plain_write(plain_dir, blocks_np, segs)))
            t_get = timed(lambda: agent.get(keys, out=outs_t))
            if not all(torch.equal(o, b) for o, b in zip(outs_t[:: max(1, n // 16)], blocks_t[:: max(1, n // 16)])):
                raise AssertionError("our get returned wrong bytes")
            t_plain_get = timed(lambda: plain_read(paths, outs_np, segs))
            ours_files = sorted((vol_dir / "bench").glob("seg-*"))
            drop_cache(ours_files + paths)
            t_cold = timed(lambda: agent.get(keys, out=outs_t))
            drop_cache(ours_files + paths)
            t_plain_cold = timed(lambda: plain_read(paths, outs_np, segs))
            agent.delete(keys)
            for p in paths:
                p.unlink()
            if r:
                for k, t in (("ours_put", t_put), ("plain_put", t_plain_put), ("ours_get", t_get),
                             ("plain_get", t_plain_get), ("ours_cold", t_cold), ("plain_cold", t_plain_cold)):
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
    cat = SqliteCatalog(base / f"catalog-s3-{block}.sqlite")
    res: dict[str, list[float]] = {k: [] for k in ("ours_put", "boto_put_block", "boto_put_seg",
                                                   "ours_get", "boto_get_block", "boto_get_seg")}
    with StorageAgent(cat, name=f"bench-s3-{block}") as agent:
        agent.register_volume(VolumeDescriptor(
            "obj", VolumeKind.S3, MediaClass.OBJECT, 1 << 40, endpoint=s3.endpoint, bucket=bucket,  # type: ignore[attr-defined]
            prefix="bench", segment_bytes=S3_SEGMENT, access_key=s3.access_key, secret_key=s3.secret_key))  # type: ignore[attr-defined]
        for r in range(runs + 1):
            keys = [BlockKey(f"bench-{uuid.uuid4().hex}", i) for i in range(n)]
            t_put = timed(lambda: agent.put(list(zip(keys, blocks_t)), "obj"))

            def boto_put_blocks() -> None:
                for i, body in enumerate(block_bodies):
                    client.put_object(Bucket=bucket, Key=f"plain/{r}/b{i}", Body=body)

            def boto_put_segs() -> None:
                for j, body in enumerate(seg_bodies):
                    client.put_object(Bucket=bucket, Key=f"plain/{r}/s{j}", Body=body)

            def boto_get_blocks() -> None:
                for i in range(n):
                    client.get_object(Bucket=bucket, Key=f"plain/{r}/b{i}")["Body"].read()

            def boto_get_segs() -> None:
                for j in range(len(segs)):
                    client.get_object(Bucket=bucket, Key=f"plain/{r}/s{j}")["Body"].read()

            t_bpb = timed(boto_put_blocks) if per_block_baseline else float("nan")
            t_bps = timed(boto_put_segs)
            t_get = timed(lambda: agent.get(keys, out=outs_t))
            if not all(torch.equal(o, b) for o, b in zip(outs_t[:: max(1, n // 16)], blocks_t[:: max(1, n // 16)])):
                raise AssertionError("our S3 get returned wrong bytes")
            t_bgb = timed(boto_get_blocks) if per_block_baseline else float("nan")
            t_bgs = timed(boto_get_segs)
            agent.delete(keys)
            for key in [f"plain/{r}/b{i}" for i in range(n)] if per_block_baseline else []:
                client.delete_object(Bucket=bucket, Key=key)
            for j in range(len(segs)):
                client.delete_object(Bucket=bucket, Key=f"plain/{r}/s{j}")
            if r:
                for k, t in (("ours_put", t_put), ("boto_put_block", t_bpb), ("boto_put_seg", t_bps),
                             ("ours_get", t_get), ("boto_get_block", t_bgb), ("boto_get_seg", t_bgs)):
                    res[k].append(total / t / 1e9)
    cat.close()
    return res


# ---------------------------------------------------------------------------- report
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None,
                    help="directory for the POSIX volume and the plain files (default: a temp dir under .kvadvisor/)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per figure (median reported), after one warm-up")
    ap.add_argument("--posix-mib", type=int, default=256, help="MiB written per block size and run, POSIX")
    ap.add_argument("--s3-mib", type=int, default=64, help="MiB written per block size and run, S3 (16 MiB for 64 KiB blocks)")
    ap.add_argument("--quick", action="store_true", help="1 run, small totals")
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.posix_mib, args.s3_mib = 1, 64, 32
    parent = args.dir or (ROOT / ".kvadvisor")
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=parent))
    print(f"# storage bench: {args.runs} run(s) per figure (median), dir {base}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    t_start = time.perf_counter()
    try:
        print("\n## POSIX (NIXL POSIX, 64 MiB segments) vs plain writev+fsync / readv, same directory; goal >= 80 %")
        print("   get hot = page cache (just written); get cold = after POSIX_FADV_DONTNEED of both file sets")
        print(f"{'block':>7} {'MiB':>5} | {'ours put':>9} {'plain put':>9} {'ratio':>6} | "
              f"{'ours hot':>9} {'plain hot':>9} {'ratio':>6} | {'ours cold':>9} {'plain cold':>10} {'ratio':>6}   (GB/s)")
        for block in SIZES:
            r = bench_posix(base / f"posix-{block}", block, args.posix_mib * MiB, args.runs)
            op, pp, og, pg, oc, pc = (med(r[k]) for k in ("ours_put", "plain_put", "ours_get", "plain_get",
                                                          "ours_cold", "plain_cold"))
            print(f"{fmt_size(block):>7} {args.posix_mib:>5} | {op:9.3f} {pp:9.3f} {op / pp:6.0%} | "
                  f"{og:9.3f} {pg:9.3f} {og / pg:6.0%} | {oc:9.3f} {pc:10.3f} {oc / pc:6.0%}", flush=True)
        if not args.no_s3:
            s3 = start_local_s3()
            try:
                print("\n## S3 (NIXL OBJ, 16 MiB segment objects) vs boto3 on the same moto_server; goal >= 100 %")
                print("   boto3/blk = one object per block; boto3/seg = same 16 MiB objects as ours")
                print(f"{'block':>7} {'MiB':>5} | {'ours put':>9} {'boto3/blk':>9} {'ratio':>6} {'boto3/seg':>9} "
                      f"{'ratio':>6} | {'ours get':>9} {'boto3/blk':>9} {'ratio':>6} {'boto3/seg':>9} {'ratio':>6}   (GB/s)")
                for block in SIZES:
                    total_mib = 16 if block == 64 * KiB else args.s3_mib
                    r = bench_s3(base, s3, block, total_mib * MiB, args.runs, per_block_baseline=True)
                    op, pb, ps, og, gb, gs = (med(r[k]) for k in ("ours_put", "boto_put_block", "boto_put_seg",
                                                                   "ours_get", "boto_get_block", "boto_get_seg"))
                    print(f"{fmt_size(block):>7} {total_mib:>5} | {op:9.3f} {pb:9.3f} {op / pb:6.0%} {ps:9.3f} "
                          f"{op / ps:6.0%} | {og:9.3f} {gb:9.3f} {og / gb:6.0%} {gs:9.3f} {og / gs:6.0%}", flush=True)
            finally:
                s3.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n# total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
