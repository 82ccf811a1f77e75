"""Hostile callers of the compiled index core (``advisor/index/_core.pyx``).

* lookup items whose ``__index__``/``__hash__`` mutate the query list (the core must not
  keep reading the list's freed storage; run in a subprocess so a crash is a failure, not
  a dead test run);
* snapshot states (``from_state``) with fields of the wrong type: rejected with
  :class:`IndexStateError` at import, never accepted and then failing (half applied) in a
  later batch.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest

from advisor.index.prefix_index import IndexStateError, PrefixIndex
from advisor.index.reference import ReferencePrefixIndex
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, remove, store

BS = 4096


def run_isolated(code: str) -> str:
    """Run ``code`` in a fresh interpreter with faulthandler; its stdout (fails on a crash)."""
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_lookup_items_that_clear_the_query_list_read_no_freed_storage() -> None:
    """An item whose ``__index__``/``__hash__`` clears the list: the core answers like the
    reference (which iterates the live list) instead of reading the freed item array."""
    out = run_isolated("""
        from advisor.index.prefix_index import PrefixIndex
        from advisor.index.reference import ReferencePrefixIndex
        from event_plane.schema import EventBatch, store
        B = 10**12
        b = EventBatch(1, "w0", 1, 0, 1, [store(B + i, B + 1, B + i - 1 if i > 1 else None, 4096, "g1")
                                          for i in range(1, 500)])
        core, ref = PrefixIndex(), ReferencePrefixIndex()
        core.apply_batch(b)
        ref.apply_batch(b)

        class Clears:
            def __init__(self, q):
                self.q = q
            def __index__(self):
                self.q.clear()
                return B + 4
            def __hash__(self):
                self.q.clear()
                return hash(B + 4)
            def __eq__(self, o):
                return o == B + 4

        def query():
            keep = [B + i for i in range(1, 400)]  # keeps the ints alive: stale reads would find them
            q = list(keep)
            q.insert(3, Clears(q))
            return q, keep

        res = []
        for idx in (ref, core):
            q, keep = query()
            res.append(idx.lookup_any(q))
            q, keep = query()
            res.append(idx.lookup(q))
            q, keep = query()  # a tuple cannot change: everything is read
            res.append(idx.lookup_any(tuple(q)))
        print(res)
        assert res[:3] == res[3:], res
        assert res[0] == 4 and res[1] == {"w0/g1": 4} and res[2] == 400, res
    """)
    assert "[4," in out


def test_lookup_odd_items_between_exact_ints_still_match_the_reference() -> None:
    """Numpy ints, integral floats and unhashable items at every position of a chunk."""
    np = pytest.importorskip("numpy")
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    b = EventBatch(1, "w0", 1, 0, 1, [store(i, 1, i - 1 if i > 1 else None, BS, "g1") for i in range(1, 200)]
                   + [store(i, 1, i - 1 if i > 1 else None, BS, "fast") for i in range(1, 90)])
    core.apply_batch(b)
    ref.apply_batch(b)
    for pos in (0, 1, 63, 64, 65, 100, 150):
        for odd in (np.uint64(pos + 1), float(pos + 1), 10**30, -1, 2.5):
            q = list(range(1, 180))
            q[pos] = odd
            assert core.lookup(q) == ref.lookup(q), (pos, odd)
            assert core.lookup_any(q) == ref.lookup_any(q), (pos, odd)
        q = list(range(1, 180))
        q[pos] = [1]
        with pytest.raises(TypeError):
            core.lookup(q)
        with pytest.raises(TypeError):
            core.lookup_any(q)


def test_lookup_item_that_adds_a_location_raises_instead_of_reading_past_the_names() -> None:
    core = PrefixIndex()
    core.apply_batch(EventBatch(1, "w0", 1, 0, 1, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1")]))

    class Grows:
        def __index__(self) -> int:
            core.apply_batch(EventBatch(1, "w0", 1, 1, 2, [store(2, 1, 1, BS, "fast")]))
            return 2

        def __hash__(self) -> int:
            return 2

    with pytest.raises(RuntimeError, match="changed during lookup"):
        core.lookup([1, Grows()])
    assert core.lookup([1, 2]) == {"w0/g1": 2}


def _state() -> list:
    idx = PrefixIndex()
    idx.apply_batch(EventBatch(1, "w0", 1, 0, 1, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1"),
                                                  store(2, 1, 1, BS, "fast"), store(4, 1, 3, BS, "fast")]))
    return idx.export_state()


@pytest.mark.parametrize("where, value", [
    ((5, "orphans"), "w0/g1"),      # a counter that later folds cannot add to
    ((5, "hits"), 1.5),
    ((5, "stores"), -1),
    ((5, "restarts"), True),
    ((4, 0, 1), "1"),               # a source's epoch
    ((4, 0, 2), 2.0),               # its last seq
    ((4, 0, 6), [[1]]),             # an unhashable retired epoch
    ((4, 0, 0), 7),                 # a source name that is not a str
    ((3, 0), -4),                   # an orphan hash
    ((2, 1), 1.5),                  # a float parent (the core truncated it to 1)
    ((2, 5), 2.5),                  # float hits
    ((2, 7 + 0), 1.0),              # a float hash
    ((2, 7 + 1), 2),                # block 2 is its own parent
    ((2, 4), [1 << 40]),            # a location bit list with a huge bit (no 2**(2**40) int)
    ((2, 4), [0, -1]),
    ((2,), 12),                     # the block array is not an array
    ((5,), [1, 2]),                 # counters that are not a map
    ((6, "fast", "w0", 0), 2.0),    # a float storer hash equal to block 2
])
def test_from_state_rejects_fields_of_the_wrong_type(where: tuple, value: object) -> None:
    state = _state()
    node = state
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    with pytest.raises(IndexStateError):
        PrefixIndex.from_state(copy.deepcopy(state))


def test_a_counter_at_u64_max_still_round_trips() -> None:
    """Counters are not bounded (only hashes, epochs and times are u64): an exported state
    whose ``stores`` passed 2**64 imports again."""
    state = _state()
    state[5]["stores"] = (1 << 64) + 3
    state[4][0][3] = (1 << 64) + 1  # events of a source
    idx = PrefixIndex.from_state(state)
    idx.apply_batch(EventBatch(1, "w0", 1, 1, 2, [remove(4, 1, 3, BS, "fast")]))
    again = PrefixIndex.from_state(idx.export_state())
    assert again.dump() == idx.dump() and again.counters.stores == (1 << 64) + 3


def test_imported_state_then_folds_like_the_reference() -> None:
    state = _state()
    core, ref = PrefixIndex.from_state(copy.deepcopy(state)), ReferencePrefixIndex.from_state(copy.deepcopy(state))
    b = EventBatch(1, "w0", 1, 1, 5, [store(3, 1, 2, BS, "g1"), remove(2, 1, 1, BS, "g1"), store(5, 1, 4, BS, "fast")])
    core.apply_batch(b)
    ref.apply_batch(b)
    assert core.dump() == ref.dump()


def test_a_fold_started_from_inside_a_fold_raises_instead_of_crashing() -> None:
    """A frequency sketch whose ``increment`` folds another batch into the same index: the
    inner call raises RuntimeError (the outer fold holds the event scratch array, which a
    big inner batch would free); the process survives and the index answers queries."""
    out = run_isolated("""
        from advisor.index.frequency import FrequencySketch
        from advisor.index.prefix_index import PrefixIndex
        from event_plane.codec import encode_batch
        from event_plane.schema import EventBatch, store

        class Reenters(FrequencySketch):
            idx = None
            errors = []
            def increment(self, h, n=1):
                super().increment(h, n)
                if self.idx is not None and not self.errors:
                    big = EventBatch(1, "w9", 1, 0, 5, [store(10**9 + i, 10**9, None, 1, "fast") for i in range(20000)])
                    try:
                        self.idx.apply_payload(encode_batch(big))
                    except RuntimeError as exc:
                        self.errors.append(str(exc))
                    try:
                        self.idx.apply_batch(big)
                    except RuntimeError as exc:
                        self.errors.append(str(exc))
                    junk = [bytes(48) for _ in range(30000)]

        f = Reenters()
        idx = PrefixIndex(f)
        f.idx = idx
        outer = EventBatch(1, "w0", 1, 0, 1, [store(i, 1, i - 1 if i > 1 else None, 4096, "g1") for i in range(1, 3000)])
        idx.apply_payload(encode_batch(outer))
        assert len(f.errors) == 2 and all("not re-entrant" in e for e in f.errors), f.errors
        assert len(idx) == 2999 and idx.lookup_any(list(range(1, 3000))) == 2999
        f.idx = None
        idx.apply_batch(EventBatch(1, "w0", 1, 1, 2, [store(5000, 1, 2999, 1, "g1")]))  # the guard is released
        print(len(idx))
    """)
    assert out.strip() == "3000"


def test_a_batch_whose_events_are_dropped_during_its_fold_keeps_its_extra_metadata() -> None:
    """The fold keeps the ``extra_metadata`` maps it points to alive: a frequency sketch that
    empties the batch's event list mid-fold (freeing the events) changes nothing."""
    out = run_isolated("""
        from advisor.index.frequency import FrequencySketch
        from advisor.index.prefix_index import PrefixIndex
        from advisor.index.reference import ReferencePrefixIndex
        from event_plane.schema import EventBatch, store

        class Clears(FrequencySketch):
            batch = None
            def increment(self, h, n=1):
                super().increment(h, n)
                if self.batch is not None:
                    self.batch.events.clear()
                    self.batch = None
                    global junk
                    junk = [{"hits": "x" * 40, "y": i} for i in range(20000)]

        def make():
            evs = [store(i, 1, i - 1 if i > 1 else None, 4096, "g1", {"hits": 2, "pad": "p" * i}) for i in range(1, 2000)]
            return EventBatch(1, "w0", 1, 0, 1, evs)

        ref = ReferencePrefixIndex(FrequencySketch())
        ref.apply_batch(make())
        f = Clears()
        core = PrefixIndex(f)
        b = make()
        f.batch = b
        core.apply_batch(b)
        assert core.dump() == ref.dump()
        print(core.counters.hits)
    """)
    assert out.strip() == str(2 * 1999)


