"""Hostile review of the staged reads of ``StorageAgent.get`` (commit 76737e5):
``_read_piece`` (staging buffer -> ``_readcore.check_copy``, the second half on the
verifier thread from 2 MiB with ``split_cached_reads``), ``get(keys)`` without ``out`` on
volumes that stage whatever the addresses (views of one new buffer per piece:
``hand_out_views``) and ``Volume.read_batch_bytes`` (POSIX: 256 MiB batches).

Real parts only: NIXL OBJ against the session's moto_server (``local_s3``, through the
fault proxy of ``tests/s3_proxy.py`` where a GET must fail), NIXL POSIX with O_DIRECT on
files under tmp_path, a real SQLite catalog.
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch
from s3_proxy import S3FaultProxy

from storage_backends import (
    BlockKey,
    ChecksumMismatchError,
    LocalS3,
    MediaClass,
    SegmentMissingError,
    SegmentTruncatedError,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)

NS = "staged-hostile"
KiB, MiB = 1 << 10, 1 << 20
_buckets = itertools.count()


def block(h: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def s3desc(endpoint: str, s3: LocalS3, vid: str = "cold") -> VolumeDescriptor:
    return VolumeDescriptor(
        vid, VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=endpoint, prefix="kv",
        bucket=f"kvadvisor-staged-{next(_buckets)}", access_key=s3.access_key, secret_key=s3.secret_key,
    )


def client(s3: LocalS3):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                        aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key)


def put(agent: StorageAgent, base: int, sizes: list[int], vid: str = "cold") -> list[tuple[BlockKey, torch.Tensor]]:
    items = [(BlockKey(NS, base + i), block(base + i, n)) for i, n in enumerate(sizes)]
    agent.put(items, vid)
    return items


def wrong(got: list[torch.Tensor], items: list[tuple[BlockKey, torch.Tensor]]) -> list[int]:
    return [i for i, (g, (_, t)) in enumerate(zip(got, items)) if not torch.equal(g, t)]


@pytest.fixture
def agent(tmp_path: Path, local_s3: LocalS3) -> Iterator[StorageAgent]:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"staged-{tmp_path.name}")
    a.register_volume(s3desc(local_s3.endpoint, local_s3))
    a.register_volume(VolumeDescriptor("od", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "od"),
                                       o_direct=True, alignment=4096))
    yield a
    a.close()
    cat.close()


def corrupt(s3: LocalS3, agent: StorageAgent, key: BlockKey, at: int = 5) -> None:
    p = agent.locate([key])[0]
    assert p is not None
    c, bucket = client(s3), agent.volume("cold").bucket
    obj = f"kv/cold/{agent.catalog.catalog_id()}/seg-{p.segment_id:012d}"
    body = bytearray(c.get_object(Bucket=bucket, Key=obj)["Body"].read())
    body[p.offset + at] ^= 0x40
    c.put_object(Bucket=bucket, Key=obj, Body=bytes(body))


# ------------------------------------------------------------------ views of a new buffer
# Was a bug (strict xfail until fixed by the same change): S3 get(keys) without out: a key asked
# twice is one coalesced span (S3Volume._spans), so hand_out_views hands out two views of the SAME
# bytes; writing one result changes the other (before 76737e5 each got its own copy, as POSIX
# still does)
def test_a_key_asked_twice_gets_two_independent_tensors(agent: StorageAgent) -> None:
    items = put(agent, 100, [4096, 8192])
    k, t = items[0]
    got = agent.get([k, items[1][0], k])
    assert wrong([got[0], got[2]], [items[0], items[0]]) == []
    got[0].fill_(0)
    assert torch.equal(got[2], t), "the second copy of the key changed with the first"


def test_a_key_asked_twice_on_o_direct_posix_gets_two_independent_tensors(agent: StorageAgent) -> None:
    """The same through the O_DIRECT staging path (unaligned lengths: new buffer, views)."""
    items = put(agent, 150, [5000, 7000], "od")
    got = agent.get([items[0][0], items[1][0], items[0][0]])
    assert wrong([got[0], got[1], got[2]], [items[0], items[1], items[0]]) == []
    got[0].fill_(0)
    assert torch.equal(got[2], items[0][1])


def test_views_never_alias_staging_and_outlive_later_gets_of_any_size(agent: StorageAgent) -> None:
    """Views handed out by one get keep their bytes through many later gets (different
    sizes, with and without ``out``, reusing staging slots and the allocator's freed
    buffers, registered again in DramRegions); none lies in a staging buffer; a dropped
    get's buffer is freed at once (no cycle keeps it), a kept view keeps its own alive."""
    eng = agent._vol("cold").engine  # type: ignore[attr-defined]
    first = put(agent, 200, [64 * KiB] * 40)  # 2.5 MiB: one buffer
    kept = agent.get([k for k, _ in first])
    storages = {g.untyped_storage().data_ptr() for g in kept}
    assert len(storages) == 1
    sizes = [1, 4095, 64 * KiB, 300 * KiB, 1 * MiB]
    later = put(agent, 300, [sizes[i % len(sizes)] for i in range(30)])
    for r in range(12):
        sub = later[r % 5 :: 1 + r % 4]
        if r % 3 == 2:
            outs = [torch.full((t.numel(),), 0xEE, dtype=torch.uint8) for _, t in sub]
            assert wrong(agent.get([k for k, _ in sub], out=outs), sub) == []
        else:
            got = agent.get([k for k, _ in sub])
            assert wrong(got, sub) == []
            ref = weakref.ref(got[0] if got[0]._base is None else got[0]._base)
            del got
            assert ref() is None, "a get's new buffer outlived its views"
        for slot, st in list(eng._slots.items()):  # the staging slots now
            lo, hi = st.data_ptr(), st.data_ptr() + st.numel()
            assert not any(lo <= g.data_ptr() < hi for g in kept), f"a view lies in staging slot {slot}"
    assert wrong(kept, first) == []
    again = put(agent, 260, [64 * KiB] * 40)
    reuse = agent.get([k for k, _ in again])  # views of one buffer, read into as out
    assert wrong(agent.get([k for k, _ in first], out=reuse), first) == []
    assert wrong(kept, first) == []
    one = kept[17]
    del kept
    torch.empty(8 * MiB, dtype=torch.uint8).fill_(0x5A)
    assert torch.equal(one, first[17][1])
    assert (agent.counters.quarantined, agent.counters.checksum_mismatches) == (0, 0)


