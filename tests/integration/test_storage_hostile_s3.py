"""Hostile tests of S3 write waves and reads (storage review), with real parts only: NIXL OBJ
and boto3 against the session's moto_server, through a real HTTP proxy that fails, delays
or cuts chosen requests (per object key), so one PUT of a wave can fail while the others
land, be slow, or land after the failure was reported."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
import torch
from s3_proxy import S3FaultProxy
from tests import polling

from storage_backends import (
    BlockKey,
    LocalS3,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    TransferError,
    VolumeDescriptor,
    VolumeKind,
)

_ids = itertools.count()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"s3-hostile-{tmp_path.name}")
    yield a
    a.close()
    cat.close()


def s3desc(endpoint: str, s3: LocalS3, segment_bytes: int = 1 << 20) -> VolumeDescriptor:
    return VolumeDescriptor(
        "cold", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=endpoint, prefix="kv",
        bucket=f"kvadvisor-hostile-{next(_ids)}", segment_bytes=segment_bytes,
        access_key=s3.access_key, secret_key=s3.secret_key,
    )


def block(h: int, n: int = 256 << 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def bucket_keys(s3: LocalS3, bucket: str) -> list[str]:
    c = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                     aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key)
    return sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])
                  if not o["Key"].endswith("/owner"))  # the volume's owner marker aside


def is_put_of(seg_suffix: str) -> Callable[[str, str], bool]:
    return lambda m, p: m == "PUT" and p.endswith(seg_suffix)


def test_a_wave_whose_one_put_is_denied_while_another_is_slow_leaves_nothing_behind(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy
) -> None:
    """Segment 2's PUT is refused at once (403) while segment 3's takes 1.5 s to land: the
    put fails, stores nothing, and once every request is over no object of the wave is left
    in the bucket (a PUT that lands after the wave's objects were deleted would leave one)."""
    desc = s3desc(proxy.endpoint, local_s3)
    agent.register_volume(desc)
    items = [(BlockKey("ns", i), block(i)) for i in range(16)]  # 4 MiB: 4 segments of 1 MiB

    def rule(m: str, p: str, n: int) -> object:
        if m == "PUT" and p.endswith("seg-000000000002"):
            return 403
        if m == "PUT" and p.endswith("seg-000000000003"):
            return ("delay", 1.5)
        return None

    proxy.set_rule(rule)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as ei:
        agent.put(items, "cold")
    assert ei.value.stored == []
    time.sleep(max(0.0, t0 + 3.0 - time.monotonic()))  # a PUT sent late (1.5 s delay) has reached the proxy
    polling.wait_until(lambda: proxy.in_flight == 0, 60, "every PUT through the proxy answered")
    assert bucket_keys(local_s3, desc.bucket) == []
    assert agent.catalog.get_many([k for k, _ in items]) == [None] * 16
    assert agent.segments("cold") == []


def test_a_failed_get_writes_nothing_into_the_callers_tensors_after_it_returned(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy
) -> None:
    """Two 4 MiB blocks in two segment objects are read straight into the caller's tensors
    (one ranged GET each, one NIXL READ): the GET of the first is refused (403) every time,
    the first GET of the second is slow.  ``get`` fails; the caller then reuses its tensors, and
    no GET of the failed call may land in them afterwards."""
    desc = s3desc(proxy.endpoint, local_s3, segment_bytes=4 << 20)
    agent.register_volume(desc)
    keys = [BlockKey("ns", 100), BlockKey("ns", 101)]
    agent.put([(k, block(k.sequence_hash, 4 << 20)) for k in keys], "cold")
    places = agent.catalog.get_many(keys)
    assert places[0] is not None and places[1] is not None and places[0].segment_id != places[1].segment_id
    s0, s1 = (f"seg-{p.segment_id:012d}" for p in places)  # type: ignore[union-attr]

    def rule(m: str, p: str, n: int) -> object:
        if m == "GET" and p.endswith(s0):
            return 403
        if m == "GET" and p.endswith(s1) and n == 0:
            return ("delay", 2.5)  # the first GET only: the call's later tries are quick
        return None

    proxy.set_rule(rule)
    out = [torch.zeros(4 << 20, dtype=torch.uint8) for _ in keys]
    with pytest.raises(TransferError):
        agent.get(keys, out=out)
    done = time.monotonic()
    for t in out:
        t.fill_(7)  # the caller reuses its buffers for something else
    time.sleep(max(0.0, 3.5 - (time.monotonic() - done)))  # a GET sent late (2.5 s delay) has reached the proxy
    polling.wait_until(lambda: proxy.in_flight == 0, 60, "every GET through the proxy answered")
    assert all(bool((t == 7).all()) for t in out)
    late = [(at, m, p) for at, m, p, _ in proxy.log if at > done]
    assert late == []  # no request of the failed call was still being sent
    proxy.set_rule(lambda m, p, n: None)
    got = agent.get([keys[1]])[0]
    assert torch.equal(got, block(101, 4 << 20))  # the block itself is fine


@pytest.mark.parametrize("how", ["cut", "short"])
def test_a_get_answered_short_once_neither_fails_nor_quarantines_a_good_copy(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy, how: str
) -> None:
    """The first ranged GET of a segment comes back short, once: the connection drops
    mid-body ("cut"), or the answer is a well-formed 206 of half the range ("short", as an
    endpoint or middlebox that truncates).  The object itself is whole, so the copy is
    good: ``get`` must return the right bytes, and nothing may be quarantined."""
    desc = s3desc(proxy.endpoint, local_s3)
    agent.register_volume(desc)
    items = [(BlockKey("ns", 200 + i), block(200 + i, 64 << 10)) for i in range(8)]
    agent.put(items, "cold")
    eng = agent._vol("cold").engine  # type: ignore[attr-defined]
    for slot in (0, 1):  # the put left these very bytes in the staging buffer: scribble
        eng.staging(1 << 20, slot=slot).fill_(0xAB)
    proxy.set_rule(lambda m, p, n: (how, 0) if m == "GET" and "/seg-" in p and n == 0 else None)
    got = agent.get([k for k, _ in items])
    assert [a for _, m, _, a in proxy.log if m == "GET"][0] == (how, 0)  # the fault was served
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
    assert agent.catalog.get_many([k for k, _ in items]) == agent.locate([k for k, _ in items])
    assert all(p is not None for p in agent.locate([k for k, _ in items]))
    assert agent.counters.quarantined == 0


def test_a_wave_retried_after_a_partial_success_stores_every_block_readably(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy
) -> None:
    """First try of a wave of 4: segment 2's PUT is refused while the others land; the
    whole wave is sent again and succeeds.  Every block reads back, exactly the wave's 4
    objects exist, and a later wave that fails for good leaves the first one intact."""
    desc = s3desc(proxy.endpoint, local_s3)
    agent.register_volume(desc)
    items = [(BlockKey("ns", 300 + i), block(300 + i)) for i in range(16)]
    proxy.set_rule(lambda m, p, n: 403 if m == "PUT" and p.endswith("seg-000000000002") and n == 0 else None)
    ps = agent.put(items, "cold")
    assert sum(1 for _, m, p, a in proxy.log if m == "PUT" and a == 403) == 1
    assert len(bucket_keys(local_s3, desc.bucket)) == 4
    got = agent.get([k for k, _ in items])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
    more = [(BlockKey("ns", 400 + i), block(400 + i)) for i in range(40)]  # 10 segments: 2 waves
    proxy.set_rule(lambda m, p, n: 403 if m == "PUT" and p.endswith("seg-000000000013") else None)
    with pytest.raises(TransferError) as ei:
        agent.put(more, "cold")
    stored = ei.value.stored
    assert [p.key for p in stored] == [k for k, _ in more[:32]]  # the first wave (8 segments) landed
    assert len(bucket_keys(local_s3, desc.bucket)) == 4 + 8
    proxy.set_rule(lambda m, p, n: None)
    got = agent.get([p.key for p in stored] + [p.key for p in ps])
    assert all(torch.equal(g, block(p.key.sequence_hash)) for g, p in zip(got, stored + ps))
    assert agent.locate([k for k, _ in more[32:]]) == [None] * 8


def test_capacity_running_out_mid_wave_keeps_what_landed_and_leaves_no_stray_object(
    agent: StorageAgent, local_s3: LocalS3
) -> None:
    """A 3.5 MiB S3 volume, a put of 4 MiB (4 segments, one wave): the 3 segments that
    have room are written and recorded, ``VolumeFullError.stored`` names exactly their
    blocks, they read back, and the bucket holds exactly their 3 objects."""
    from dataclasses import replace

    from storage_backends import VolumeFullError

    desc = replace(s3desc(local_s3.endpoint, local_s3), capacity_bytes=(7 << 20) // 2)
    agent.register_volume(desc)
    items = [(BlockKey("ns", 500 + i), block(500 + i)) for i in range(16)]
    with pytest.raises(VolumeFullError) as ei:
        agent.put(items, "cold")
    stored = ei.value.stored
    assert [p.key for p in stored] == [k for k, _ in items[:12]]
    assert len(bucket_keys(local_s3, desc.bucket)) == 3
    got = agent.get([p.key for p in stored])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items[:12]))
    assert agent.locate([k for k, _ in items[12:]]) == [None] * 4
    assert len(agent.segments("cold")) == 3


