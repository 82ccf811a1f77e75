"""Partitioned prefix index (event_plane/partition.py): the pieces of a chain, event routing
from parent links, and exactness: 8 partition indexes answer every lookup of a real trace
exactly as one index folding the same events does."""

from __future__ import annotations

import random

import pytest

from advisor.index.prefix_index import PrefixIndex
from event_plane.partition import TRUNK, ChainRouter, PartitionError, PartitionScheme, Piece, combine_lookups, partitioned_lookup
from event_plane.schema import WIRE_VERSION, EventBatch, remove, store
from kvadvisor.evaluate import load_trace
from kvadvisor.trace import bundled_trace

M64 = (1 << 64) - 1


def _u64(h: int) -> int:
    return (h * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & M64


def test_pieces_of_a_chain_follow_trunk_and_stretches() -> None:
    s = PartitionScheme(partitions=8, trunk_depth=1, stretch=2)
    chain = [_u64(i) for i in range(6)]
    got = s.pieces(chain)
    assert got == [Piece(TRUNK, 0, 1), Piece(s.partition_of_head(chain[1]), 1, 3),
                   Piece(s.partition_of_head(chain[3]), 3, 5), Piece(s.partition_of_head(chain[5]), 5, 6)]
    assert s.owners(chain) == [TRUNK] + [got[1].partition] * 2 + [got[2].partition] * 2 + [got[3].partition]
    # a chain shorter than the trunk is all trunk; no trunk at all starts a stretch at 0
    assert s.pieces(chain[:1]) == [Piece(TRUNK, 0, 1)]
    assert PartitionScheme(4, trunk_depth=0, stretch=4).pieces(chain)[0] == Piece(
        PartitionScheme(4, 0, 4).partition_of_head(chain[0]), 0, 4)


def test_scheme_refuses_impossible_parameters() -> None:
    for kw in ({"partitions": 0}, {"partitions": 5000}, {"partitions": 2, "stretch": 0},
               {"partitions": 2, "trunk_depth": -1}, {"partitions": True}):
        with pytest.raises(PartitionError):
            PartitionScheme(**kw)
    with pytest.raises(PartitionError):
        PartitionScheme(2).partition_of_head(-1)
    with pytest.raises(PartitionError):
        PartitionScheme(2).partition_of_head(1 << 64)


def test_combine_stops_a_location_at_its_first_partial_piece() -> None:
    pieces = [Piece(TRUNK, 0, 1), Piece(3, 1, 4), Piece(5, 4, 7)]
    answers = [{"a": 1, "b": 1, "c": 1}, {"a": 3, "b": 2}, {"a": 1, "b": 3, "c": 3}]
    # b stopped inside piece 2, c held none of it: neither continues into piece 3
    assert combine_lookups(pieces, answers) == {"a": 5, "b": 3, "c": 1}


def test_router_from_parent_links_matches_the_scheme_on_a_trace() -> None:
    scheme = PartitionScheme(partitions=8, trunk_depth=1, stretch=4)
    router = ChainRouter(scheme)
    for req in load_trace(bundled_trace())[:500]:
        chain = [_u64(h) for h in req]
        owners = scheme.owners(chain)
        for d, h in enumerate(chain):
            assert router.route_store(h, chain[d - 1] if d else None) == owners[d]
        assert router.route_remove(chain[-1]) == owners[-1]
    assert router.stats.unrooted == 0
    # a Store whose parent the router never saw starts a stretch of its own, counted
    assert router.route_store(_u64(10**9), _u64(10**9 + 1)) == scheme.partition_of_head(_u64(10**9))
    assert router.stats.unrooted == 1
    assert router.route_remove(_u64(10**9 + 7)) is None  # unknown: every partition


def test_router_size_bound_forgets_oldest() -> None:
    router = ChainRouter(PartitionScheme(4), max_blocks=10)
    for i in range(15):
        router.route_store(_u64(i), None)
    assert len(router) == 10 and router.stats.forgotten == 5
    assert router.route_remove(_u64(0)) is None and router.route_remove(_u64(14)) is not None


def _batch(source: str, seq: int, events: list) -> EventBatch:
    return EventBatch(WIRE_VERSION, source, 1, seq, 1_000 + seq, events)


def test_partition_indexes_answer_every_lookup_as_one_index() -> None:
    """Fold the bundled Mooncake slice as two workers' Stores (g1, and the shared volume
    ``fast``) with evictions, routed by a ChainRouter per worker into 8 partition indexes;
    one index folds the same events whole.  Every request's lookup, asked as it arrives,
    agrees location by location, and so does every block's residency at the end."""
    scheme = PartitionScheme(partitions=8, trunk_depth=1, stretch=3)
    whole = PrefixIndex()
    parts = [PrefixIndex() for _ in range(scheme.partitions)]
    routers = {w: ChainRouter(scheme) for w in ("w0", "w1")}
    seqs = {w: 0 for w in routers}
    rng = random.Random(7)
    resident: dict[str, list[tuple[int, int | None]]] = {w: [] for w in routers}
    checked = 0

    def send(worker: str, events: list, route: list[int | None]) -> None:
        whole.apply_batch(_batch(worker, seqs[worker], events))
        for p in range(scheme.partitions):  # one sub-stream per partition, same seq
            mine = [e for e, r in zip(events, route) if r in (TRUNK, None, p)]
            parts[p].apply_batch(_batch(worker, seqs[worker], mine))
        seqs[worker] += 1

    for i, req in enumerate(load_trace(bundled_trace())[:1200]):
        chain = [_u64(h) for h in req]
        w = "w0" if i % 2 == 0 else "w1"
        want = whole.lookup(chain)
        got = partitioned_lookup(scheme, chain, lambda p, hs: parts[p].lookup(hs))
        assert got == want, (i, got, want)
        checked += bool(want)
        events, route = [], []
        for d, h in enumerate(chain):
            parent = chain[d - 1] if d else None
            r = routers[w].route_store(h, parent)
            for loc in ("g1", "fast"):
                events.append(store(h, chain[0], parent, 512, loc))
                route.append(r)
            resident[w].append((h, parent))
        # evict: the worker drops a random eighth of what it holds from g1
        rng.shuffle(resident[w])
        drop, resident[w] = resident[w][: len(resident[w]) // 8], resident[w][len(resident[w]) // 8:]
        for h, parent in drop:
            events.append(remove(h, chain[0], parent, 512, "g1"))
            route.append(routers[w].route_remove(h))
        send(w, events, route)
    assert checked > 300  # the trace reuses prefixes: many lookups were non-trivial
    for h in whole.hashes():
        info = whole.block(h)
        holders = [p for p in parts if p.block(h) is not None]
        assert holders, h
        for p in holders:
            assert p.block(h).locations == info.locations
