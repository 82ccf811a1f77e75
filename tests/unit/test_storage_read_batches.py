"""StorageAgent._batches (the grouping of a get's blocks into read batches) against the
plain reference: group by volume in order of first appearance, stable sort by (segment,
offset), cut a batch when the next block would take it past ``_READ_BATCH_BYTES``."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import pytest

import storage_backends.read_path as read_path
from storage_backends import BlockKey, Placement, StorageAgent, _readcore


def reference(places: Sequence[Placement], idx: Sequence[int]) -> Iterator[list[int]]:
    by_vol: dict[str, list[int]] = {}
    for i in idx:
        by_vol.setdefault(places[i].volume_id, []).append(i)
    for group in by_vol.values():
        group.sort(key=lambda i: (places[i].segment_id, places[i].offset))
        batch: list[int] = []
        size = 0
        for i in group:
            if batch and size + places[i].length > read_path._READ_BATCH_BYTES:
                yield batch
                batch, size = [], 0
            batch.append(i)
            size += places[i].length
        if batch:
            yield batch


@pytest.mark.parametrize("seed", range(4))
def test_batches_match_the_reference(seed: int) -> None:
    rnd = random.Random(seed)
    ranges = 0
    for _ in range(1500):
        n = rnd.randint(1, 50)
        vols = rnd.choice([["a"], ["a"], ["a", "b"], ["a", "b", "c"]])
        places = [
            Placement(BlockKey("ns", i), rnd.choice(vols), rnd.randint(1, 4), rnd.randint(0, 5) * 100,
                      rnd.choice([1, 1000, 1 << 20, 16 << 20, 40 << 20, 64 << 20, 70 << 20]), 0, 0)
            for i in range(n)
        ]
        if rnd.random() < 0.5:
            places.sort(key=lambda p: (p.volume_id, p.segment_id, p.offset))
        mode = rnd.choice(["range", "list", "subset"])
        idx: Sequence[int] = (range(n) if mode == "range" else list(range(n)) if mode == "list"
                              else sorted(rnd.sample(range(n), rnd.randint(1, n))))
        got = list(StorageAgent._batches(places, idx, _readcore.columns(places)))
        assert [list(b) for b in got] == list(reference(places, idx))
        for b in got:
            if isinstance(b, range):  # only for blocks read in their own order
                assert b.step == 1 and mode == "range"
                ranges += 1
    assert ranges > 0
