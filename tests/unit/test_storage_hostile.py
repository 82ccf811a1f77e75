"""Hostile unit tests of the storage layer's latest changes (issue 4 review): the shared
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
        while time.monotonic() - t0 < gcpause.MAX_PAUSE_S + 1.5:
            if gc.isenabled():
                back_at = time.monotonic() - t0
                break
            time.sleep(0.005)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert back_at is not None, "the collector stayed off while calls kept overlapping"
    assert back_at <= gcpause.MAX_PAUSE_S + 0.5
    assert gc.isenabled()  # and it is on once every call is out
