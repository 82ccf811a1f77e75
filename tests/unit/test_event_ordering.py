"""Subscriber-side ordering rules (SeqTracker): gaps, replays, duplicates, restarts."""

from __future__ import annotations

from event_plane import EventBatch, SubscriberStats, store
from event_plane.ordering import SeqTracker


def b(seq: int, epoch: int = 1, source: str = "w0") -> EventBatch:
    return EventBatch(1, source, epoch, seq, 0, [store(seq + 1, 1, None, 1, "g1")])


class Sink:
    def __init__(self, **kw: bool) -> None:
        self.stats = SubscriberStats()
        self.out: list[tuple[str, int, int]] = []
        self.gaps: list[tuple[str, int, int, int]] = []
        self.tracker = SeqTracker(self.stats, self._deliver, lambda *g: self.gaps.append(g), **kw)

    def _deliver(self, batch: EventBatch) -> None:
        self.out.append((batch.source, batch.epoch, batch.seq))


def test_in_order_and_duplicates() -> None:
    s = Sink()
    for seq in (0, 1, 1, 2, 0, 3):
        s.tracker.accept(b(seq))
    assert [x[2] for x in s.out] == [0, 1, 2, 3]
    assert s.stats.duplicates == 2 and s.stats.gaps == 0


def test_gap_recovered_in_order_before_later_batch() -> None:
    s = Sink()
    asked: list[tuple[int, int]] = []

    def recover(source: str, epoch: int, first: int, last: int) -> list[EventBatch]:
        asked.append((first, last))
        return [b(8), b(6), b(7), b(3, epoch=99)]  # out of order + a foreign epoch

    for seq in range(6):
        s.tracker.accept(b(seq))
    s.tracker.accept(b(9), recover)
    assert asked == [(6, 8)]
    assert s.gaps == [("w0", 1, 6, 8)]
    assert [x[2] for x in s.out] == list(range(10))
    assert (s.stats.gaps, s.stats.replayed, s.stats.unrecovered) == (1, 3, 0)


def test_partial_recovery_counts_unrecovered() -> None:
    s = Sink()
    s.tracker.accept(b(0))
    s.tracker.accept(b(5), lambda *a: [b(3)])
    assert [x[2] for x in s.out] == [0, 3, 5]
    assert (s.stats.replayed, s.stats.unrecovered) == (1, 3)  # 1, 2, 4 lost
    s.tracker.accept(b(9))  # no recover function: all counted lost
    assert s.stats.unrecovered == 6 and s.stats.gaps == 2
    s.tracker.accept(b(4))  # late arrival of a lost one: too late, a duplicate
    assert s.stats.duplicates == 1 and [x[2] for x in s.out] == [0, 3, 5, 9]


def test_first_batch_above_zero_is_gap_from_zero() -> None:
    s = Sink()
    s.tracker.accept(b(3), lambda src, ep, first, last: [b(i) for i in range(first, last + 1)])
    assert s.gaps == [("w0", 1, 0, 2)]
    assert [x[2] for x in s.out] == [0, 1, 2, 3]


def test_durable_mode_starts_at_first_seen_seq() -> None:
    s = Sink(first_seq_gap=False)
    s.tracker.accept(b(3))
    s.tracker.accept(b(4))
    assert [x[2] for x in s.out] == [3, 4] and s.stats.gaps == 0


def test_restart_new_epoch_and_stale_old_epoch() -> None:
    s = Sink()
    for seq in range(3):
        s.tracker.accept(b(seq, epoch=1))
    s.tracker.accept(b(0, epoch=2))
    s.tracker.accept(b(1, epoch=2))
    s.tracker.accept(b(3, epoch=1))  # superseded epoch: dropped
    s.tracker.accept(b(2, epoch=2))
    assert s.out == [("w0", 1, 0), ("w0", 1, 1), ("w0", 1, 2), ("w0", 2, 0), ("w0", 2, 1), ("w0", 2, 2)]
    assert (s.stats.restarts, s.stats.duplicates) == (1, 1)
    assert s.tracker.position("w0") == (2, 3)


def test_sources_are_tracked_independently() -> None:
    s = Sink()
    s.tracker.accept(b(0, source="a"))
    s.tracker.accept(b(0, source="b"))
    s.tracker.accept(b(1, source="a"))
    s.tracker.accept(b(1, source="b"))
    assert s.out == [("a", 1, 0), ("b", 1, 0), ("a", 1, 1), ("b", 1, 1)] and s.stats.gaps == 0


def test_failing_recover_and_gap_callback_do_not_stop_delivery() -> None:
    stats = SubscriberStats()
    out: list[int] = []

    def bad_gap(*a: object) -> None:
        raise RuntimeError("boom")

    def bad_recover(*a: object) -> list[EventBatch]:
        raise OSError("replay down")

    t = SeqTracker(stats, lambda x: out.append(x.seq), bad_gap)
    t.accept(b(0))
    t.accept(b(3), bad_recover)
    assert out == [0, 3] and stats.unrecovered == 2


def test_pending_gap_names_the_range_accept_would_recover_and_changes_nothing() -> None:
    """A transport that fetches gaps asynchronously asks ``pending_gap`` first: it must name
    exactly the range ``accept`` then asks ``recover`` for, and ``None`` wherever ``accept``
    would not recover (in order, duplicate, implausible, superseded epoch)."""
    from event_plane.ordering import MAX_GAP

    s = Sink()
    asked: list[tuple[int, int]] = []

    def recover(source: str, epoch: int, first: int, last: int) -> list[EventBatch]:
        asked.append((first, last))
        return []

    assert s.tracker.pending_gap(b(0)) is None
    assert s.tracker.pending_gap(b(3)) == (0, 2)
    assert s.tracker.pending_gap(b(MAX_GAP + 1)) is None
    assert s.out == [] and s.stats.gaps == 0  # nothing changed
    s.tracker.accept(b(3), recover)
    assert asked == [(0, 2)]
    assert s.tracker.pending_gap(b(2)) is None and s.tracker.pending_gap(b(4)) is None
    assert s.tracker.pending_gap(b(9)) == (4, 8)
    assert s.tracker.pending_gap(b(5, epoch=2)) == (0, 4)  # a restart: a new epoch starts at 0
    s.tracker.accept(b(0, epoch=2))
    assert s.tracker.pending_gap(b(7, epoch=1)) is None  # epoch 1 is superseded
    assert s.tracker.pending_gap(b(3, source="other")) == (0, 2)
