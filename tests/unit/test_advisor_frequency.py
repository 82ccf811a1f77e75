"""Decayed frequency sketch, SSD-wear admission filter, and the index feeding the sketch."""

from __future__ import annotations

import pytest

from advisor.index.frequency import FrequencySettings, FrequencySketch, SsdAdmissionFilter
from advisor.index.prefix_index import PrefixIndex
from event_plane.schema import EventBatch, store


def test_sketch_counts_doorkeeper_and_ages() -> None:
    sk = FrequencySketch(FrequencySettings(width=1024, depth=4, sample_size=1000))
    assert sk.estimate(42) == 0
    sk.increment(42)  # doorkeeper only
    assert sk.estimate(42) == 1
    for _ in range(6):
        sk.increment(42)
    assert sk.estimate(42) == 7
    assert sk.estimate(43) == 0
    sk.age()
    assert sk.estimate(42) == 3  # (7 - 1 doorkeeper) >> 1, doorkeeper cleared
    assert sk.agings == 1


def test_sketch_ages_automatically_every_sample() -> None:
    sk = FrequencySketch(FrequencySettings(width=4096, sample_size=100, doorkeeper=False))
    for _ in range(60):
        sk.increment(7)
    assert sk.estimate(7) == 60
    for i in range(40):
        sk.increment(1000 + i)  # op 100 triggers aging
    assert sk.agings == 1
    assert sk.estimate(7) == 30


def test_sketch_never_undercounts_many_keys() -> None:
    sk = FrequencySketch(FrequencySettings(width=256, sample_size=10**9, doorkeeper=False))
    truth = {h * 0x9E3779B1: (h % 5) + 1 for h in range(500)}
    for h, n in truth.items():
        sk.increment(h, n)
    assert all(sk.estimate(h) >= n for h, n in truth.items())


def test_ssd_admission_needs_two_and_doubles_on_hit() -> None:
    f = SsdAdmissionFilter(min_frequency=2, sketch=FrequencySketch(FrequencySettings(sample_size=10**6)))
    f.record_store(5)
    assert not f.admit(5)
    f.record_store(5)
    assert f.admit(5)
    f.record_hit(9)  # from 0: +1
    assert f.sketch.estimate(9) == 1
    f.record_hit(9)  # doubles: 1 -> 2
    f.record_hit(9)  # 2 -> 4
    assert f.sketch.estimate(9) == 4
    f.sketch.age()
    f.sketch.age()
    assert not f.admit(9)  # decayed below 2
    assert (f.admitted, f.refused) == (1, 2)
    with pytest.raises(ValueError):
        SsdAdmissionFilter(min_frequency=0)


def test_index_feeds_sketch_with_stores_and_reported_hits() -> None:
    sk = FrequencySketch(FrequencySettings(sample_size=10**6))
    idx = PrefixIndex(frequency=sk)
    idx.apply_batch(EventBatch(version=1, source="w0", epoch=1, seq=0, ts_ns=1, events=[
        store(11, 11, None, 4096, "fast", {"hits": 2})]))
    assert sk.estimate(11) == 3
    idx.apply_batch(EventBatch(version=1, source="w1", epoch=1, seq=0, ts_ns=2, events=[store(11, 11, None, 4096, "slow"),
                                                                           store(11, 11, None, 4096, "g1")]))
    assert idx.block(11).hits == 4  # the two reported + two re-Stores as accesses
    assert sk.estimate(11) == 5
