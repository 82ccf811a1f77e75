"""Block lifecycle, handles and per-tier pools (docs/design.md §5, cases C4 and C10)."""

from __future__ import annotations

import gc

import pytest
import torch

from event_plane import EventType, KVEvent, NullPublisher
from kvbm_runtime import (
    BlockMeta,
    BlockPool,
    BlockState,
    BlockStateError,
    ConsumedHandleError,
    FullyContiguous,
    ImmutableBlock,
    LayoutConfig,
    ModelFingerprint,
    PoolExhaustedError,
    salt_hash,
    sequence_hashes,
)

CFG = LayoutConfig(num_layers=2, outer_dim=2, page_size=4, inner_dim=8, dtype=torch.float16)
SALT = salt_hash(ModelFingerprint("test/model", "float16", "FullyContiguous", 4))


class Capture:
    """A real NullPublisher whose flushed batches are collected in order."""

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher("unit-worker", on_flush=lambda batch, payload: self.batches.append(list(batch.events)))

    def events(self) -> list[tuple[str, int, int | None, str]]:
        """(type, sequence_hash, parent_hash, location) of every event flushed so far."""
        self.publisher.flush()
        return [(e.type.name, e.sequence_hash, e.parent_hash, e.storage_location) for b in self.batches for e in b]

    def clear(self) -> None:
        self.publisher.flush()
        self.batches.clear()


@pytest.fixture()
def cap() -> Capture:
    c = Capture()
    yield c
    c.publisher.close()


def make_pool(cap: Capture, blocks: int = 4, allow_duplicates: bool = False) -> BlockPool:
    return BlockPool("g1", FullyContiguous(CFG, blocks), cap.publisher, allow_duplicates=allow_duplicates)


def fill_block(pool: BlockPool, tokens: list[int], parent: BlockMeta | None = None) -> ImmutableBlock:
    (mb,) = pool.allocate(1)
    mb = mb.init_sequence(SALT, parent)
    mb.append_tokens(tokens)
    return pool.register(mb.commit())


def chain(pool: BlockPool, tokens: list[int]) -> list[ImmutableBlock]:
    out: list[ImmutableBlock] = []
    parent = None
    for i in range(0, len(tokens) - len(tokens) % 4, 4):
        h = fill_block(pool, tokens[i : i + 4], parent)
        parent = h.meta
        out.append(h)
    return out


# ---------------------------------------------------------------- transitions


def test_full_lifecycle_states_and_hash(cap: Capture) -> None:
    pool = make_pool(cap)
    (mb,) = pool.allocate(1)
    assert mb.state is BlockState.RESET
    p = mb.init_sequence(SALT)
    assert p.state is BlockState.PARTIAL and mb.consumed
    assert p.append_tokens([1, 2]) == 2
    assert p.append_tokens([3, 4]) == 0
    c = p.commit()
    assert c.state is BlockState.COMPLETE and p.consumed
    assert c.sequence_hash == sequence_hashes([1, 2, 3, 4], 4, SALT)[0]
    expected = c.sequence_hash
    imm = pool.register(c)
    assert c.consumed and imm.sequence_hash == expected
    assert imm.meta.parent_hash is None and imm.meta.prefix_hash == imm.sequence_hash
    assert pool.stats().active == 1
    assert cap.events() == [("STORE", imm.sequence_hash, None, "g1")]


def test_invalid_transitions_raise(cap: Capture) -> None:
    pool = make_pool(cap)
    a, b, c = pool.allocate(3)
    with pytest.raises(BlockStateError, match="Partial"):
        a.commit()  # Reset → commit
    with pytest.raises(BlockStateError):
        a.append_tokens([1])  # Reset → append
    with pytest.raises(BlockStateError, match="Complete"):
        pool.register(a)  # Reset → register
    p = b.init_sequence(SALT)
    with pytest.raises(BlockStateError, match="Reset"):
        p.init_sequence(SALT)  # Partial → init_sequence
    with pytest.raises(BlockStateError, match="Reset"):
        p.init_from(BlockMeta(1, None, 1, SALT))  # Partial → init_from
    p.append_tokens([1, 2, 3])
    with pytest.raises(BlockStateError, match="full"):
        p.commit()  # not full (C10: partial blocks are never registered)
    with pytest.raises(BlockStateError, match="do not fit"):
        p.append_tokens([4, 5])  # overflow: nothing appended
    assert p.tokens == (1, 2, 3)
    with pytest.raises(BlockStateError, match="Complete"):
        pool.register(p)  # Partial → register
    p.append_tokens([4])
    done = p.commit()
    with pytest.raises(BlockStateError):
        done.commit()  # Complete → commit
    with pytest.raises(BlockStateError):
        done.init_sequence(SALT)  # Complete → init_sequence
    # a parent hashed under another salt is refused
    with pytest.raises(BlockStateError, match="salt"):
        c.init_sequence(SALT, BlockMeta(5, None, 5, SALT + 1))
    # a block can never be its own parent
    with pytest.raises(BlockStateError):
        BlockMeta(7, 7, 7, SALT)
    assert cap.events() == []