# ------------------------------------------------------------------ split copy-out
@pytest.mark.parametrize("bad", [3, 36], ids=["first-half", "second-half"])
def test_split_copy_out_with_a_bad_block_in_either_half(agent: StorageAgent, local_s3: LocalS3, bad: int) -> None:
    """3 MiB into ``out`` on two threads: the bad block's tensor is never written, it alone
    is quarantined, every other tensor gets its bytes; then the others read again."""
    agent.split_cached_reads = True
    items = put(agent, 400, [64 * KiB] * 48)
    corrupt(local_s3, agent, items[bad][0])
    outs = [torch.zeros(64 * KiB, dtype=torch.uint8) for _ in items]
    with pytest.raises(ChecksumMismatchError, match="1 block"):
        agent.get([k for k, _ in items], out=outs)
    assert not outs[bad].any()
    assert [i for i, (o, (_, t)) in enumerate(zip(outs, items)) if not torch.equal(o, t)] == [bad]
    assert agent.exists([k for k, _ in items]) == [i != bad for i in range(48)]
    rest = [it for i, it in enumerate(items) if i != bad]
    assert wrong(agent.get([k for k, _ in rest]), rest) == []


class _Interrupt(Exception):
    """Raised by the test's signal handler (a KeyboardInterrupt would end the session)."""


def _in_wait(ident: int) -> bool:
    f = sys._current_frames().get(ident)
    while f is not None:
        if f.f_code.co_name == "_wait_through_interrupts":
            return True
        f = f.f_back
    return False


