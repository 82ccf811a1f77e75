"""Multi-key reads that meet a moved, lost or failing block (real NIXL POSIX reads).

A batch that fails is not given up as a whole: moved keys are read at their new
placement, unchanged ones are retried on their own, and only a key that fails alone at a
placement the catalog still holds fails the call.  A segment that is gone while the
catalog still points into it is quarantined (so the block can be stored again), and so
is a block that lies past the end of a segment that was cut short (truncated).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    MediaClass,
    Placement,
    SegmentMissingError,
    SegmentTruncatedError,
    SqliteCatalog,
    StorageAgent,
    TransferError,
    VolumeDescriptor,
    VolumeKind,
)

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
NS = "feedfacefeedface"


def block(h: int, nbytes: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _agent(tmp_path: Path, name: str) -> tuple[StorageAgent, SqliteCatalog]:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    ag = StorageAgent(cat, name=name)
    for vid, media in (("fast", MediaClass.NVME), ("slow", MediaClass.HDD)):
        ag.register_volume(VolumeDescriptor(vid, VolumeKind.POSIX, media, 1 << 30, root=str(tmp_path / vid)))
    return ag, cat


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[StorageAgent, StorageAgent]]:
    """A reader and a mover: two agents (own NIXL agents, own catalog connections) on one
    catalog and the same volumes."""
    a, ca = _agent(tmp_path, "reader")
    b, cb = _agent(tmp_path, "mover")
    yield a, b
    for ag, cat in ((a, ca), (b, cb)):
        ag.close()
        cat.close()


def _stale_lookups(agent: StorageAgent, stale: int, side_effect: Callable[[], None] | None = None) -> None:
    """Make the reader's first ``stale`` catalog look-ups answer with what the catalog held
    at the first one (``side_effect`` runs right after it): a reader that looked up its
    placements just before another process changed them."""
    orig = agent.catalog.get_many
    calls: list[int] = []
    snap: dict[BlockKey, Placement | None] = {}

    def get_many(keys: Sequence[BlockKey]) -> list[Placement | None]:
        calls.append(1)
        if len(calls) == 1:
            res = orig(keys)
            snap.update(zip(keys, res))
            if side_effect is not None:
                side_effect()
            return res
        if len(calls) <= stale:
            return [snap[k] if k in snap else orig([k])[0] for k in keys]
        return orig(keys)

    agent.catalog.get_many = get_many  # type: ignore[method-assign]


def _move(agent: StorageAgent, key: BlockKey, dst: str) -> Placement:
    (p,) = agent.locate([key])
    assert p is not None
    return agent.commit_move(p, agent.copy(p, dst))


def test_one_block_moved_under_a_multi_key_get_is_read_at_its_new_placement(
    two: tuple[StorageAgent, StorageAgent],
) -> None:
    reader, mover = two
    keys = [BlockKey(NS, i) for i in range(1, 5)]
    for k in keys:  # one segment each, on one volume: one read batch
        reader.put([(k, block(k.sequence_hash))], "fast")
    old = reader.locate(keys)
    # keys[1] moves between the reader's look-up and its read; its old segment is dropped
    _stale_lookups(reader, 1, lambda: _move(mover, keys[1], "slow"))
    got = reader.get(keys)
    assert [torch.equal(g, block(k.sequence_hash)) for g, k in zip(got, keys)] == [True] * 4
    assert not os.path.exists(reader._vol("fast").path(old[1].segment_id))  # type: ignore[union-attr, attr-defined]
    assert reader.counters.read_retries == 1 and reader.counters.quarantined == 0
    assert [p.volume_id for p in reader.locate(keys)] == ["fast", "slow", "fast", "fast"]  # type: ignore[union-attr]


def test_compaction_under_a_multi_key_get_with_out_tensors(two: tuple[StorageAgent, StorageAgent]) -> None:
    reader, mover = two
    keys = [BlockKey(NS, 10 + i) for i in range(6)]
    ps = reader.put([(k, block(k.sequence_hash)) for k in keys[:3]], "fast")
    reader.put([(k, block(k.sequence_hash)) for k in keys[3:]], "fast")
    outs = [torch.empty(4096, dtype=torch.uint8) for _ in keys]
    _stale_lookups(reader, 1, lambda: mover.compact("fast", ps[0].segment_id))
    got = reader.get(keys, out=outs)
    assert all(g is o for g, o in zip(got, outs))
    assert [torch.equal(o, block(k.sequence_hash)) for o, k in zip(outs, keys)] == [True] * 6


def test_transient_batch_failure_retries_the_unchanged_keys_alone(
    two: tuple[StorageAgent, StorageAgent], monkeypatch: pytest.MonkeyPatch,
) -> None:
    reader, _ = two
    keys = [BlockKey(NS, 20 + i) for i in range(4)]
    reader.put([(k, block(k.sequence_hash)) for k in keys], "fast")
    vol = reader._vol("fast")  # type: ignore[attr-defined]
    vol.cached_read_bytes = 0  # the failure is a NIXL one: no page-cache copies first
    orig = vol.read_direct
    sizes: list[int] = []

    def flaky(segments, offsets, lengths, addrs):  # type: ignore[no-untyped-def]
        sizes.append(len(segments))
        if len(sizes) == 1:
            raise TransferError("injected: transfer ended in state 'ERR'")
        return orig(segments, offsets, lengths, addrs)

    monkeypatch.setattr(vol, "read_direct", flaky)
    got = reader.get(keys)
    assert [torch.equal(g, block(k.sequence_hash)) for g, k in zip(got, keys)] == [True] * 4
    assert sizes == [4, 1, 1, 1, 1]  # the batch, then each key on its own
    assert reader.exists(keys) == [True] * 4 and reader.counters.quarantined == 0


def test_a_truncated_segment_quarantines_only_the_blocks_past_its_end(
    two: tuple[StorageAgent, StorageAgent],
) -> None:
    reader, other = two
    good, kept, cut = BlockKey(NS, 30), BlockKey(NS, 31), BlockKey(NS, 32)
    reader.put([(good, block(30))], "fast")
    p_kept, p_cut = reader.put([(kept, block(31)), (cut, block(32))], "fast")  # one segment
    assert p_kept.segment_id == p_cut.segment_id and p_cut.offset == 4096
    path = reader._vol("fast").path(p_cut.segment_id)  # type: ignore[attr-defined]
    os.truncate(path, 4096 + 100)  # the second block is cut, the first is whole
    with pytest.raises(SegmentTruncatedError, match=r"1 block.*truncated.*segment \d+ at 4096\+4096") as ei:
        reader.get([good, kept, cut])
    assert isinstance(ei.value, SegmentMissingError) and isinstance(ei.value, TransferError)
    # only the block past the end is out of service (in the shared catalog), the rest reads
    assert reader.exists([good, kept, cut]) == [True, True, False]
    assert other.exists([good, kept, cut]) == [True, True, False]
    reasons = [(p.key, r) for p, r in reader.catalog.quarantined()]  # type: ignore[attr-defined]
    assert reasons == [(cut, "segment truncated on read")]
    assert reader.counters.quarantined == 1 and reader.counters.segments_missing == 1
    got = reader.get([good, kept])
    assert torch.equal(got[0], block(30)) and torch.equal(got[1], block(31))
    with pytest.raises(BlockNotFoundError):
        reader.get([cut])
    # the next put stores it again, in a new segment, and it reads back
    (fresh,) = other.put([(cut, block(32))], "fast")
    assert fresh.segment_id != p_cut.segment_id
    assert torch.equal(reader.get([cut])[0], block(32))


def test_a_segment_truncated_after_it_was_opened_is_quarantined_too(
    two: tuple[StorageAgent, StorageAgent],
) -> None:
    """The reader holds the segment file open (and its size) from an earlier read when
    the file is cut: the stale size must not hide the loss."""
    reader, _ = two
    keys = [BlockKey(NS, 35), BlockKey(NS, 36)]
    placed = reader.put([(k, block(k.sequence_hash)) for k in keys], "fast")
    assert [torch.equal(g, block(k.sequence_hash)) for g, k in zip(reader.get(keys), keys)] == [True, True]
    os.truncate(reader._vol("fast").path(placed[0].segment_id), 4096)  # type: ignore[attr-defined]
    with pytest.raises(SegmentMissingError):  # truncated (or, read short, a mismatch: also quarantined)
        reader.get(keys)
    assert reader.exists(keys) == [True, False]
    assert [r for _, r in reader.catalog.quarantined()] == ["segment truncated on read"]  # type: ignore[attr-defined]
    assert torch.equal(reader.get(keys[:1])[0], block(35))


def test_a_lost_segment_is_quarantined_so_the_block_is_stored_again(two: tuple[StorageAgent, StorageAgent]) -> None:
    reader, other = two
    keys = [BlockKey(NS, 40 + i) for i in range(4)]
    reader.put([(k, block(k.sequence_hash)) for k in keys[:2]], "fast")
    lost = reader.put([(k, block(k.sequence_hash)) for k in keys[2:]], "fast")
    seg = lost[0].segment_id
    os.remove(reader._vol("fast").path(seg))  # type: ignore[attr-defined]
    with pytest.raises(SegmentMissingError, match="2 block") as ei:
        reader.get(keys)
    assert isinstance(ei.value, TransferError)
    # both entries of the lost segment are out of service, the others untouched
    assert reader.exists(keys) == [True, True, False, False]
    assert other.exists(keys) == [True, True, False, False]  # shared catalog
    reasons = [(p.key, r) for p, r in reader.catalog.quarantined()]  # type: ignore[attr-defined]
    assert reasons == [(keys[2], "segment missing on read"), (keys[3], "segment missing on read")]
    assert reader.counters.segments_missing == 2 and reader.counters.quarantined == 2
    assert all(s.segment_id != seg for s in reader.segments("fast"))  # its accounting is dropped
    with pytest.raises(BlockNotFoundError):
        reader.get(keys[2:3])
    # the next put stores it again (no dedup against the dead entry) and it reads back
    (fresh,) = other.put([(keys[2], block(42))], "fast")
    assert fresh.segment_id != seg and reader.exists(keys[2:3]) == [True]
    assert torch.equal(reader.get([keys[2]])[0], block(42))
    got = reader.get(keys[:2])
    assert [torch.equal(g, block(k.sequence_hash)) for g, k in zip(got, keys[:2])] == [True, True]


def test_a_move_that_commits_after_the_first_relookup_is_not_taken_for_a_loss(
    two: tuple[StorageAgent, StorageAgent],
) -> None:
    """The reader sees the old placement at its look-up AND at its first re-look-up, finds
    the old segment gone (the move dropped it): the second look-up sees the move, so nothing
    is quarantined and the block is read at its new place."""
    reader, mover = two
    keys = [BlockKey(NS, 50), BlockKey(NS, 51)]
    for k in keys:
        reader.put([(k, block(k.sequence_hash))], "fast")
    _stale_lookups(reader, 2, lambda: _move(mover, keys[0], "slow"))
    got = reader.get(keys)
    assert [torch.equal(g, block(k.sequence_hash)) for g, k in zip(got, keys)] == [True, True]
    assert reader.counters.quarantined == 0 and reader.counters.segments_missing == 0
    assert reader.catalog.quarantined() == []  # type: ignore[attr-defined]
    assert [p.volume_id for p in reader.locate(keys)] == ["slow", "fast"]  # type: ignore[union-attr]