def test_consumed_handles_raise(cap: Capture) -> None:
    pool = make_pool(cap)
    (mb,) = pool.allocate(1)
    p = mb.init_sequence(SALT)
    with pytest.raises(ConsumedHandleError):
        mb.init_sequence(SALT)
    with pytest.raises(ConsumedHandleError):
        _ = mb.block_id
    p.append_tokens([1, 2, 3, 4])
    c = p.commit()
    with pytest.raises(ConsumedHandleError):
        p.append_tokens([1])
    imm = pool.register(c)
    h = imm.sequence_hash
    with pytest.raises(ConsumedHandleError):
        pool.register(c)
    imm.release()
    with pytest.raises(ConsumedHandleError):
        imm.release()
    with pytest.raises(ConsumedHandleError):
        imm.clone()
    # downgrade consumes the strong handle
    (strong,) = pool.match_blocks([h])
    weak = strong.downgrade()
    with pytest.raises(ConsumedHandleError):
        _ = strong.sequence_hash
    assert weak.alive


def test_dropping_mutable_handle_returns_block_to_reset(cap: Capture) -> None:
    pool = make_pool(cap, blocks=2)
    a, b = pool.allocate(2)
    assert pool.stats().reset == 0
    p = a.init_sequence(SALT)
    del a, p
    gc.collect()
    b.release()
    assert pool.stats().reset == 2
    assert len(pool.allocate(2)) == 2


# ---------------------------------------------------------------- strong / weak handles


def test_last_strong_release_makes_block_inactive_but_matchable(cap: Capture) -> None:
    pool = make_pool(cap)
    imm = fill_block(pool, [1, 2, 3, 4])
    h = imm.sequence_hash
    twin = imm.clone()
    imm.release()
    assert pool.stats().active == 1 and pool.stats().inactive == 0
    twin.release()
    st = pool.stats()
    assert st.active == 0 and st.inactive == 1 and h in pool.resident()
    (again,) = pool.match_blocks([h])
    assert again.sequence_hash == h and pool.stats().active == 1
    del again  # dropping the handle object releases it
    gc.collect()
    assert pool.stats().inactive == 1
    assert cap.events() == [("STORE", h, None, "g1")]


def test_strong_handle_blocks_eviction(cap: Capture) -> None:
    pool = make_pool(cap, blocks=2)
    keep = fill_block(pool, [1, 2, 3, 4])
    other = fill_block(pool, [5, 6, 7, 8])
    h_other = other.sequence_hash
    other.release()
    with pytest.raises(PoolExhaustedError, match="cannot allocate 2"):
        pool.allocate(2)
    # all-or-nothing: nothing was evicted by the failed call
    assert pool.resident() == {keep.sequence_hash, h_other}
    (mb,) = pool.allocate(1)  # evicts the inactive one, never the active one
    assert pool.resident() == {keep.sequence_hash}
    assert cap.events()[-1] == ("REMOVE", h_other, None, "g1")
    mb.release()


def test_weak_handle_never_resurrects_evicted_block(cap: Capture) -> None:
    pool = make_pool(cap, blocks=1)
    imm = fill_block(pool, [1, 2, 3, 4])
    h = imm.sequence_hash
    weak = imm.weak()
    up = weak.upgrade()
    assert up is not None and up.sequence_hash == h
    up.release()
    imm.release()  # inactive: still alive, upgrade still works
    again = weak.upgrade()
    assert again is not None
    again.release()
    # evict it, then register the very same content on the same physical block
    pool.evict()
    assert not weak.alive and weak.upgrade() is None
    same = fill_block(pool, [1, 2, 3, 4])
    assert same.sequence_hash == h and same.block_id == 0
    assert weak.upgrade() is None  # a new generation, never the old handle's block
    same.release()
    assert cap.events() == [("STORE", h, None, "g1"), ("REMOVE", h, None, "g1"), ("STORE", h, None, "g1")]


# ---------------------------------------------------------------- dedup, duplicates, matching


def test_register_dedups_onto_existing_block(cap: Capture) -> None:
    pool = make_pool(cap, blocks=3)
    first = fill_block(pool, [9, 9, 9, 9])
    second = fill_block(pool, [9, 9, 9, 9])
    assert second.block_id == first.block_id and second.sequence_hash == first.sequence_hash
    st = pool.stats()
    assert st.dedup_hits == 1 and st.reset == 2 and pool.copies(first.sequence_hash) == 1
    assert cap.events() == [("STORE", first.sequence_hash, None, "g1")]  # one Store only


