"""Differential tests: the compiled PrefixIndex against the pure-Python reference.

Random logs (orphans, removes, Cleared of private tiers and volumes, restarts, stale
epochs, extra_metadata, invalid locations, self-parented Stores, more than 64 live
locations, snapshot round trips, the frequency sketch) must give identical ``dump()``,
``stats()``, lookups, ``blocks_at``, ``children``, ``block()`` and ``orphans()`` on
:class:`advisor.index.prefix_index.PrefixIndex` and :class:`advisor.index.reference.ReferencePrefixIndex`.
Wire payloads, well-formed, hand-encoded or mutated, must give through
``PrefixIndex.apply_payload`` either the same state as ``decode_batch`` + reference
``apply_batch``, or the same :class:`CodecError` message with nothing applied.
"""

from __future__ import annotations

import numpy as np
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advisor.index.frequency import FrequencySketch
from advisor.index.prefix_index import PrefixIndex
from advisor.index.reference import ReferencePrefixIndex
from event_plane.codec import CodecError, decode_batch, encode_batch
from event_plane.schema import EventBatch, KVEvent, cleared, remove, store

BS = 4096
HASHES = [1, 2, 3, 4, 5, 6, 7, (1 << 64) - 1, (1 << 63) + 5, 1 << 40]
LOCS = ["g1", "g1", "g2", "fast", "s3", "v3", "v66", "v69", "", " ", "x/y"]
WIDE = [f"v{i}" for i in range(70)]  # 70 volumes + private tiers: bits beyond 64
EXTRAS = [None, None, None, {"hits": 2}, {"moved_from": "fast"}, {"reconciled": True}, {"hits": (1 << 64) - 1},
          {"other": [1, 2]}]

event = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "cleared"]),
    st.sampled_from(HASHES),
    st.sampled_from([None, None, "same", "prev", *HASHES[:6]]),
    st.sampled_from(LOCS),
    st.sampled_from(EXTRAS),
    st.sampled_from([BS, BS, 0, (1 << 32) - 1]),
)
# (source, epoch action, events, snapshot round trip after it)
batch = st.tuples(st.integers(0, 2), st.sampled_from(["same", "same", "same", "restart", "stale"]),
                  st.lists(event, max_size=14), st.sampled_from([False, False, False, False, True]))


def build(batches: list[tuple], wide: bool) -> list[tuple[EventBatch, bool]]:
    """EventBatches of sources w0..w2; ``restart`` draws a new epoch, ``stale`` replays an old one."""
    epochs = {0: [1], 1: [1], 2: [1]}
    seqs = {0: 0, 1: 0, 2: 0}
    out = []
    if wide:
        evs = [store(HASHES[0], HASHES[0], None, BS, loc) for loc in WIDE]
        evs += [store(HASHES[1], HASHES[0], HASHES[0], BS, loc) for loc in WIDE[::3]]
        out.append((EventBatch(1, "w9", 5, 0, 500, evs), False))
    for i, (src, action, events, snap) in enumerate(batches):
        if action == "restart":
            epochs[src].append(epochs[src][-1] + 1)
            seqs[src] = 0
        epoch = epochs[src][0] if action == "stale" else epochs[src][-1]
        evs = []
        prev = None
        for kind, h, p, loc, extra, size in events:
            parent = h if p == "same" else prev if p == "prev" else p
            if kind == "store":
                evs.append(store(h, HASHES[0], parent, size, loc, extra))
            elif kind == "remove":
                evs.append(remove(h, HASHES[0], parent, size, loc))
            else:
                evs.append(cleared(loc))
            prev = h
        out.append((EventBatch(1, f"w{src}", epoch, seqs[src], 1_000 + i, evs), snap))
        seqs[src] += 1
    return out


