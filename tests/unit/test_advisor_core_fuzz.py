"""Fuzzing the compiled index core (``advisor/index/_core.pyx``), bounded for the suite.

* byte-mutated wire batches (interesting msgpack header bytes, huge declared lengths, NaN
  floats, negative and > u64 ints, ext types, cuts, inserted and deleted bytes), run in a
  subprocess with faulthandler so an out-of-bounds read that crashes fails the test
  instead of killing the run: ``apply_payload`` gives ``decode_batch`` + reference
  ``apply_batch``'s state, or the same ``CodecError`` message with nothing applied;
* many sources (more than 64 private locations, so bits 64+ and freed bits reused by new
  locations), restarts, stale epochs, Cleared, removes, orphans, the frequency sketch and
  snapshot round trips: after every batch the core equals the reference and both pass an
  independent consistency check (counts, storers, orphans and children agree with the
  blocks' own locations and parents), so a bookkeeping fault shared by both shows too.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advisor.index.frequency import FrequencySketch
from advisor.index.prefix_index import PrefixIndex
from advisor.index.reference import ReferencePrefixIndex
from event_plane.codec import CodecError, decode_batch, encode_batch
from event_plane.schema import EventBatch, cleared, remove, store

BS = 4096

MUTATION_FUZZER = r'''
import random, struct, sys
from advisor.index.prefix_index import PrefixIndex
from advisor.index.reference import ReferencePrefixIndex
from event_plane.codec import CodecError, decode_batch, encode_batch
from event_plane.schema import EventBatch, cleared, remove, store

rnd = random.Random(int(sys.argv[1]))
HS = [0, 1, 2, 3, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1, 1 << 63]
LOCS = ["g1", "g2", "fast", "s3"]
HEADS = [0x00, 0x7f, 0x80, 0x8f, 0x90, 0x96, 0x97, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6,
         0xc7, 0xc8, 0xc9, 0xca, 0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xd4, 0xd8, 0xd9, 0xda, 0xdb, 0xdc,
         0xdd, 0xde, 0xdf, 0xe0, 0xff]
BLOBS = [b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdc\xff\xff", b"\xc6\x7f\xff\xff\xff",
         b"\xcb" + struct.pack(">d", float("nan")), b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
         b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", b"\xd4\x01\x02", b"\xc7\x02\x05ab", b"\x81\xa4hits\x03"]


def batch(src, epoch, seq):
    evs, prev = [], None
    for _ in range(rnd.randint(0, 10)):
        h, loc, k = rnd.choice(HS), rnd.choice(LOCS), rnd.random()
        if k < 0.6:
            evs.append(store(h, rnd.choice(HS), rnd.choice([None, prev, rnd.choice(HS), h]), rnd.choice([0, 4096]),
                             loc, rnd.choice([None] * 6 + [{"hits": 3}])))
        elif k < 0.9:
            evs.append(remove(h, h, None, 0, loc))
        else:
            evs.append(cleared(loc))
        prev = h
    return EventBatch(1, src, epoch, seq, rnd.getrandbits(64), evs)


def mutate(p):
    p = bytearray(p)
    for _ in range(rnd.randint(1, 4)):
        if not p:
            p.append(rnd.choice(HEADS))
            continue
        i, op = rnd.randrange(len(p)), rnd.random()
        if op < 0.3:
            p[i] = rnd.choice(HEADS)
        elif op < 0.45:
            p[i] = rnd.randrange(256)
        elif op < 0.6:
            del p[i:i + rnd.randint(1, 4)]
        elif op < 0.75:
            p[i:i] = bytes(rnd.choice(HEADS) for _ in range(rnd.randint(1, 4)))
        elif op < 0.85:
            p = p[:i]
        elif op < 0.93:
            p[i:i] = rnd.choice(BLOBS)
        else:
            p[i] ^= 1 << rnd.randrange(8)
    return bytes(p)


good = bad = 0
for it in range(int(sys.argv[2])):
    core, ref = PrefixIndex(), ReferencePrefixIndex()
    epochs, seqs = {"w0": 1, "w1": 7}, {"w0": 0, "w1": 0}
    for _ in range(rnd.randint(1, 6)):
        src = rnd.choice(["w0", "w1"])
        if rnd.random() < 0.1:
            epochs[src] += 1
        p = encode_batch(batch(src, epochs[src], seqs[src]))
        seqs[src] += 1
        if rnd.random() < 0.6:
            p = mutate(p)
        try:
            b = decode_batch(p)
        except CodecError as exc:
            before = core.dump()
            try:
                core.apply_payload(p)
            except CodecError as got:
                assert str(got) == str(exc), (p.hex(), str(got), str(exc))
            else:
                raise AssertionError(("accepted", p.hex()))
            assert core.dump() == before, p.hex()
            bad += 1
            continue
        assert core.apply_payload(p if rnd.random() < 0.7 else bytearray(p)) == len(b.events)
        ref.apply_batch(b)
        assert core.dump() == ref.dump(), p.hex()
        assert core.stats() == ref.stats(), p.hex()
        assert core.lookup(HS[:6]) == ref.lookup(HS[:6])
        good += 1
print("ok", good, bad)
'''


def test_mutated_payloads_never_crash_and_match_decode_batch() -> None:
    """About 1,700 batches (half of them malformed) in a faulthandler subprocess."""
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", MUTATION_FUZZER, "7", "500"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ok, good, bad = proc.stdout.split()
    assert ok == "ok" and int(good) > 300 and int(bad) > 300


def check_consistent(idx: Any) -> None:
    """Consistency of one index from its own views, independent of the other implementation."""
    d = idx.dump()
    blocks = d["blocks"]
    by_loc: dict[str, set[int]] = {}
    for h, (_parent, _prefix, _size, locs, hits, _last) in blocks.items():
        assert locs, f"block {h} is indexed with no location"
        assert 0 <= hits < 1 << 64
        for loc in locs:
            assert loc, f"block {h} has a free location bit set"
            by_loc.setdefault(loc, set()).add(h)
    st_ = idx.stats()
    assert st_["blocks"] == len(blocks) == len(idx)
    assert st_["blocks_per_location"] == {loc: len(s) for loc, s in sorted(by_loc.items())}
    for loc, s in by_loc.items():
        assert idx.blocks_at(loc) == s, loc
        assert idx.count_at(loc) == len(s), loc
        if "/" not in loc:  # a volume: every block there has a storer
            assert set(d["storers"].get(loc, {})) == s, loc
    assert set(d["storers"]) <= set(by_loc)
    assert set(d["orphans"]) == {h for h, v in blocks.items() if v[0] is not None and v[0] not in blocks}
    for h, v in blocks.items():
        if v[0] is not None:
            assert h in idx.children(v[0]), (h, v[0])
        for c in idx.children(h):
            assert blocks[c][0] == h, (h, c)


N_SRC = 40  # two private locations each: 80+ location bits
HS = list(range(1, 25))
VOLS = ["fast", "s3", "v2"]

ev = st.tuples(st.sampled_from(["store"] * 6 + ["remove"] * 4 + ["cleared"]), st.integers(0, len(HS) - 1),
               st.sampled_from(["prev", "prev", "prev", "none", "other", "self"]),
               st.sampled_from(["g1", "g1", "g2", *VOLS, " "]),
               st.sampled_from([None] * 8 + [{"hits": 2}, {"moved_from": "fast"}, {"hits": (1 << 64) - 1}]))
bt = st.tuples(st.integers(0, N_SRC - 1), st.sampled_from(["same"] * 8 + ["restart", "stale"]),
               st.lists(ev, max_size=12), st.integers(0, 30))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(bt, min_size=1, max_size=40), st.booleans(), st.booleans())
def test_many_sources_churn_stays_consistent_and_equal_to_the_reference(batches: list[tuple], freq: bool,
                                                                        snap: bool) -> None:
    core = PrefixIndex(FrequencySketch() if freq else None)
    ref = ReferencePrefixIndex(FrequencySketch() if freq else None)
    epochs = {s: [1] for s in range(N_SRC)}
    seqs = dict.fromkeys(range(N_SRC), 0)
    for i, (src, action, events, other) in enumerate(batches):
        if action == "restart":
            epochs[src].append(epochs[src][-1] + 1)
            seqs[src] = 0
        epoch = epochs[src][0] if action == "stale" else epochs[src][-1]
        evs = []
        for kind, k, par, loc, extra in events:
            h = HS[k]
            parent = {"prev": HS[k - 1] if k else None, "none": None, "other": HS[other % len(HS)], "self": h}[par]
            if kind == "store":
                evs.append(store(h, HS[0], parent, BS, loc, extra))
            elif kind == "remove":
                evs.append(remove(h, HS[0], None, BS, loc))
            else:
                evs.append(cleared(loc))
        b = EventBatch(1, f"w{src}", epoch, seqs[src], 100 + i, evs)
        seqs[src] += 1
        assert core.apply_payload(encode_batch(b)) == len(evs)
        ref.apply_batch(b)
        if snap and i % 7 == 6:
            core = PrefixIndex.from_state(core.export_state(), core.frequency)
            ref = ReferencePrefixIndex.from_state(ref.export_state(), ref.frequency)
        assert core.dump() == ref.dump()
        check_consistent(core)
        check_consistent(ref)
        q = HS[: 1 + other % len(HS)]
        assert core.lookup(q) == ref.lookup(q) and core.lookup_any(q) == ref.lookup_any(q)
    if freq:
        assert np.array_equal(core.frequency._table, ref.frequency._table)