def test_two_copies_one_hash_publish_one_remove(cap: Capture) -> None:
    """C4: evicting the first copy publishes nothing; the second exactly one Remove."""
    pool = make_pool(cap, blocks=2, allow_duplicates=True)
    a = fill_block(pool, [3, 1, 4, 1])
    b = fill_block(pool, [3, 1, 4, 1])
    h = a.sequence_hash
    assert a.block_id != b.block_id and pool.copies(h) == 2
    a.release()
    b.release()
    cap.clear()
    assert pool.evict(1) == 1
    assert cap.events() == []
    assert pool.copies(h) == 1 and h in pool.resident()
    assert pool.evict(1) == 1
    assert cap.events() == [("REMOVE", h, None, "g1")]
    assert pool.resident() == set()
    st = pool.stats()
    assert st.stores_published == 1 and st.removes_published == 1


def test_match_blocks_stops_at_first_miss_and_scan_finds_all(cap: Capture) -> None:
    pool = make_pool(cap, blocks=6)
    handles = chain(pool, list(range(1, 21)))  # 5 blocks
    hashes = [h.sequence_hash for h in handles]
    for h in handles:
        h.release()
    pool_hashes = list(hashes)
    # drop block 2 from the pool: evict everything except 0, 1, 3, 4
    keep = [pool.match_blocks([pool_hashes[i]])[0] for i in (0, 1, 3, 4)]
    pool.evict()
    for k in keep:
        k.release()
    assert pool.resident() == {hashes[0], hashes[1], hashes[3], hashes[4]}
    matched = pool.match_blocks(hashes)
    assert [m.sequence_hash for m in matched] == hashes[:2]
    scanned = pool.scan_matches(hashes)
    assert [m.sequence_hash for m in scanned] == [hashes[0], hashes[1], hashes[3], hashes[4]]
    assert pool.match_blocks([12345] + hashes) == []


def test_eviction_is_frequency_aware_not_plain_lru(cap: Capture) -> None:
    pool = make_pool(cap, blocks=3)
    hot = fill_block(pool, [1, 1, 1, 1])
    h_hot = hot.sequence_hash
    hot.release()
    for _ in range(3):  # used 4 times in all
        pool.match_blocks([h_hot])[0].release()
    cold1 = fill_block(pool, [2, 2, 2, 2])
    cold2 = fill_block(pool, [3, 3, 3, 3])
    h1, h2 = cold1.sequence_hash, cold2.sequence_hash
    cold1.release()
    cold2.release()
    # plain LRU would evict `hot` first (least recently used); we evict the once-used ones
    assert pool.eviction_order() == [h1, h2, h_hot]
    cap.clear()
    (mb,) = pool.allocate(1)
    assert cap.events() == [("REMOVE", h1, None, "g1")]
    more = pool.allocate(2)  # mb still held: both come from evictions
    assert [e[1] for e in cap.events()] == [h1, h2, h_hot]
    assert len(more) == 2 and pool.resident() == set()


def test_register_checks_every_block_before_changing_anything(cap: Capture) -> None:
    pool = make_pool(cap, blocks=3)
    a, b = pool.allocate(2)
    a = a.init_sequence(SALT)
    a.append_tokens([1, 2, 3, 4])
    a = a.commit()
    b = b.init_sequence(SALT)  # Partial
    with pytest.raises(BlockStateError):
        pool.register_blocks([a, b])
    assert not a.consumed and pool.resident() == set()
    h = a.sequence_hash
    assert [x.sequence_hash for x in pool.register_blocks([a])] == [h]
    assert cap.events() == [("STORE", h, None, "g1")]


def test_chain_events_parent_is_sequence_predecessor(cap: Capture) -> None:
    """C10 at pool level: 10 tokens → 2 Stores; 2 more tokens → one Store with parent block 2."""
    pool = make_pool(cap, blocks=4)
    tokens = list(range(100, 110))
    handles = chain(pool, tokens)
    hashes = sequence_hashes(tokens, 4, SALT)
    assert len(handles) == 2
    tail = fill_block(pool, tokens[8:] + [110, 111], handles[-1].meta)
    full = sequence_hashes(tokens + [110, 111], 4, SALT)
    assert tail.sequence_hash == full[2]
    assert cap.events() == [
        ("STORE", hashes[0], None, "g1"),
        ("STORE", hashes[1], hashes[0], "g1"),
        ("STORE", full[2], hashes[1], "g1"),
    ]


