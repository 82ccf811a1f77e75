"""Hostile input for the compiled event encoder (``event_plane._fastenc``) and the publisher
paths that take its bytes.

Anything that could crash the interpreter runs in a subprocess (``python -X faulthandler``),
so a segfault fails the test instead of killing the test run.
"""

from __future__ import annotations

import subprocess
import threading
import time
import sys
import textwrap

import msgspec
import pytest

from event_plane import KVEvent, NullPublisher, PublisherConfig, decode_batch, encode_batch
from event_plane._fastenc import encode_meta_events, event_tail, make_meta_events
from event_plane.errors import InvalidEventError
from event_plane.codec import encode_event
from kvbm_runtime import BlockMeta

TAIL = event_tail(4096, "g1")


def _run(code: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh interpreter with faulthandler on; return its stdout.

    Fails the test if the interpreter dies (segfault, abort) or exits non-zero."""
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.stdout


_PRELUDE = """
from event_plane._fastenc import encode_meta_events, event_tail, make_meta_events
from event_plane.errors import InvalidEventError
from event_plane import KVEvent, NullPublisher, PublisherConfig, decode_batch, encode_batch
from kvbm_runtime import BlockMeta
tail = event_tail(4096, "g1")
"""


def test_getattr_that_empties_the_list_being_encoded_does_not_crash() -> None:
    # A property read on the getattr fallback path clears the list: the items after it are
    # gone (their memory freed); the encoder must notice, not read freed slots.
    out = _run(
        _PRELUDE
        + """
L = []
class M:
    def __init__(s, i): s.i = i
    @property
    def sequence_hash(s):
        L.clear(); return s.i
    prefix_hash = 1
    parent_hash = None
L.extend(M(i) for i in range(20000))
for fn in (lambda: encode_meta_events(0, L, tail), lambda: make_meta_events(KVEvent, 0, L, 4096, "g1")):
    L[:] = [M(i) for i in range(20000)]
    try:
        fn()
        print("no error")
    except RuntimeError as e:
        print("RuntimeError", "changed size" in str(e))
"""
    )
    assert out.split("\n")[:2] == ["RuntimeError True", "RuntimeError True"], out


def test_metaclass_getattribute_that_mutates_the_list_does_not_crash() -> None:
    # Learning a class's slot layout must run no Python code (a metaclass __getattribute__
    # could empty the list mid-encoding).
    out = _run(
        _PRELUDE
        + """
L = []
class Meta(type):
    def __getattribute__(cls, name):
        L.clear()
        return type.__getattribute__(cls, name)
class M(metaclass=Meta):
    __slots__ = ("sequence_hash", "prefix_hash", "parent_hash")
    def __init__(s, i): s.sequence_hash = i; s.prefix_hash = 1; s.parent_hash = None
L.append(BlockMeta(1, None, 1, 0))
L.extend(M(i) for i in range(20000))
body = encode_meta_events(0, L, tail)
print(len(L), body == b"".join(encode_meta_events(0, [m], tail) for m in [BlockMeta(1, None, 1, 0)] + [M(i) for i in range(20000)]))
"""
    )
    assert out.strip() == "20001 True", out


def test_member_descriptor_of_another_class_is_not_read_at_its_offset() -> None:
    # BlockMeta's slot descriptors copied onto a class of another layout (a 16-byte object:
    # BlockMeta's slots lie past its end): getattr refuses them (TypeError: the descriptor
    # does not apply), and so must the encoder, without reading past the object (segfault).
    # Likewise a metaclass whose __mro__ lies about the bases.
    out = _run(
        _PRELUDE
        + """
import struct
d = BlockMeta.__dict__
class Evil:
    __slots__ = ()
    sequence_hash = d["sequence_hash"]
    prefix_hash = d["prefix_hash"]
    parent_hash = d["parent_hash"]
class Meta(type):
    @property
    def __mro__(cls):
        return (BlockMeta, object)
class Liar(metaclass=Meta):
    __slots__ = ()
for cls in (Evil, Liar):
    objs, junk = [], []
    for i in range(5000):  # interleaved with blocks full of non-pointer bits
        objs.append(cls())
        junk.append(struct.pack("<QQQ", 0x4141414141414141, 0x4242424242424242, 0x4343434343434343))
    for fn in (lambda: encode_meta_events(0, objs, tail), lambda: make_meta_events(KVEvent, 0, objs, 4096, "g1")):
        try:
            fn()
            print("no error")
        except (TypeError, AttributeError) as e:
            print(type(e).__name__)
"""
    )
    assert out.split() == ["TypeError", "TypeError", "AttributeError", "AttributeError"], out


@pytest.mark.parametrize("call", ["tail", "metas", "make"])
def test_none_for_a_typed_argument_is_a_type_error(call: str) -> None:
    # Cython lets None through a ``bytes`` / ``list`` argument unless told not to: the
    # encoder then read the size of None (past its end) and wrote events without a tail.
    meta = BlockMeta(1, None, 1, 0)
    with pytest.raises(TypeError):
        if call == "tail":
            encode_meta_events(0, [meta] * 100, None)  # type: ignore[arg-type]
        elif call == "metas":
            encode_meta_events(0, None, TAIL)  # type: ignore[arg-type]
        else:
            make_meta_events(KVEvent, 0, None, 4096, "g1")  # type: ignore[arg-type]


def test_class_changed_after_its_layout_was_learned_is_read_as_getattr_reads_it() -> None:
    # The encoder caches the slot layout of the last class it saw; a property set on that
    # class afterwards must win, as it does for getattr (msgspec of the KVEvent).
    class Sub(BlockMeta):
        pass

    s = Sub(5, None, 5, 0)
    assert encode_meta_events(0, [s], TAIL) == encode_event(KVEvent(0, 5, 5, None, 4096, "g1"))
    Sub.sequence_hash = property(lambda self: 7)  # type: ignore[assignment,method-assign]
    assert encode_meta_events(0, [s], TAIL) == encode_event(KVEvent(0, 7, 5, None, 4096, "g1"))
    assert make_meta_events(KVEvent, 0, [s], 4096, "g1")[0].sequence_hash == 7
    del Sub.sequence_hash
    assert encode_meta_events(0, [s], TAIL) == encode_event(KVEvent(0, 5, 5, None, 4096, "g1"))


def test_unset_none_bool_subclass_negative_and_huge_hashes() -> None:
    class IntSub(int):
        pass

    class Slots:
        __slots__ = ("sequence_hash", "prefix_hash", "parent_hash")

    unset = Slots()
    with pytest.raises(AttributeError):
        encode_meta_events(0, [unset], TAIL)
    m = Slots()
    m.sequence_hash, m.prefix_hash, m.parent_hash = 1, 1, None  # None is a first block's parent
    assert encode_meta_events(1, [m], TAIL) == encode_event(KVEvent(1, 1, 1, None, 4096, "g1"))
    for bad, exc in ((None, TypeError), (True, TypeError), (IntSub(3), TypeError), (-1, OverflowError), (1 << 64, OverflowError), (1 << 200, OverflowError), (-(1 << 70), OverflowError)):
        m = Slots()
        if bad is not None:
            m.sequence_hash, m.prefix_hash, m.parent_hash = 1, 1, bad
            with pytest.raises(exc):
                encode_meta_events(1, [BlockMeta(2, None, 2, 0), m], TAIL)
        m.sequence_hash, m.prefix_hash, m.parent_hash = bad, 1, None
        with pytest.raises(exc):
            encode_meta_events(1, [m], TAIL)


def test_every_width_boundary_in_every_field_with_long_tails() -> None:
    # all of the three hashes at every msgpack width boundary at once (the largest event
    # the buffer estimate must hold), with a 255-character location
    edges = [0, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x100000000, (1 << 64) - 1]
    for loc in ("g", "x" * 31, "x" * 32, "x" * 255):
        tail = event_tail(0xFFFFFFFF, loc)
        metas = []
        for a in edges:
            for b in edges:
                metas.append(BlockMeta(a, None if a == b else b, b, 0))
                metas.append(BlockMeta(b, a if a != b else None, a, 0))
        want = b"".join(
            encode_event(KVEvent(1, m.sequence_hash, m.prefix_hash, m.parent_hash, 0xFFFFFFFF, loc)) for m in metas
        )
        assert encode_meta_events(1, metas, tail) == want
        assert msgspec.msgpack.decode(b"\xdc" + len(metas).to_bytes(2, "big") + want, type=list[KVEvent]) == [
            KVEvent(1, m.sequence_hash, m.prefix_hash, m.parent_hash, 0xFFFFFFFF, loc) for m in metas
        ]


# ------------------------------------------------------------------ publisher: limits, seqs, errors


class _Recorder(NullPublisher):
    """A real publisher whose transport keeps what it was handed (seq, count, payload),
    through the payload-only hook the ZMQ and NATS transports use."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.sent: list[tuple[int, int, bytes]] = []

    @property
    def wants_events(self) -> bool:
        """Its transport keeps the batches: events are wanted (pools send them)."""
        return True

    def _send_payload(self, seq: int, count: int, payload: bytes) -> None:
        self.sent.append((seq, count, payload))


def _event_bytes(events: list[KVEvent]) -> int:
    return sum(len(encode_event(e)) for e in events)


@pytest.mark.parametrize("with_on_flush", [False, True])
def test_threads_mixing_every_entry_point_keep_limits_seqs_and_order(with_on_flush: bool) -> None:
    """Four threads, each using publish / publish_valid (with and without a size bound) /
    publish_encoded in turn, against small limits: every batch within max_events and
    max_bytes, seqs 0..N-1 in send order, every event exactly once, each thread's events in
    its own order, and payloads byte-identical to encode_batch of what they decode to."""
    tail = event_tail(4096, "g1")
    big = len(encode_event(KVEvent(1, 2**64 - 1, 2**64 - 1, 2**64 - 1, 4096, "g1")))
    cfg = PublisherConfig(max_events=7, max_bytes=5 * big + 3, max_delay_s=0.002)
    flushed: list[tuple[int, bytes]] = []
    pub = _Recorder(
        "w-threads", config=cfg, on_flush=(lambda b, p: flushed.append((b.seq, p))) if with_on_flush else None
    )
    n_threads, rounds = 4, 150

    def work(t: int) -> None:
        for r in range(rounds):
            k = 1 + (r * 7 + t) % 9  # 1..9 events: some calls exceed max_events
            # widths vary so byte limits bite at different counts
            metas = [BlockMeta((t << 56) | (r << 8) | i | (1 << (8 * (i % 7))), None, 1 << (i % 64), 0) for i in range(k)]
            evs = [KVEvent(r % 2, m.sequence_hash, m.prefix_hash, None, 4096, "g1") for m in metas]
            mode = (r + t) % 4
            if mode == 0:
                pub.publish(evs)
            elif mode == 1:
                pub.publish_valid(evs)
            elif mode == 2:
                pub.publish_valid(evs, big)
            else:
                pub.publish_encoded(encode_meta_events(r % 2, metas, tail), k)
            if r % 37 == 0:
                pub.flush()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pub.close()

    assert [s for s, _, _ in pub.sent] == list(range(len(pub.sent)))
    if with_on_flush:
        assert flushed == [(s, p) for s, _, p in pub.sent]
    per_thread: dict[int, list[int]] = {t: [] for t in range(n_threads)}
    total = 0
    for seq, count, payload in pub.sent:
        batch = decode_batch(payload)
        assert batch.seq == seq and len(batch.events) == count
        assert 1 <= count <= cfg.max_events
        assert _event_bytes(batch.events) <= cfg.max_bytes
        assert encode_batch(batch) == payload
        for e in batch.events:
            per_thread[e.sequence_hash >> 56].append(e.sequence_hash)
        total += count
    want_total = 0
    for t in range(n_threads):
        want = []
        for r in range(rounds):
            k = 1 + (r * 7 + t) % 9
            want += [(t << 56) | (r << 8) | i | (1 << (8 * (i % 7))) for i in range(k)]
        want_total += len(want)
        assert per_thread[t] == want
    assert total == want_total
    st = pub.stats()
    assert st.events == want_total and st.batches == len(pub.sent) and st.dropped == 0


@pytest.mark.parametrize("count", [-1, -100, True, 1.0, "3", None])
def test_publish_encoded_refuses_a_bad_count_and_keeps_the_pending_batch(count: object) -> None:
    tail = event_tail(64, "g1")
    pub = _Recorder("w0", config=PublisherConfig(max_events=10, max_delay_s=60.0))
    ms = [BlockMeta(10 + i, None, 10 + i, 0) for i in range(3)]
    pub.publish_encoded(encode_meta_events(0, ms[:2], tail), 2)  # pending: 2 events
    with pytest.raises((TypeError, ValueError)):
        pub.publish_encoded(encode_meta_events(0, ms[2:], tail), count)  # type: ignore[arg-type]
    pub.close()
    assert [(s, c) for s, c, _ in pub.sent] == [(0, 2)]
    assert decode_batch(pub.sent[0][2]).events == [KVEvent(0, m.sequence_hash, m.prefix_hash, None, 64, "g1") for m in ms[:2]]
    assert pub.stats().events == 2


@pytest.mark.parametrize("count", [-1, True, 2.5, None])
def test_skip_events_refuses_a_bad_count(count: object) -> None:
    pub = NullPublisher("w0")
    pub.skip_events(3)
    with pytest.raises((TypeError, ValueError)):
        pub.skip_events(count)  # type: ignore[arg-type]
    assert pub.stats().events == 3


def test_a_bad_encoded_part_on_a_read_publisher_is_refused_whole_not_at_the_flush() -> None:
    """With an on_flush callback the batch's events are read: a part whose bytes are not
    ``count`` events used to be taken (fast path), then the flush failed to decode the
    payload after its seq was drawn: a seq gap, the other producers' events of that batch
    lost, the error raised to whoever flushed.  It must be refused when handed over."""
    tail = event_tail(64, "g1")
    seen: list[tuple[int, int]] = []
    pub = _Recorder(
        "w0", config=PublisherConfig(max_events=10, max_delay_s=60.0), on_flush=lambda b, p: seen.append((b.seq, len(b.events)))
    )
    ms = [BlockMeta(10 + i, None, 10 + i, 0) for i in range(4)]
    pub.publish_encoded(encode_meta_events(0, ms[:2], tail), 2)
    body = encode_meta_events(0, ms[2:], tail)
    for bad, count in ((body, 1), (body, 3), (body[:-1], 2), (body + b"\xc0", 2), (b"\x97\x05" + body[2:], 2)):
        with pytest.raises(InvalidEventError):
            pub.publish_encoded(bad, count)
    pub.flush()
    pub.publish_encoded(body, 2)
    pub.close()
    assert [(s, c) for s, c, _ in pub.sent] == [(0, 2), (1, 2)]
    assert seen == [(0, 2), (1, 2)]
    events = [e for _, _, p in pub.sent for e in decode_batch(p).events]
    assert events == [KVEvent(0, m.sequence_hash, m.prefix_hash, None, 64, "g1") for m in ms]
    st = pub.stats()
    assert st.events == 4 and st.batches == 2 and st.dropped == 0


# ------------------------------------------------------------------ pools: nothing half-published


def test_register_blocks_whose_stores_cannot_be_encoded_changes_nothing() -> None:
    """An identity that is not a checked BlockMeta (a duck-typed one with a numpy hash, as
    a caller might build) cannot be encoded: register_blocks used to raise only after the
    blocks were registered and their handles consumed, so the pool held blocks no Store
    ever announced.  Now nothing changes: the handles stay live and Complete, nothing is
    registered or sent, and the good blocks register afterwards."""
    import numpy as np
    import torch

    from kvbm_runtime import BlockPool, LayoutConfig
    from kvbm_runtime.layout import FullyContiguous

    cfg = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)
    pub = _Recorder("w-pool", config=PublisherConfig(max_events=100, max_delay_s=60.0))
    pool = BlockPool("g2", FullyContiguous(cfg, 4), pub)
    good = BlockMeta(1000, None, 1000, 0)

    class Duck:
        __slots__ = ("sequence_hash", "prefix_hash", "parent_hash", "salt")

        def __init__(self, h: object) -> None:
            self.sequence_hash, self.prefix_hash, self.parent_hash, self.salt = h, h, None, 0

    handles = pool.allocate_complete([good, Duck(np.uint64(2000))])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sequence_hash must be an int"):
        pool.register_blocks(handles)
    assert [h.consumed for h in handles] == [False, False]
    assert not pool.contains(1000) and not pool.contains(2000)
    assert pool.stats().stores_published == 0
    pub.flush()
    assert pub.sent == []
    [imm] = pool.register_blocks(handles[:1])
    assert pool.contains(1000) and pool.stats().stores_published == 1
    pub.flush()
    assert [e.sequence_hash for _, _, p in pub.sent for e in decode_batch(p).events] == [1000]


