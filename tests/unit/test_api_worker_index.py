"""The per-(model, tenant) worker index: prefix scores, refcounted copies per medium, refused
orphan Stores, worker removal, and dump → load giving the same index."""

from __future__ import annotations

from api.token_hashes import local_block_hashes
from api.worker_index import WorkerIndex

BS = 4
TOK = list(range(1, 4 * BS + 1))
L = local_block_hashes(TOK, BS)


def test_scores_are_contiguous_leading_blocks_per_worker() -> None:
    idx = WorkerIndex(BS)
    assert idx.stored((1, 0), [11, 12, 13], None, L[:3]) == 3
    assert idx.stored((2, 0), [21], None, L[:1]) == 1
    # worker 3 holds blocks 0 and 2 but not 1: only block 0 counts
    idx.stored((3, 0), [31], None, L[:1])
    ov = idx.overlap(L)
    assert ov.blocks == {(1, 0): 3, (2, 0): 1, (3, 0): 1}
    assert ov.frequencies == [3, 1, 1]
    assert idx.overlap(L[1:]).blocks == {}  # block 1 without block 0 is another prefix
    assert idx.tree_sizes() == {(1, 0): 3, (2, 0): 1, (3, 0): 1}


def test_copies_are_refcounted_per_medium_and_orphans_refused() -> None:
    idx = WorkerIndex(BS)
    idx.stored((1, 0), [11, 12], None, L[:2])
    idx.stored((1, 0), [12], 11, L[1:2])  # a second GPU copy of block 1
    idx.stored((1, 0), [11], None, L[:1], medium="g2")  # offloaded copy of block 0
    assert idx.removed((1, 0), [12]) == 1
    assert idx.overlap(L).blocks == {(1, 0): 2}  # one copy of block 1 is left
    assert idx.removed((1, 0), [12, 12]) == 1 and idx.counters.unknown_removes == 1
    ov = idx.overlap(L)
    assert ov.blocks == {(1, 0): 1} and ov.tiers == {(1, 0): {"GPU": 1, "g2": 1}}
    assert idx.stored((1, 0), [99], 98, L[2:3]) == 0 and idx.counters.parent_unknown == 1
    idx.cleared((1, 0))
    assert idx.overlap(L).blocks == {} and idx.tree_sizes() == {(1, 0): 0}
    idx.remove_worker((1, 0))
    assert idx.workers() == []


def test_dump_then_load_gives_the_same_answers() -> None:
    a = WorkerIndex(BS)
    a.stored((1, 0), [11, 12, 13], None, L[:3])
    a.stored((1, 0), [11], None, L[:1], medium="g2")
    a.stored((2, 1), [21, 22], None, L[:2])
    a.removed((1, 0), [11])  # the parent's GPU copy leaves; its children stay
    b = WorkerIndex(BS)
    assert b.load(a.dump()) == 3 + 1 + 2 - 1
    assert b.overlap(L) == a.overlap(L) and b.dump() == a.dump() and b.tree_sizes() == a.tree_sizes()


def test_a_cleared_medium_leaves_the_other_media() -> None:
    """vLLM's ``AllBlocksCleared`` (a reset of its prefix cache) empties g1; the G2 and volume
    copies its connector published in the same stream still count."""
    idx = WorkerIndex(BS)
    idx.stored((1, 0), [11, 12, 13], None, L[:3], medium="g1")
    idx.stored((1, 0), [11, 12], None, L[:2], medium="g2")
    idx.stored((1, 0), [12], 11, L[1:2], medium="g2")  # a second G2 copy of block 1
    idx.stored((2, 0), [21], None, L[:1], medium="g1")
    idx.cleared((1, 0), "g1")
    ov = idx.overlap(L)
    assert ov.blocks == {(1, 0): 2, (2, 0): 1} and ov.tiers == {(1, 0): {"g2": 2}, (2, 0): {"g1": 1}}
    assert idx.tree_sizes() == {(1, 0): 2, (2, 0): 1}  # block 2 was on g1 only
    assert idx.removed((1, 0), [12], "g2") == 1 and idx.overlap(L).blocks[(1, 0)] == 2  # one copy left
    idx.cleared((1, 0))  # no medium: everything
    assert idx.overlap(L).blocks == {(2, 0): 1}