def test_bad_batch_part_way_changes_nothing(cap: Capture) -> None:
    """Batch calls check and apply in one pass; a bad input found part-way undoes the rest."""
    pool = make_pool(cap, blocks=4)
    metas = [BlockMeta(100 + i, 99 + i if i else None, 100, SALT) for i in range(3)]
    a, b, c = pool.allocate_complete(metas)
    with pytest.raises(BlockStateError, match="appears twice"):
        pool.register_blocks([a, b, a])
    assert not a.consumed and not b.consumed and pool.resident() == set() and cap.events() == []
    handles = pool.register_blocks([a, b, c])
    assert [h.sequence_hash for h in handles] == [100, 101, 102]
    extra = handles[0].clone()
    stale = pool.match_blocks([100])[0]
    stale.release()
    with pytest.raises(ConsumedHandleError):
        pool.release_blocks([handles[0], handles[1], stale])
    assert not handles[0].consumed and not handles[1].consumed
    assert pool.stats().active == 3 and pool.eviction_order() == []
    with pytest.raises(BlockStateError, match="appears twice"):
        pool.release_blocks([handles[2], handles[2]])
    assert pool.stats().active == 3
    pool.release_blocks([*handles, extra])
    assert pool.stats().inactive == 3 and pool.eviction_order() == [101, 102, 100]  # 100 was matched: frequency 2


# ---------------------------------------------------------------- identities checked once, events trusted


@pytest.mark.parametrize(
    "args",
    [
        (-1, None, 1, SALT),
        (2**64, None, 1, SALT),
        (True, None, 1, SALT),
        (1.0, None, 1, SALT),
        ("1", None, 1, SALT),
        (5, None, -3, SALT),
        (5, 2**64, 1, SALT),
        (5, False, 1, SALT),
    ],
)
def test_block_meta_rejects_hashes_outside_u64(args: tuple) -> None:
    from kvbm_runtime import BlockMetaError

    with pytest.raises(BlockMetaError, match=r"\[0, 2\*\*64\)"):
        BlockMeta(*args)
    with pytest.raises(ValueError):  # BlockMetaError is a ValueError too
        BlockMeta(*args)


def test_pool_publishes_through_publish_encoded_and_events_round_trip(cap: Capture) -> None:
    """A pool's batch calls hand their events to ``publish_encoded`` as wire bytes (no
    KVEvent per event, no second check); what comes out of the publisher is the same
    Store / Remove stream, byte-exact on the wire."""
    from event_plane.codec import encode_event

    calls: list[str] = []
    parts: list[tuple[bytes, int]] = []
    pub = cap.publisher
    orig_enc, orig_valid, orig = pub.publish_encoded, pub.publish_valid, pub.publish
    pub.publish_encoded = lambda body, n: (  # type: ignore[method-assign]
        calls.append("encoded"), parts.append((body, n)), orig_enc(body, n)
    )[2]
    pub.publish_valid = lambda evs, max_event_bytes=None: (calls.append("valid"), orig_valid(evs, max_event_bytes))[1]  # type: ignore[method-assign]
    pub.publish = lambda evs: (calls.append("checked"), orig(evs))[1]  # type: ignore[method-assign]
    pool = make_pool(cap, blocks=2)
    hs = [2**64 - 1, 2**63, 7]
    metas = [BlockMeta(h, hs[i - 1] if i else None, hs[0], SALT) for i, h in enumerate(hs)]
    pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas[:2])))
    pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas[2:])))  # evicts one
    assert calls == ["encoded", "encoded", "encoded"]
    assert [n for _, n in parts] == [2, 1, 1]
    evs = cap.events()
    assert evs == [
        ("STORE", hs[0], None, "g1"),
        ("STORE", hs[1], hs[0], "g1"),
        ("REMOVE", hs[0], None, "g1"),
        ("STORE", 7, hs[1], "g1"),
    ]
    # each part is exactly the msgspec encoding of the events it stands for
    flat = [e for b in cap.batches for e in b]
    assert b"".join(body for body, _ in parts) == b"".join(encode_event(e) for e in flat)


def test_a_pool_whose_events_could_not_be_published_is_refused_at_construction(cap: Capture) -> None:
    """A tier name that is no valid storage_location: refused when the pool is made (it
    used to fail at the first registration, after the registry had changed); without a
    publisher any name is fine (no event carries it)."""
    for tier in ("", "x" * 256, 7):
        with pytest.raises(ValueError, match="tier must be a str of 1..255"):
            BlockPool(tier, FullyContiguous(CFG, 2), cap.publisher)  # type: ignore[arg-type]
    quiet = BlockPool("", FullyContiguous(CFG, 2))
    (h,) = quiet.register_blocks(quiet.allocate_complete([BlockMeta(1, None, 1, SALT)]))
    assert quiet.contains(1)
    h.release()