def test_an_event_count_whose_scratch_size_overflows_is_refused_before_any_write() -> None:
    """A hand-built batch whose event list claims 2**60 events: 2**60 × 48 bytes wraps to 0
    in size_t, so the scratch array must be refused (MemoryError), not allocated at 1 byte
    and then written past (heap corruption)."""
    out = run_isolated("""
        from advisor.index.prefix_index import PrefixIndex
        from event_plane.schema import EventBatch, store

        class Lying(list):
            def __len__(self):
                return 1 << 60

        idx = PrefixIndex()
        idx.apply_batch(EventBatch(1, "w0", 1, 0, 1, [store(1, 1, None, 1, "g1")]))
        before = idx.dump()
        try:
            idx.apply_batch(EventBatch(1, "w0", 1, 1, 2, Lying([store(i, 1, None, 1, "g1") for i in range(2, 5000)])))
        except MemoryError as exc:
            print("refused", exc)
        junk = [bytes(100) for _ in range(100000)]
        assert idx.dump() == before
        idx.apply_batch(EventBatch(1, "w0", 1, 2, 3, [store(2, 1, 1, 1, "g1")]))
        print(len(idx))
    """)
    assert "refused" in out and out.strip().endswith("2")


def test_lookups_leave_the_slow_wide_path_once_no_block_holds_a_bit_above_63(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spike of 70 locations leaves 71 location names (freed bits stay as ``""``): lookups
    take the Python-int path only while some block holds a bit >= 64, not forever after
    (it made every later lookup about 2.5x slower)."""
    calls: list[int] = []
    wide = PrefixIndex._lookup_wide

    def spy(self: PrefixIndex, hashes: list) -> dict:
        calls.append(1)
        return wide(self, hashes)

    monkeypatch.setattr(PrefixIndex, "_lookup_wide", spy)
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    batches = [
        EventBatch(1, "w0", 1, 0, 1, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1")]),
        EventBatch(1, "w1", 1, 0, 2, [store(1, 1, None, BS, f"v{i}") for i in range(70)]),
    ]
    for b in batches:
        core.apply_batch(b)
        ref.apply_batch(b)
    assert core.lookup([1, 2]) == ref.lookup([1, 2]) and core.lookup([1, 2])["v69"] == 1
    assert calls  # bits 64+ are held: the wide path answers
    b = EventBatch(1, "w1", 1, 1, 3, [remove(1, 1, None, BS, f"v{i}") for i in range(70)])
    core.apply_batch(b)
    ref.apply_batch(b)
    calls.clear()
    assert len(core._loc_names) > 64
    for q in ([1, 2], [1], [2, 1], [1, 2, 3]):
        assert core.lookup(q) == ref.lookup(q)
    assert core.lookup([1, 2]) == {"w0/g1": 2}
    assert calls == []


def test_an_exception_mid_fold_leaves_counts_matching_the_masks() -> None:
    """Python code the fold calls raises half way (here a str subclass location's ``__ne__``,
    as a signal handler could): the events folded so far keep their per-location counts, so
    ``count_at`` matches ``blocks_at`` and the location's bit is not freed (and reused by
    the next new location) while blocks still hold it."""
    def check_consistent(idx: PrefixIndex) -> None:
        held: dict[str, set[int]] = {}
        for h in idx.hashes():
            for loc in idx.block(h).locations:
                held.setdefault(loc, set()).add(h)
        assert idx.stats()["blocks_per_location"] == {loc: len(s) for loc, s in sorted(held.items())}
        for loc, s in held.items():
            assert idx.blocks_at(loc) == s and idx.count_at(loc) == len(s)

    class Loc(str):
        calls = 0

        def __ne__(self, other: object) -> bool:
            Loc.calls += 1  # 1: the batch check before the fold, 2: inside the fold
            if Loc.calls == 2:
                raise KeyboardInterrupt("signal while the fold compares locations")
            return str.__ne__(self, other)

        __hash__ = str.__hash__

    idx = PrefixIndex()
    idx.apply_batch(EventBatch(1, "w0", 1, 0, 1, [store(i, 1, i - 1 if i > 1 else None, BS, "g1") for i in range(1, 4)]))
    b = EventBatch(1, "w0", 1, 1, 2, [store(1, 1, None, BS, "fast"), store(2, 1, 1, BS, "fast"),
                                     store(3, 1, 2, BS, Loc("g2"))])
    with pytest.raises(KeyboardInterrupt):
        idx.apply_batch(b)
    assert idx.blocks_at("fast") == {1, 2} and idx.count_at("fast") == 2
    check_consistent(idx)
    idx.apply_batch(EventBatch(1, "w0", 1, 2, 3, [store(7, 7, None, BS, "s3")]))  # a new location: a fresh bit
    assert idx.block(1).locations == frozenset({"w0/g1", "fast"}) and idx.blocks_at("s3") == {7}
    check_consistent(idx)


def test_init_called_again_empties_the_c_table_with_the_python_side() -> None:
    """``__init__`` on a used index resets the location names and wide masks its C records
    refer to; the records go too (a lookup read names past the new empty list: segfault)."""
    out = run_isolated("""
        from advisor.index.prefix_index import PrefixIndex
        from event_plane.schema import EventBatch, store
        idx = PrefixIndex()
        idx.apply_batch(EventBatch(1, "w0", 1, 0, 1, [store(i, 1, i - 1 if i > 1 else None, 4096, f"v{i % 70}")
                                                      for i in range(1, 3000)]))
        idx.__init__()
        assert len(idx) == 0 and idx.lookup(list(range(1, 50))) == {} and idx.block(5) is None
        assert idx.hashes() == [] and idx.dump()["blocks"] == {}
        idx.apply_batch(EventBatch(1, "w0", 1, 0, 1, [store(1, 1, None, 4096, "g1"), store(2, 1, 1, 4096, "g1")]))
        print(idx.lookup([1, 2]))
    """)
    assert out.strip() == "{'w0/g1': 2}"


_M64 = (1 << 64) - 1


def _unmix(z: int) -> int:
    """Inverse of the (public) splitmix64 finalizer: the hash a publisher would send so that
    the unkeyed finalizer maps it to ``z``."""
    def unxorshift(y: int, s: int) -> int:
        x = y
        for _ in range(64 // s + 1):
            x = y ^ (x >> s)
        return x & _M64

    z = unxorshift(z, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & _M64
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _M64
    return unxorshift(z, 30)


def test_hashes_crafted_to_collide_under_the_public_finalizer_do_not_cluster() -> None:
    """20,000 sequence hashes whose unkeyed splitmix64 values share their low 24 bits (all
    the same home slot at any table size up to 2**24): the keyed table spreads them (the
    longest probe stays short) and the fold is as fast as for ordinary hashes; unkeyed,
    every insert scanned one cluster of up to 20,000 slots (60x slower fold)."""
    crafted = [_unmix((i + 1) << 24) for i in range(20_000)]
    assert len(set(crafted)) == len(crafted)
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    for c in range(0, len(crafted), 2000):
        b = EventBatch(1, "w0", 1, c, 1, [store(h, h, None, 1, "g1") for h in crafted[c:c + 2000]])
        core.apply_payload(encode_batch(b))
        ref.apply_batch(b)
    assert core._max_probe() < 200
    assert len(core) == len(ref) == 20_000 and core.lookup_any(crafted) == 20_000
    assert core.count_at("w0/g1") == 20_000
    b = EventBatch(1, "w0", 1, 99, 2, [remove(h, h, None, 1, "g1") for h in crafted[::2]])
    core.apply_payload(encode_batch(b))
    ref.apply_batch(b)
    assert core.dump() == ref.dump() and core._max_probe() < 200
