"""Many sources and locations do not multiply the cost of snapshots: export and import are
linear in blocks (a scan of every block per location made 4,000 sources of one block each
take 121 s to load, and 20,000 made SIGTERM hang for minutes)."""

from __future__ import annotations

import time
from pathlib import Path

from advisor.index.prefix_index import PrefixIndex
from advisor.index.reference import ReferencePrefixIndex, _bits, held_by_location
from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane.schema import WIRE_VERSION, EventBatch, EventType, KVEvent

BLOCKS = 100_000
SOURCES = 20_000


def _batches(sources: int, blocks: int = BLOCKS) -> list[EventBatch]:
    """``sources`` forged sources of one g1 block each, the rest one worker's chains on a volume."""
    out = [
        EventBatch(WIRE_VERSION, f"forged-{s}", 1, 1, 1, [KVEvent(EventType.STORE, (1 << 40) + s, (1 << 40) + s, None, 64, "g1")])
        for s in range(sources)
    ]
    h, seq, left = 1, 1, blocks - sources
    while left > 0:
        n = min(1000, left)
        out.append(EventBatch(WIRE_VERSION, "w0", 7, seq, 1,
                              [KVEvent(EventType.STORE, h + i, h, h + i - 1 if i else None, 64, "fast") for i in range(n)]))
        h, seq, left = h + n, seq + 1, left - n
    return out


def test_bits_and_held_by_location_walk_set_bits_only() -> None:
    wide = (1 << 20_000) | (1 << 3) | 1
    assert _bits(wide) == [0, 3, 20_000]
    assert held_by_location([(7, 0b101), (9, 0b100), (11, 0)], 3) == [[7], [], [7, 9]]


def test_snapshot_export_and_import_stay_linear_in_blocks() -> None:
    for cls in (PrefixIndex, ReferencePrefixIndex):
        times = {}
        for sources in (0, SOURCES):
            idx = cls()
            for b in _batches(sources):
                idx.apply_batch(b)
            assert len(idx) == BLOCKS
            t = time.perf_counter()
            state = idx.export_state()
            again = cls.from_state(state)
            times[sources] = time.perf_counter() - t
            assert again.dump() == idx.dump()
            assert again.count_at("forged-19999/g1" if sources else "fast") == (1 if sources else BLOCKS)
        # 20,000 locations cost about what 100,000 blocks do, not 20,000 x 100,000 (was
        # minutes): a speed, so not asserted here; the walk over set bits only that keeps it
        # linear is checked exactly by test_bits_and_held_by_location_walk_set_bits_only
        print(cls.__name__, "export + import s by sources:", times)


def test_sigterm_with_20k_sources_stops_before_the_sigkill_and_the_restart_restores_the_index(tmp_path: Path) -> None:
    # the source quota (default 10,000) is raised: this test is about snapshot cost, the
    # quota's own test is tests/security/test_quotas.py
    settings = AdvisorSettings(journal_path=str(tmp_path / "journal.sqlite"), subscribe_urls=[], api_enabled=False,
                               snapshot_store="sqlite", snapshot_every_batches=0, quota_max_sources=SOURCES + 1)
    svc = AdvisorService(settings)
    svc.start()
    try:
        for b in _batches(SOURCES):
            assert svc.ingest(b)
        live = svc.index.dump()
    finally:
        t = time.perf_counter()
        svc.stop()  # what SIGTERM runs: a snapshot of the whole index, then close
        stop_s = time.perf_counter() - t
    # a deadline the product promises: the SIGTERM stop (a final snapshot) ends before the
    # SIGKILL that `kvadvisor down` sends after 20 s (docs/operations.md, docs/security.md
    # "snapshot cost per source"); measured 3.6-4.2 s with 20,000 sources on a loaded 2-core box
    assert stop_s < 20, stop_s
    t = time.perf_counter()
    again = AdvisorService(settings)
    again.start()
    try:
        start_s = time.perf_counter() - t
        print(f"20,000 sources: stop {stop_s:.2f} s, restart {start_s:.2f} s")
        assert again.index.dump() == live
        assert again.counters["snapshot_loaded_position"] > 0
    finally:
        again.stop()
    # the restart's duration is a speed (6.1 s here under load), printed above, not asserted:
    # no launcher holds it to a deadline (the index it restores is checked above)