@pytest.mark.timeout(60)
# Was a bug (strict xfail until fixed by the same change): _read_piece.check_copy waits for the
# other half in `finally: _wait_through_interrupts([other], reraise=False)` even when its own half
# returned normally: an interrupt (Ctrl-C, a timeout signal) that lands during that wait is
# swallowed and get returns as if nothing happened (_read_cached_first reraises it: reraise=False
# only in except)
def test_an_interrupt_while_the_other_half_copies_is_raised_once_it_is_done(agent: StorageAgent) -> None:
    agent.split_cached_reads = True
    items = put(agent, 450, [64 * KiB] * 48)  # 3 MiB from S3 into out: split copy-out
    outs = [torch.zeros(64 * KiB, dtype=torch.uint8) for _ in items]
    gate = threading.Event()
    blocker = agent._verifier().submit(gate.wait, 20)  # type: ignore[attr-defined]
    main = threading.get_ident()
    sent: list[float] = []

    def interrupter() -> None:
        end = time.monotonic() + 20
        while time.monotonic() < end and not _in_wait(main):
            time.sleep(0.001)
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.05)
        gate.set()  # now the other half runs

    def handler(signum: int, frame: object) -> None:
        raise _Interrupt()

    old = signal.signal(signal.SIGUSR1, handler)
    th = threading.Thread(target=interrupter)
    try:
        th.start()
        raised = False
        try:
            agent.get([k for k, _ in items], out=outs)
        except _Interrupt:
            raised = True
        th.join()
        assert sent and blocker.done()
        after = [o.clone() for o in outs]
        time.sleep(0.05)  # time passes: a late write of the other half would land meanwhile
        assert all(torch.equal(a, o) for a, o in zip(after, outs)), "the other half wrote after get ended"
        assert raised, "the interrupt was swallowed: get returned normally"
    finally:
        gate.set()
        th.join()
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(60)
def test_o_direct_unaligned_outs_over_many_pieces_verify_on_the_pool_without_splitting(agent: StorageAgent) -> None:
    """O_DIRECT POSIX, unaligned ``out`` tensors (staging), 12 MiB in one 256 MiB batch: 4 MiB
    pieces verified on the verifier thread, which must not split its piece onto itself
    (one worker: that would deadlock)."""
    agent.split_cached_reads = True
    items = put(agent, 500, [1 * MiB] * 12, "od")
    raw = torch.empty(12 * MiB + 1, dtype=torch.uint8)
    outs = [raw[1 + i * MiB : 1 + (i + 1) * MiB] for i in range(12)]
    done: list[object] = []
    th = threading.Thread(target=lambda: done.append(agent.get([k for k, _ in items], out=outs)), daemon=True)
    th.start()
    th.join(30)
    assert done, "the get hung (split on the verifier thread?)"
    assert wrong(outs, items) == []
    got = agent.get([k for k, _ in items])  # aligned lengths, new tensors: direct or views
    assert wrong(got, items) == []
    assert (agent.counters.quarantined, agent.counters.checksum_mismatches) == (0, 0)


# Was a bug (strict xfail until fixed by the same change): overlapping out tensors through a
# staged read of >= 2 MiB with split_cached_reads: _read_piece.check_copy copies the two halves on
# two threads into the same memory, so which block's bytes the shared tensor ends with is a race
# (either; torn on 2 CPUs); before 76737e5, and on the other paths, the later block wins
# (test_storage_direct_reads)
def test_overlapping_outs_of_a_split_staged_read_end_with_the_later_block(agent: StorageAgent) -> None:
    agent.split_cached_reads = True
    items = put(agent, 550, [1 * MiB] * 2, "od")
    ends = []
    for _ in range(30):
        shared = torch.empty(1 * MiB, dtype=torch.uint8)
        res = agent.get([k for k, _ in items], out=[shared, shared])
        assert res[0] is shared and res[1] is shared
        ends.append("later" if torch.equal(shared, items[1][1]) else
                    "earlier" if torch.equal(shared, items[0][1]) else "torn")
    assert (agent.counters.quarantined, agent.counters.checksum_mismatches) == (0, 0)
    assert set(ends) == {"later"}, ends


def test_o_direct_unaligned_lengths_new_tensors_over_many_pieces(agent: StorageAgent) -> None:
    """Block lengths not multiples of 4096 on O_DIRECT: views of new buffers, a piece at
    a time (pieces verified on the pool), each exactly its block and distinct."""
    sizes = [MiB + 1, 3 * MiB - 7, 4097, 2 * MiB + 13, 1, 5 * MiB + 3]
    items = put(agent, 600, sizes, "od")
    got = agent.get([k for k, _ in items])
    assert wrong(got, items) == []
    spans = sorted((g.data_ptr(), g.data_ptr() + g.numel()) for g in got)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    vol = agent._vol("od")  # type: ignore[attr-defined]
    assert vol.counters.extra.get("o_direct_fallbacks", 0) == 0


