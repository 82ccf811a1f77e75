"""The connector's G2 / volume events for the engine's KV-event stream: residency changes
(every rank) and the placement catalog's answers become Stores and Removes with the
engine's hashes, parents and token ids, in order, one medium per tier; the quotas hold."""

from __future__ import annotations

from event_plane.schema import EventType, KVEvent
from kvbm_runtime.residency import HOST, REMOVED, STORAGE, STORED, ReportingSink, ResidencyDirectory, ResidencyReport
from kvbm_runtime.tier_events import TierEventLog, volume_medium

BS = 2
HASHES = [101, 102, 103, 104]
TOKENS = list(range(1, 1 + BS * len(HASHES)))
MEDIA = {"fast": volume_medium("posix"), "archive": volume_medium("s3")}


def _rows(log: TierEventLog) -> list[tuple]:
    return [(e.op, e.medium, e.hashes, e.parent, e.token_ids) for e in log.take()]


class _Publisher:
    """The publisher a worker's sink forwards to (events kept to be read back)."""

    source = "w"

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend(events)


def test_worker_changes_become_stores_and_removes_in_order() -> None:
    sink = ReportingSink(_Publisher())
    d = ResidencyDirectory()
    log = TierEventLog(BS, MEDIA)
    log.remember(HASHES, TOKENS, range(0, 3))
    # the worker saves blocks 0-2 to G2, then 0-1 to the POSIX volume "fast", and evicts 0 from G2
    sink.publish([KVEvent(EventType.STORE, h, HASHES[0], p, 8, "g2") for h, p in zip(HASHES[:3], [None, *HASHES[:2]])])
    sink.publish([KVEvent(EventType.STORE, h, HASHES[0], None, 8, "fast") for h in HASHES[:2]])
    sink.publish([KVEvent(EventType.REMOVE, HASHES[0], HASHES[0], None, 8, "g2")])
    report = sink.take_report()
    assert report is not None and report.changes[1] == (STORED, "fast", HASHES[:2])  # the volume is named
    log.residency(d.apply(report))
    assert _rows(log) == [
        (STORED, "CPU", HASHES[:3], None, TOKENS[: 3 * BS]),  # one chain: one event
        (STORED, "DISK", HASHES[:2], None, TOKENS[: 2 * BS]),
        (REMOVED, "CPU", [HASHES[0]], None, []),
    ]
    # a Store of blocks held already changes nothing in the directory: no event
    log.residency(d.apply(ResidencyReport(0, [(STORED, HOST, HASHES[1:3]), (STORED, "fast", HASHES[:1])])))
    assert log.take() == []
    # block 3 was saved but its tokens were never listed: no Store, counted
    log.residency(d.apply(ResidencyReport(0, [(STORED, HOST, [HASHES[3]])])))
    assert log.take() == [] and log.stats.unknown_tokens == 1
    # a load found block 1 gone from storage (volume not known): Remove of what was announced
    log.residency(d.apply(ResidencyReport(0, [(REMOVED, STORAGE, [HASHES[1]])])))
    assert _rows(log) == [(REMOVED, "DISK", [HASHES[1]], None, [])]
    assert (log.stats.stored_blocks, log.stats.removed_blocks) == (5, 2)


def test_a_block_changes_only_when_every_rank_holds_it_or_one_stops() -> None:
    d = ResidencyDirectory(world_size=2)
    log = TierEventLog(BS, MEDIA)
    log.remember(HASHES, TOKENS, range(1, 2))
    log.residency(d.apply(ResidencyReport(0, [(STORED, HOST, [HASHES[1]])])))
    assert log.take() == []
    log.residency(d.apply(ResidencyReport(1, [(STORED, HOST, [HASHES[1]])])))
    assert _rows(log) == [(STORED, "CPU", [HASHES[1]], HASHES[0], TOKENS[BS : 2 * BS])]  # its parent is block 0
    log.residency(d.apply(ResidencyReport(1, [(REMOVED, HOST, [HASHES[1]])])))
    assert _rows(log) == [(REMOVED, "CPU", [HASHES[1]], None, [])]


def test_the_catalog_moves_and_drops_announced_blocks() -> None:
    d = ResidencyDirectory()
    log = TierEventLog(BS, MEDIA)
    log.remember(HASHES, TOKENS, range(0, 4))
    log.residency(d.apply(ResidencyReport(0, [(STORED, "fast", HASHES[:2])])))
    log.take()
    # the advisor demoted block 0 to S3, evicted block 1, and block 2 (another engine's save,
    # which this engine saved to G2 only) is on "fast"; block 3 the catalog does not hold
    log.catalog(HASHES, ["archive", None, "fast", None])
    assert _rows(log) == [
        (REMOVED, "DISK", [HASHES[0]], None, []),
        (STORED, "EXTERNAL", [HASHES[0]], None, TOKENS[:BS]),
        (REMOVED, "DISK", [HASHES[1]], None, []),
        (STORED, "DISK", [HASHES[2]], HASHES[1], TOKENS[2 * BS : 3 * BS]),
    ]
    log.catalog(HASHES, ["archive", None, "fast", None])  # nothing new
    assert log.take() == []
    # a block the engine never saved is not announced from the catalog
    log.catalog([999], ["fast"])
    assert log.take() == []


def test_quotas_forget_tokens_and_drop_events_beyond_them() -> None:
    d = ResidencyDirectory()
    log = TierEventLog(BS, MEDIA, max_blocks=2, max_pending=3)
    log.remember(HASHES, TOKENS, range(0, 4))  # blocks 0 and 1 are forgotten
    log.residency(d.apply(ResidencyReport(0, [(STORED, HOST, HASHES)])))
    assert _rows(log) == [(STORED, "CPU", HASHES[2:], HASHES[1], TOKENS[2 * BS :])]
    assert log.stats.unknown_tokens == 2
    # a forgotten block's Remove is still announced; on an unknown volume, for each medium
    log.residency(d.apply(ResidencyReport(0, [(REMOVED, HOST, [HASHES[0]])])))
    d.apply(ResidencyReport(0, [(STORED, STORAGE, [HASHES[1]])]))
    log.residency(d.apply(ResidencyReport(0, [(REMOVED, STORAGE, [HASHES[1]])])))
    # 3 blocks pending: the fourth event is dropped and counted
    log.residency(d.apply(ResidencyReport(0, [(REMOVED, HOST, [HASHES[2]])])))
    assert _rows(log) == [(REMOVED, "CPU", [HASHES[0]], None, []), (REMOVED, "DISK", [HASHES[1]], None, []),
                          (REMOVED, "EXTERNAL", [HASHES[1]], None, [])]
    assert log.stats.dropped_blocks == 1