def assert_same(core: PrefixIndex, ref: ReferencePrefixIndex) -> None:
    assert core.dump() == ref.dump()
    assert core.stats() == ref.stats()
    assert len(core) == len(ref)
    assert core.orphans() == ref.orphans()
    assert core.locations() == ref.locations()
    assert sorted(core.hashes()) == sorted(ref.hashes())
    locs = set(ref.locations()) | {f"w{i}/{t}" for i in range(3) for t in ("g1", "g2")} | {"fast", "nowhere"}
    for loc in sorted(locs):
        assert core.blocks_at(loc) == ref.blocks_at(loc), loc
        assert core.count_at(loc) == ref.count_at(loc), loc
    for h in HASHES + [0, 12345]:
        assert core.block(h) == ref.block(h), h
        assert core.children(h) == ref.children(h), h
        assert (h in core) == (h in ref)
        for loc in ("w0/g1", "fast", "v66"):
            assert core.holds(h, loc) == ref.holds(h, loc)
    for q in (HASHES[:5], HASHES[:1], HASHES[2:7], [HASHES[0], 999], HASHES[::-1], [], HASHES[7:]):
        assert core.lookup(q) == ref.lookup(q), q
        assert core.lookup_any(q) == ref.lookup_any(q), q
    assert {k: (v.epoch, v.last_seq, v.batches, v.events, v.last_ts_ns, v.retired_epochs)
            for k, v in core.sources().items()} == {
        k: (v.epoch, v.last_seq, v.batches, v.events, v.last_ts_ns, v.retired_epochs) for k, v in ref.sources().items()}
    if ref.frequency is not None:
        assert np.array_equal(core.frequency._table, ref.frequency._table)
        assert core.frequency._door == ref.frequency._door


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batch, min_size=1, max_size=20), st.booleans(), st.booleans(), st.booleans())
def test_random_logs_fold_identically(batches: list[tuple], wide: bool, freq: bool, via_payload: bool) -> None:
    core = PrefixIndex(FrequencySketch() if freq else None)
    ref = ReferencePrefixIndex(FrequencySketch() if freq else None)
    for b, snap in build(batches, wide):
        payload = encode_batch(b)
        try:
            decode_batch(payload)
        except CodecError:  # e.g. an empty storage_location: not on the wire, only hand-built
            with pytest.raises(CodecError):
                core.apply_payload(payload)
            via_payload = False
        if via_payload:
            assert core.apply_payload(payload) == len(b.events)
        else:
            core.apply_batch(b)
        ref.apply_batch(b)
        assert_same(core, ref)
        if snap:
            state = core.export_state()
            assert state == msgspec.msgpack.decode(msgspec.msgpack.encode(state))
            ref_state = ref.export_state()
            # Both import each other's state (block order may differ; the content may not).
            core2 = PrefixIndex.from_state(ref_state, core.frequency)
            ref2 = ReferencePrefixIndex.from_state(state, ref.frequency)
            assert_same(core2, ref2)
            core, ref = core2, ref2
    assert_same(PrefixIndex.from_state(core.export_state()), ReferencePrefixIndex.from_state(ref.export_state()))