# ------------------------------------------------------------------ faults
def test_truncated_and_missing_objects_with_new_tensors(agent: StorageAgent, local_s3: LocalS3) -> None:
    """Views path: an object cut short quarantines exactly the blocks past its end; a
    missing object its blocks; the other blocks read right afterwards."""
    a = put(agent, 700, [64 * KiB] * 6)
    b = put(agent, 710, [32 * KiB] * 4)
    pa, pb = agent.locate([a[0][0]])[0], agent.locate([b[0][0]])[0]
    assert pa is not None and pb is not None and pa.segment_id != pb.segment_id
    c, bucket = client(local_s3), agent.volume("cold").bucket
    obj = f"kv/cold/{agent.catalog.catalog_id()}/seg-{pa.segment_id:012d}"
    body = c.get_object(Bucket=bucket, Key=obj)["Body"].read()
    cut = agent.locate([a[4][0]])[0]
    assert cut is not None
    c.put_object(Bucket=bucket, Key=obj, Body=body[: cut.offset + 100])
    with pytest.raises(SegmentTruncatedError):
        agent.get([k for k, _ in a])
    assert agent.exists([k for k, _ in a]) == [True] * 4 + [False] * 2
    assert wrong(agent.get([k for k, _ in a[:4]]), a[:4]) == []
    c.delete_object(Bucket=bucket, Key=f"kv/cold/{agent.catalog.catalog_id()}/seg-{pb.segment_id:012d}")
    with pytest.raises(SegmentMissingError):
        agent.get([k for k, _ in a[:4] + b])
    assert agent.exists([k for k, _ in b]) == [False] * 4
    assert wrong(agent.get([k for k, _ in a[:4]]), a[:4]) == []


def test_s3_get_retried_after_a_503_hands_out_right_views(agent: StorageAgent, local_s3: LocalS3,
                                                        proxy: S3FaultProxy) -> None:
    agent.register_volume(s3desc(proxy.endpoint, local_s3, "flaky"))
    items = put(agent, 800, [64 * KiB] * 16, "flaky")
    proxy.set_rule(lambda m, p, n: 503 if m == "GET" and "/seg-" in p and n == 0 else None)
    got = agent.get([k for k, _ in items])
    assert any(r.startswith("GET") for r in proxy.injected)
    assert wrong(got, items) == []
    assert agent.counters.quarantined == 0


def test_compaction_during_new_tensor_gets_and_copy_many_of_views(agent: StorageAgent) -> None:
    """Segments compacted (blocks moved, old objects deleted) while gets without ``out``
    run: every get returns right bytes; then the blocks (views) are copied to O_DIRECT
    POSIX with copy_many and read back from there."""
    segs = [put(agent, 900 + 20 * s, [48 * KiB] * 20) for s in range(3)]
    live = [it for items in segs for i, it in enumerate(items) if i % 2 == 0]
    agent.delete([k for items in segs for i, (k, _) in enumerate(items) if i % 2])
    seg_ids = sorted({p.segment_id for p in agent.locate([k for k, _ in live])})  # type: ignore[union-attr]
    errors: list[BaseException] = []

    def compactor() -> None:
        try:
            for s in seg_ids:
                agent.compact("cold", s)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    th = threading.Thread(target=compactor)
    th.start()
    rounds = 0
    while (th.is_alive() and rounds < 30) or rounds < 2:
        if rounds % 2:
            outs = [torch.zeros(48 * KiB, dtype=torch.uint8) for _ in live]
            agent.get([k for k, _ in live], out=outs)
            assert wrong(outs, live) == []
        else:
            assert wrong(agent.get([k for k, _ in live]), live) == []
        rounds += 1
    th.join()
    assert errors == []
    assert not set(seg_ids) & {p.segment_id for p in agent.locate([k for k, _ in live])}  # type: ignore[union-attr]
    olds = agent.locate([k for k, _ in live])
    news = agent.copy_many(olds, "od")  # type: ignore[arg-type]
    for o, n in zip(olds, news):
        agent.commit_move(o, n)  # type: ignore[arg-type]
    assert {p.volume_id for p in agent.locate([k for k, _ in live])} == {"od"}  # type: ignore[union-attr]
    assert wrong(agent.get([k for k, _ in live]), live) == []
    assert (agent.counters.quarantined, agent.counters.checksum_mismatches) == (0, 0)