def test_close_racing_publishers_loses_no_accepted_event_and_leaves_no_seq_gap() -> None:
    """Threads publish (encoded parts, lazily queued events, checked events) until the
    publisher refuses them; another thread flushes; the main thread closes.  Every call
    that returned normally had its events sent, exactly once, in seqs 0..N-1."""
    from event_plane.errors import PublisherClosedError

    tail = event_tail(4096, "g1")
    big = len(encode_event(KVEvent(1, 2**64 - 1, 2**64 - 1, 2**64 - 1, 4096, "g1")))
    pub = _Recorder("w-close", config=PublisherConfig(max_events=5, max_bytes=4 * big, max_delay_s=0.001))
    accepted = [0, 0, 0]
    stop = threading.Event()

    def work(t: int) -> None:
        r = 0
        while True:
            k = 1 + r % 4
            metas = [BlockMeta((t << 60) | (r << 4) | i, None, 1, 0) for i in range(k)]
            evs = [KVEvent(0, m.sequence_hash, 1, None, 4096, "g1") for m in metas]
            try:
                if t == 0:
                    pub.publish_encoded(encode_meta_events(0, metas, tail), k)
                elif t == 1:
                    pub.publish_valid(evs, big)
                else:
                    pub.publish(evs)
            except PublisherClosedError:
                return
            accepted[t] += k
            r += 1

    def flusher() -> None:
        while not stop.is_set():
            pub.flush()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)] + [threading.Thread(target=flusher)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    pub.close()
    stop.set()
    for th in threads:
        th.join(10)
    assert [s for s, _, _ in pub.sent] == list(range(len(pub.sent)))
    got = [e.sequence_hash for _, _, p in pub.sent for e in decode_batch(p).events]
    assert len(got) == len(set(got)) == sum(accepted) > 0
    for t in range(3):
        mine = [h for h in got if h >> 60 == t]
        assert mine == sorted(mine) and len(mine) == accepted[t]


def test_fuzz_mixed_classes_and_values_in_a_subprocess() -> None:
    """Random lists mixing BlockMeta, a subclass, other __slots__ layouts, plain objects,
    unset slots and bad values, with classes changed between calls: the encoder either
    returns msgspec's bytes of the equivalent KVEvents or raises TypeError / OverflowError /
    AttributeError, and never crashes (subprocess with faulthandler)."""
    out = _run(
        _PRELUDE
        + """
import random
from event_plane.codec import encode_event
rnd = random.Random(1234)
class Sub(BlockMeta):
    pass
class Slots3:
    __slots__ = ("parent_hash", "prefix_hash", "sequence_hash")
class Slots5:
    __slots__ = ("x", "sequence_hash", "y", "parent_hash", "prefix_hash")
class Plain:
    pass
EDGES = [0, 1, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, 0xFFFFFFFF, 2**32, 2**63, 2**64 - 1]
def value(allow_none):
    r = rnd.random()
    if r < 0.85:
        return rnd.choice(EDGES) if rnd.random() < 0.5 else rnd.getrandbits(rnd.choice([7, 16, 31, 32, 61, 64]))
    if allow_none and r < 0.9:
        return None
    return rnd.choice([-1, 2**64, 2**100, True, 1.0, "1", None, bytearray(b"x")])
def item():
    s, p, par = value(False), value(False), value(True)
    k = rnd.randrange(6)
    ok = all(type(v) is int and 0 <= v < 2**64 for v in (s, p)) and (par is None or (type(par) is int and 0 <= par < 2**64))
    if k in (0, 1) and ok and par != s:
        return (BlockMeta if k == 0 else Sub)(s, par, p, 0), (s, p, par)
    o = rnd.choice([Slots3, Slots5, Plain])()
    if rnd.random() < 0.05:
        return o, None  # unset
    o.sequence_hash, o.prefix_hash, o.parent_hash = s, p, par
    return o, ((s, p, par) if ok else None)
n_ok = n_err = 0
for it in range(3000):
    if it % 97 == 0:
        Sub.flag = it  # a class change: its cached layout must be re-learned
    items = [item() for _ in range(rnd.randrange(0, 12))]
    objs = [o for o, _ in items]
    kind = rnd.randrange(2)
    try:
        got = encode_meta_events(kind, objs, tail)
    except (TypeError, OverflowError, AttributeError):
        assert any(w is None for _, w in items), items
        n_err += 1
        continue
    assert all(w is not None for _, w in items), items
    want = b"".join(encode_event(KVEvent(kind, s, p, par, 4096, "g1")) for _, (s, p, par) in items)
    assert got == want, (items, got, want)
    n_ok += 1
print(n_ok > 500, n_err > 500)
"""
    )
    assert out.split() == ["True", "True"], out


def test_null_with_on_flush_gets_every_pool_event_without_it_none() -> None:
    """``null://`` with an on_flush callback: the pool's parts are decoded when handed over
    and the callback sees exactly the events a list sink gets, in seq order; without one:
    no batch, the events only counted."""
    import torch

    from kvbm_runtime import BlockPool, LayoutConfig
    from kvbm_runtime.layout import FullyContiguous

    cfg = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)

    def traffic(sink: object) -> None:
        pool = BlockPool("g2", FullyContiguous(cfg, 6), sink)  # type: ignore[arg-type]
        for c in range(4):
            hs = [(c + 1) * 2**60 + i for i in range(4)]
            metas = [BlockMeta(h, hs[i - 1] if i else None, hs[0], 0) for i, h in enumerate(hs)]
            pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas)))

    class ListSink:
        def __init__(self) -> None:
            self.events: list[KVEvent] = []

        def publish(self, events: list[KVEvent]) -> None:
            self.events.extend(events)

    want = ListSink()
    traffic(want)
    seen: list[tuple[int, list[KVEvent], bytes]] = []
    on = NullPublisher("w-null", config=PublisherConfig(max_events=5), on_flush=lambda b, p: seen.append((b.seq, b.events, p)))
    traffic(on)
    on.close()
    assert [s for s, _, _ in seen] == list(range(len(seen)))
    assert [e for _, evs, _ in seen for e in evs] == want.events and len(want.events) == 16 + 10
    assert all(decode_batch(p).events == evs for _, evs, p in seen)
    off = NullPublisher("w-null")
    traffic(off)
    off.close()
    assert off.stats().events == len(want.events) and off.stats().batches == 0 and off.next_seq == 0


def test_event_cls_or_event_type_that_mutate_the_list_do_not_crash() -> None:
    # make_meta_events calls event_cls (Python code) per item; an event_type with
    # __index__ is converted before the list is read (and refused: not an int).
    out = _run(
        _PRELUDE
        + """
L = [BlockMeta(i + 1, None, i + 1, 0) for i in range(20000)]
class Cls:
    def __init__(self, *a):
        L.clear()
try:
    make_meta_events(Cls, 0, L, 1, "g")
    print("no error")
except RuntimeError as e:
    print("RuntimeError")
L[:] = [BlockMeta(i + 1, None, i + 1, 0) for i in range(20000)]
class I:
    def __index__(self):
        L.clear()
        return 0
try:
    encode_meta_events(I(), L, tail)
    print("no error")
except TypeError:
    print("TypeError")
"""
    )
    assert out.split() == ["RuntimeError", "TypeError"], out