def test_more_than_64_locations_lookup_and_bits() -> None:
    """Bits 64+ (70 volumes, 2 workers' g1/g2) answer lookups, removes and Cleared like the reference."""
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    chain = [10, 11, 12]
    for i, loc in enumerate(WIDE):
        evs = [store(h, 10, chain[k - 1] if k else None, BS, loc) for k, h in enumerate(chain[: 1 + i % 3])]
        b = EventBatch(1, f"w{i % 2}", 1, i // 2, 100 + i, evs)
        core.apply_payload(encode_batch(b))
        ref.apply_batch(b)
    b = EventBatch(1, "w0", 1, 35, 900, [store(10, 10, None, BS, "g1"), remove(11, 10, 10, BS, "v67"),
                                         cleared("v68"), store(12, 10, 11, BS, "g2")])
    core.apply_batch(b)
    ref.apply_batch(b)
    assert len(core.locations()) > 64
    assert core.lookup(chain) == ref.lookup(chain) and core.lookup(chain)["v69"] == 1
    assert_same(core, ref)
    restored = PrefixIndex.from_state(core.export_state())
    assert restored.dump() == ref.dump() and restored.lookup(chain) == ref.lookup(chain)


# ---------------------------------------------------------------- wire payloads
u64 = st.one_of(st.integers(0, 300), st.integers(0, (1 << 64) - 1), st.sampled_from([0, 127, 128, 255, 256, 65535,
                                                                                         65536, (1 << 32) - 1, 1 << 32]))
weird_int = st.one_of(u64, st.integers(-(1 << 63), -1), st.just(1.5), st.just(True), st.just("7"), st.none())
text = st.one_of(st.sampled_from(["g1", "g2", "fast", "s3", "", " ", "a/b", "é", "g1\x00", "x" * 255, "y" * 256]),
                 st.text(max_size=4))
raw_event = st.one_of(
    st.tuples(st.sampled_from([0, 0, 1, 2]), u64, u64, st.one_of(st.none(), u64), st.integers(0, (1 << 32) - 1),
              st.sampled_from(["g1", "g2", "fast"]), st.one_of(st.none(), st.just({"hits": 3}))),
    st.tuples(st.sampled_from([0, 0, 1, 2]), u64, u64, st.one_of(st.none(), u64), st.integers(0, (1 << 32) - 1),
              st.sampled_from(["g1", "g2", "fast"])),
    st.lists(st.one_of(weird_int, text, st.dictionaries(st.text(max_size=3), st.integers(-(1 << 63), (1 << 64) - 1), max_size=2)),
             min_size=0, max_size=8),
)
raw_batch = st.tuples(
    st.sampled_from([1, 1, 1, 1, 2, 0, -1]),
    st.one_of(st.sampled_from(["w0", "w1"]), text),
    st.sampled_from([1, 1, 1, 2, 0, -5]),
    u64, u64,
    st.lists(raw_event, max_size=8),
)


def fold_both(payloads: list[bytes]) -> None:
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    for p in payloads:
        try:
            b = decode_batch(p)
        except CodecError as exc:
            before = core.dump()
            with pytest.raises(CodecError) as got:
                core.apply_payload(p)
            assert str(got.value) == str(exc)
            assert core.dump() == before  # nothing applied
            continue
        assert core.apply_payload(p) == len(b.events)
        ref.apply_batch(b)
        assert_same(core, ref)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(raw_batch, min_size=1, max_size=6), st.data())
def test_hand_encoded_payloads_match_decode_batch(batches: list[tuple], data: st.DataObject) -> None:
    payloads = []
    for v, src, epoch, seq, ts, evs in batches:
        p = msgspec.msgpack.encode([v, src, epoch, seq, ts, [list(e) for e in evs]])
        if data.draw(st.booleans()):  # trailing garbage or a cut
            p = p + b"\xc0" if data.draw(st.booleans()) else p[: data.draw(st.integers(0, len(p)))]
        payloads.append(p)
    fold_both(payloads)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(batch, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=3)),
                min_size=1, max_size=8))
def test_mutated_payloads_match_decode_batch(items: list[tuple]) -> None:
    payloads = []
    for (bt, flips) in items:
        (b, _snap), = build([bt], False)
        p = bytearray(encode_batch(b))
        for pos, val in flips:
            if p:
                p[pos % len(p)] = val
        payloads.append(bytes(p))
    fold_both(payloads)


def test_non_shortest_integer_encodings_and_memoryview() -> None:
    """Decoders must accept any valid unsigned encoding (docs/events.md §2); the fast parser does."""
    def u(n: int, width: int) -> bytes:
        return {1: b"\xcc", 2: b"\xcd", 4: b"\xce", 8: b"\xcf"}[width] + n.to_bytes(width, "big")

    ev = b"\x97\x00" + u(5, 8) + u(5, 4) + b"\xc0" + u(4096, 8)[:0] + u(4096, 4) + b"\xd9\x02g1\xc0"
    ev2 = b"\x96\x00" + u(6, 2) + u(5, 1) + u(5, 8) + u(4096, 2) + b"\xda\x00\x02g1"
    p = b"\x96\x01\xd9\x02w0" + u(3, 8) + u(0, 1) + u(77, 4) + b"\xdc\x00\x02" + ev + ev2
    b = decode_batch(p)
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    assert core.apply_payload(memoryview(p)) == 2
    ref.apply_batch(b)
    assert_same(core, ref)
    assert core.lookup([5, 6]) == {"w0/g1": 2}


def test_events_are_validated_before_anything_is_applied() -> None:
    """A hand-built batch with an out-of-range field raises ValueError and applies nothing."""
    core = PrefixIndex()
    core.apply_batch(EventBatch(1, "w0", 1, 0, 10, [store(1, 1, None, BS, "g1")]))
    before = core.dump()
    bad = EventBatch(1, "w0", 1, 1, 20, [store(2, 1, 1, BS, "g1"), KVEvent(0, -3, 1, 2, BS, "g1", None)])
    with pytest.raises(ValueError, match="wire range"):
        core.apply_batch(bad)
    assert core.dump() == before