def test_concurrent_s3_puts_gets_and_compactions_keep_every_acknowledged_block(
    agent: StorageAgent, local_s3: LocalS3
) -> None:
    """Threads putting, reading and compacting one S3 volume at once (real NIXL OBJ on
    moto): every acknowledged block reads its own bytes, and at the end the bucket holds
    exactly the catalog's segments."""
    desc = s3desc(local_s3.endpoint, local_s3, segment_bytes=512 << 10)
    agent.register_volume(desc)
    acked: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()
    nxt = itertools.count(1000)
    done = {"put": 0, "get": 0, "compact": 0}

    def loop(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                while not stop.is_set():
                    fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                stop.set()
        return run

    def putter() -> None:
        with lock:
            hs = [next(nxt) for _ in range(6)]
        agent.put([(BlockKey("ns", h), block(h, 128 << 10)) for h in hs], "cold")
        with lock:
            acked.extend(hs)
        done["put"] += 1

    def getter() -> None:
        with lock:
            hs = acked[-12:]
        if hs:
            got = agent.get([BlockKey("ns", h) for h in hs])
            assert all(torch.equal(g, block(h, 128 << 10)) for h, g in zip(hs, got))
            done["get"] += 1

    def compactor() -> None:
        segs = [s for s in agent.segments("cold") if s.sealed]
        if len(segs) > 2:
            agent.compact("cold", segs[len(segs) // 2].segment_id)
            done["compact"] += 1
        time.sleep(0.02)

    threads = [threading.Thread(target=loop(f)) for f in (putter, putter, getter, compactor)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # time passes: the threads race (on a loaded machine, until each did a few)
    polling.wait_until(lambda: errors or (done["put"] > 3 and done["get"] > 3 and done["compact"] > 1), 120,
                       f"a few of each operation ({done})", every=0.2)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert done["put"] > 3 and done["get"] > 3 and done["compact"] > 1, done
    got = agent.get([BlockKey("ns", h) for h in acked])
    assert all(torch.equal(g, block(h, 128 << 10)) for h, g in zip(acked, got))
    assert agent.counters.quarantined == 0
    objs = {int(k.rsplit("-", 1)[1]) for k in bucket_keys(local_s3, desc.bucket)}
    assert objs == {s.segment_id for s in agent.segments("cold")}
