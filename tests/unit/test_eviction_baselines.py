"""Literature baselines of the evaluator on hand-made sequences whose outcome each paper's
rules fix (docs/BENCHMARKS.md).  Single-block requests make a request's prefix hit the
block's own hit, so the per-request hit vector is the paper's hit/miss sequence."""

from __future__ import annotations

import numpy as np
import pytest

from advisor.policy.eviction import arc, belady, lfu_da, lru, prefix_lru, s3fifo, sieve
from advisor.policy.eviction.compact import compact


def singles(seq: list[int]) -> list[list[int]]:
    return [[x] for x in seq]


def run(mod: object, reqs: list[list[int]], capacity: int) -> list[int]:
    return mod.simulate(compact(reqs), capacity).tolist()  # type: ignore[attr-defined,no-any-return]


def test_compact_keeps_id_order_parents_and_next_uses() -> None:
    ct = compact([[30, 10], [30, 20], [10]])
    assert ct.n_blocks == 3 and ct.flat.tolist() == [2, 0, 2, 1, 0]
    assert ct.offsets.tolist() == [0, 2, 4, 5]
    assert ct.parent.tolist() == [2, 2, -1]  # 10 and 20 both follow 30
    assert ct.next_use().tolist() == [1, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="request 1"):
        compact([[1], [2**64]])


def test_lru() -> None:
    # cap 3: 4 evicts 2 (the least recent after 1's hit), so 2 misses at the end
    assert run(lru, singles([1, 2, 3, 1, 4, 1, 2]), 3) == [0, 0, 0, 1, 0, 1, 0]


def test_arc_scan_resistance_and_ghost_adaptation() -> None:
    # Megiddo & Modha, Fig. 4, c = 2.  1 is referenced twice -> T2.  The scan 2, 3, 4 only
    # cycles T1 (REPLACE takes T1's LRU while |T1| > p = 0), so 1 still hits (LRU: miss).
    # 3 then hits in B1: p becomes 1 and REPLACE takes T2's LRU (1) into B2; 4 (T1) hits;
    # 1 is a ghost hit in B2 (a miss).
    seq = [1, 1, 2, 3, 4, 1, 3, 4, 1]
    assert run(arc, singles(seq), 2) == [0, 1, 0, 0, 0, 1, 0, 1, 0]
    assert run(lru, singles(seq), 2)[5] == 0


def test_lfu_da_dynamic_aging_evicts_an_old_frequent_block() -> None:
    # Arlitt et al.: K = F + L, L = key of the last victim, c = 2, victims chosen before
    # the missed block is admitted.  1 reaches K=2; 3 evicts 2 (K=1; L=1) and enters with
    # K=1+1=2; 2 comes back and the oldest K=2 block, the twice-used 1, goes (L=2): the
    # aging at work (plain LFU would keep 1).  3 hits (K=4); 1 misses and evicts 2 (K=3).
    seq = [1, 1, 2, 3, 2, 3, 1, 3]
    assert run(lfu_da, singles(seq), 2) == [0, 1, 0, 0, 0, 1, 0, 1]


def test_s3fifo_quick_demotion_keeps_a_block_hit_in_the_small_queue() -> None:
    # Yang et al., SOSP '23: tier 10 -> S = 1 slot, M = 9.  1..10 fill S; 1 is hit once, so
    # when 11 needs room the tail of S (1) moves to M and 2 goes to the ghost queue; the
    # scan 12..20 only passes through S, and 1 hits again (LRU has evicted it).
    seq = list(range(1, 11)) + [1] + list(range(11, 21)) + [1]
    want = [0] * 10 + [1] + [0] * 10 + [1]
    assert run(s3fifo, singles(seq), 10) == want
    assert run(lru, singles(seq), 10)[-1] == 0
    # a ghost hit goes to M: 11 pushes 1 (never hit) out of S into G; 1 comes back from G
    # straight into M and survives the scan 12..21 that only passes through S
    seq2 = list(range(1, 12)) + [1] + list(range(12, 22)) + [1]
    assert run(s3fifo, singles(seq2), 10) == [0] * 22 + [1]
    assert run(lru, singles(seq2), 10)[-1] == 0


def test_sieve_hand_skips_visited_and_stays() -> None:
    # Zhang et al., NSDI '24, cap 3: queue 3,2,1; 1 is visited.  4: the hand clears 1's
    # bit and evicts 2, stopping at 3; 5 evicts 3, 6 evicts 4; 1 is still cached.
    assert run(sieve, singles([1, 2, 3, 1, 4, 5, 6, 1]), 3) == [0, 0, 0, 1, 0, 0, 0, 1]
    assert run(lru, singles([1, 2, 3, 1, 4, 5, 6, 1]), 3)[-1] == 0


def test_prefix_lru_evicts_the_least_recent_leaf() -> None:
    # cap 3: [1,2] then [3] then [4]: plain LRU evicts 1 (oldest) and loses the prefix;
    # leaf-first LRU evicts 2 (the oldest leaf) and keeps 1, a 1-block hit later.
    reqs = [[1, 2], [3], [4], [1, 2]]
    assert run(prefix_lru, reqs, 3) == [0, 0, 0, 1]
    assert run(lru, reqs, 3) == [0, 0, 0, 0]


def test_belady_evicts_farthest_next_use() -> None:
    # cap 2: after [1],[2],[3] Belady keeps the blocks used next (1 at r3, 2 at r4)
    reqs = singles([1, 2, 3, 1, 2, 3])
    assert run(belady, reqs, 2) == [0, 0, 0, 1, 1, 0]


@pytest.mark.parametrize("mod", [lru, arc, lfu_da, s3fifo, sieve, prefix_lru, belady])
def test_unbounded_tier_hits_every_seen_prefix(mod: object) -> None:
    rng = np.random.default_rng(3)
    reqs = [[int(r), int(r) * 100 + 1, int(r) * 100 + 2] for r in rng.integers(0, 30, size=200)]
    seen: set[int] = set()
    want = 0
    for r in reqs:
        want += next((i for i, h in enumerate(r) if h not in seen), len(r))
        seen.update(r)
    assert sum(run(mod, reqs, 10_000)) == want


@pytest.mark.parametrize("mod", [lru, arc, lfu_da, s3fifo, sieve, prefix_lru, belady])
def test_hits_never_exceed_belady_bound_at_one_block(mod: object) -> None:
    # one block of tier: only a request repeating the previous request's first block can hit
    reqs = singles([1, 1, 2, 2, 2, 3, 1])
    assert run(mod, reqs, 1) == [0, 1, 0, 1, 1, 0, 0]
