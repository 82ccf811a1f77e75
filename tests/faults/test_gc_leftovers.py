"""Finding 2: crash leftovers (copies a killed mover never committed) are collected at
start and on a timer, so the fast tier does not jam: used space equals live space again and
hot blocks are promoted."""

from __future__ import annotations

import time
from pathlib import Path

from advisor import AdvisorService, PlanKind, PlanStatus
from tests.faults._world import Worker, crash_mid_copy, hot, settings


def _fast(svc: AdvisorService) -> tuple[int, int, int]:
    st = next(v for v in svc.agent.stats() if v.volume_id == "fast")
    return st.used_bytes, st.live_bytes, st.segments


MIN_AGE_S = 5.0


def test_leftovers_of_killed_copies_are_collected_at_start_and_on_a_timer(tmp_path: Path) -> None:
    # gc_min_age_s is the contract that keeps a copy in flight in another process safe: it
    # must outlast the copy (docs/operations.md).  With 0 the advisor's timer could remove
    # the crasher's segment between its write and its read-back check, and the crasher
    # would fail before it is killed; 5 s is far longer than a 2 MiB copy takes.
    s = settings(tmp_path, fast_blocks=40, gc_min_age_s=MIN_AGE_S, gc_interval_s=0.5)
    w = Worker(s)
    try:
        w.put(list(range(1, 33)), "slow")
        crash_mid_copy(s, list(range(1, 33)), "fast")  # 32 blocks: 2 MiB of 2.5 MiB on fast
        files = sorted((tmp_path / "fast").rglob("seg-*"))
        assert files, "the killed copy left segment files"
        time.sleep(MIN_AGE_S + 0.5)  # time passes: the leftovers outgrow gc_min_age_s before the start
        svc = AdvisorService(s)
        svc.start()
        try:
            assert svc.counters["gc_segments_removed"] >= 1  # at start
            assert _fast(svc) == (0, 0, 0)
            assert list((tmp_path / "fast").rglob("seg-*")) == []
            # a crash while the advisor runs: the timer collects it
            crash_mid_copy(s, list(range(1, 33)), "fast")
            deadline = time.monotonic() + 120
            while _fast(svc)[2] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _fast(svc) == (0, 0, 0)
            # the fast tier is not jammed: hot blocks are promoted
            hot(w, svc, [101, 102, 103])
            res = svc.run_policies_once()
            assert [(r.item.kind, r.status) for r in res] == [(PlanKind.PROMOTE, PlanStatus.DONE)] * 3
            assert w.where([101, 102, 103]) == ["fast"] * 3 and w.reads_back([101, 102, 103])
            assert w.reads_back(list(range(1, 33)))  # the originals were never touched
        finally:
            svc.stop()
    finally:
        w.close()
