"""Hostile concurrency test of the storage layer (storage review): puts, gets, compactions
and deletes from several threads on one StorageAgent, real NIXL POSIX on files under
tmp_path and a real SQLite catalog.  Every block that a put acknowledged reads back its
own bytes until it is deleted; at the end the catalog and the files agree."""

from __future__ import annotations

import gc
import random
import threading
import time
from pathlib import Path

import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)
from tests import polling


def block(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (4096 + (h % 7) * 1000,), dtype=torch.uint8, generator=g)


def test_concurrent_puts_gets_compactions_and_deletes_keep_every_acknowledged_block(tmp_path: Path) -> None:
    gc.enable()
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    agent = StorageAgent(cat, name=f"hostile-posix-{tmp_path.name}")
    agent.register_volume(VolumeDescriptor("v", VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                           root=str(tmp_path / "v"), segment_bytes=64 << 10))
    acked: set[int] = set()  # stored by a put that returned
    deleted: set[int] = set()
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()
    counts = {"put": 0, "get": 0, "compact": 0, "delete": 0}

    def guard(fn):  # type: ignore[no-untyped-def]
        def run() -> None:
            try:
                while not stop.is_set():
                    fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                stop.set()
        return run

    nxt = iter(range(10**6))

    def putter() -> None:
        hs = [next(nxt) for _ in range(random.randint(1, 24))]
        agent.put([(BlockKey("ns", h), block(h)) for h in hs], "v")
        with lock:
            acked.update(hs)
        counts["put"] += 1

    def getter() -> None:
        with lock:
            pool = sorted(acked - deleted)
        if not pool:
            return
        hs = random.sample(pool, min(len(pool), 16))
        try:
            got = agent.get([BlockKey("ns", h) for h in hs])
        except BlockNotFoundError:
            with lock:
                if not (set(hs) & deleted):
                    raise
            return
        for h, g in zip(hs, got):
            assert torch.equal(g, block(h)), f"block {h} read back wrong"
        counts["get"] += 1

    def compactor() -> None:
        segs = [s for s in agent.segments("v") if s.sealed]
        if segs:
            agent.compact("v", random.choice(segs).segment_id)
            counts["compact"] += 1
        time.sleep(0.005)

    def deleter() -> None:
        with lock:
            pool = sorted(acked - deleted)
        if len(pool) > 50:
            h = random.choice(pool)
            with lock:
                deleted.add(h)
            agent.delete([BlockKey("ns", h)])
            counts["delete"] += 1
        time.sleep(0.01)

    threads = [threading.Thread(target=guard(f)) for f in (putter, getter, getter, compactor, deleter)]
    random.seed(4)
    try:
        for t in threads:
            t.start()
        time.sleep(4.0)  # time passes: the threads race (on a loaded machine, until each did a few)
        polling.wait_until(lambda: errors or counts["put"] > 5 and counts["get"] > 5 and counts["compact"] > 2, 120,
                           f"a few of each operation ({counts})", every=0.2)
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors[0]
        assert counts["put"] > 5 and counts["get"] > 5 and counts["compact"] > 2, counts
        live = sorted(acked - deleted)
        got = agent.get([BlockKey("ns", h) for h in live])
        assert all(torch.equal(g, block(h)) for h, g in zip(live, got))
        assert agent.locate([BlockKey("ns", h) for h in sorted(deleted)]) == [None] * len(deleted)
        assert agent.counters.quarantined == 0
        vol = agent._vol("v")  # type: ignore[attr-defined]
        on_disk = set(vol.list_segments())
        in_catalog = {s.segment_id for s in agent.segments("v")}
        assert on_disk == in_catalog  # nothing left behind, nothing pointing at a deleted file
        assert gc.isenabled()
    finally:
        stop.set()
        agent.close()
        cat.close()