def test_common_payloads_take_the_fused_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores/Removes/Cleared with nil extra_metadata of a known epoch never call decode_batch;
    a map, a restart or a malformed payload does (and gives the reference's result)."""
    import advisor.index._core as core_mod

    calls: list[int] = []

    def spy(p: bytes) -> EventBatch:
        calls.append(1)
        return decode_batch(p)

    monkeypatch.setattr(core_mod, "decode_batch", spy)
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    batches = [
        EventBatch(1, "w0", 1, 0, 5, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1"), store(2, 1, 1, BS, "fast"),
                                      remove(1, 1, None, BS, "g1"), cleared("g2"), store(3, 3, 9, BS, "s3")]),
        EventBatch(1, "w1", 4, 0, 6, [store(1, 1, None, BS, "g2"), store(2, 1, 1, BS, "g2")]),
    ]
    for b in batches:
        core.apply_payload(encode_batch(b))
        ref.apply_batch(b)
    assert calls == []
    for b in [EventBatch(1, "w0", 1, 1, 7, [store(4, 1, 2, BS, "g1", {"hits": 3})]),  # a map
              EventBatch(1, "w1", 5, 0, 8, [store(5, 5, None, BS, "g1")])]:  # a restart
        core.apply_payload(encode_batch(b))
        ref.apply_batch(b)
    assert len(calls) == 2
    assert_same(core, ref)
    with pytest.raises(CodecError):
        core.apply_payload(b"\x96\x02")
    assert_same(core, ref)


@pytest.mark.parametrize("keys", ["sequential", "u64"])
def test_large_random_churn_matches_the_reference(keys: str) -> None:
    """Thousands of stores/removes/forgets: table growth, probe chains and backward-shift
    deletions (with wrap-around) keep every block findable, as in the reference."""
    import random

    rnd = random.Random(5)
    pool = list(range(1, 6001)) if keys == "sequential" else [rnd.getrandbits(64) for _ in range(6000)]
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    seq = {0: 0, 1: 0}
    for i in range(60):
        src = i % 2
        evs = []
        for _ in range(400):
            h = rnd.choice(pool)
            loc = rnd.choice(["g1", "g2", "fast"])
            if rnd.random() < 0.6:
                parent = rnd.choice([None, rnd.choice(pool)])
                evs.append(store(h, h, parent, BS, loc))
            else:
                evs.append(remove(h, h, None, BS, loc))
        b = EventBatch(1, f"w{src}", 1, seq[src], 10 + i, evs)
        seq[src] += 1
        core.apply_payload(encode_batch(b))
        ref.apply_batch(b)
    assert core.dump() == ref.dump()
    assert all(h in core for h in ref.hashes()) and len(core) == len(ref) > 1000
    q = [h for h in pool[:200]]
    assert core.lookup(q) == ref.lookup(q) and core.lookup_any(q) == ref.lookup_any(q)
    for h in pool[:500]:
        assert core.children(h) == ref.children(h)


def test_lookup_of_odd_hash_values_matches_the_reference() -> None:
    """Negative, too big, bool, str and unhashable items: same answers (or TypeError) as a dict."""
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    b = EventBatch(1, "w0", 1, 0, 1, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1"),
                                     store(0, 0, None, BS, "fast")])
    core.apply_batch(b)
    ref.apply_batch(b)
    for q in ([1, 3, [5]], [1, "x"], [True, 2], [1, -2], [1, 1 << 64], [0], (h for h in [1, 2]), [1] * 70 + [4],
              [1, 2, 2.0], [1.0, 2.5], [np.uint64(1), np.int64(2)], [-0.0], [float(1 << 64)]):
        q = list(q)
        assert core.lookup(q) == ref.lookup(q) and core.lookup_any(q) == ref.lookup_any(q), q
    for q in ([1, 2, [5]], [[5]]):
        with pytest.raises(TypeError):
            core.lookup(q)
        with pytest.raises(TypeError):
            ref.lookup(q)
        with pytest.raises(TypeError):
            core.lookup_any(q)
    assert core.block(0) == ref.block(0) and core.holds(0, "fast") and 0 in core
