"""Hostile unit tests of the storage layer's latest changes (storage review): the shared
garbage-collector pause under calls that overlap for ever, and signed sequence hashes in
the SQLite catalog (real SQLite files)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from storage_backends import gcpause
from storage_backends.gcpause import gc_paused


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_calls_that_overlap_for_ever_do_not_keep_the_collector_off_for_ever() -> None:
    """Two threads whose paused calls overlap (one is always inside, as a worker's puts
    and a mover's gets can) never bring the pause count to 0.  The collector must still
    come back within a bounded time, or cyclic garbage piles up without limit."""
    gc.enable()
    stop = threading.Event()
    started = threading.Barrier(3)

    def caller(offset: float) -> None:
        started.wait(5)
        time.sleep(offset)
        while not stop.is_set():
            with gc_paused():
                time.sleep(0.06)  # a call; the other thread's calls start inside it

    threads = [threading.Thread(target=caller, args=(o,)) for o in (0.0, 0.03)]
    for t in threads:
        t.start()
    started.wait(5)
    time.sleep(0.1)
    t0 = time.monotonic()
    back_at = None
    try:
        while time.monotonic() - t0 < 3 * gcpause.MAX_PAUSE_S + 1.5:
            if gc.isenabled():
                back_at = time.monotonic() - t0
                break
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert back_at is not None, "the collector stayed off while calls kept overlapping"
    # a deadline the product promises: the collector is off at most MAX_PAUSE_S (1 s) at a
    # time; measured back at about 1.0 s here, asserted at 3x
    assert back_at <= 3 * gcpause.MAX_PAUSE_S
    assert gc.isenabled()  # and it is on once every call is out


def _hashes() -> list[int]:
    top = (1 << 64) - 1
    edge = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 1, top - 1, top]
    hs = edge + [(1 << 63) + 977 * i for i in range(2, 40)] + [top - 7919 * i for i in range(1, 40)] + list(range(2, 20))
    assert len(set(hs)) == len(hs)
    return hs


@pytest.mark.parametrize("namespaces", [1, 9])  # one IN query per namespace / (ns, seq) IN (VALUES ...)
def test_sqlite_lookups_of_hashes_at_and_past_2_63_round_trip(tmp_path, namespaces: int) -> None:  # type: ignore[no-untyped-def]
    from storage_backends import BlockKey, Placement, SqliteCatalog

    cat = SqliteCatalog(tmp_path / "c.sqlite")
    try:
        seg = cat.new_segment("v", 1 << 20)
        hs = _hashes()
        keys = [BlockKey(f"ns{i % namespaces}", h) for i, h in enumerate(hs)]
        keys += [BlockKey("other", h) for h in hs[:7]]  # same hashes, another namespace
        places = [Placement(k, "v", seg, 64 * i, 64, (1 << 64) - 1 - i, 0) for i, k in enumerate(keys)]
        assert cat.insert_if_absent(places) == places
        for n in (len(keys), 10):  # the numpy path (>= 64 keys) and the plain one
            probe = keys[:n] + [keys[0]] + [BlockKey("ns0", 12345), BlockKey("nsX", 1 << 63)]
            got = cat.get_many(probe)
            assert got[:n] == places[:n]
            assert got[n] == places[0]  # a key asked twice
            assert got[n + 1 :] == [None, None]
            assert all(type(p.key.sequence_hash) is int and p.key.sequence_hash >= 0 for p in got[:n])
            assert all(p.checksum >= 0 for p in got[:n])
        assert [cat.get(k) for k in keys[:9]] == places[:9]
    finally:
        cat.close()
