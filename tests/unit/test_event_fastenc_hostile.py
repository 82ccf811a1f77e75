"""Hostile input for the compiled event encoder (``event_plane._fastenc``) and the publisher
paths that take its bytes.

Anything that could crash the interpreter runs in a subprocess (``python -X faulthandler``),
so a segfault fails the test instead of killing the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest

from event_plane import KVEvent
from event_plane._fastenc import encode_meta_events, event_tail, make_meta_events
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
from event_plane import KVEvent
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
