"""SqliteJournal: append / replay, duplicate detection, bad payloads refused."""

from __future__ import annotations

import pytest

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.journal import BadPayloadError, SqliteJournal
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, remove, store

BIG = (1 << 64) - 5  # u64 above the signed range must survive the round trip


def batch(seq: int, *events, source: str = "w0", epoch: int = BIG) -> EventBatch:  # noqa: ANN002
    return EventBatch(1, source, epoch, seq, 1_000 + seq, list(events))


def test_append_and_read_back_in_order(tmp_path) -> None:  # noqa: ANN001
    j = SqliteJournal(tmp_path / "j.sqlite")
    bs = [batch(i, store(BIG - i, BIG, None, 64, "g1")) for i in range(5)]
    positions = [j.append(encode_batch(b), b) for b in bs]
    assert positions == [1, 2, 3, 4, 5]
    assert j.last_position() == 5
    assert [(p, b) for p, b in j.read()] == list(zip(positions, bs))
    assert [p for p, _ in j.read(from_position=3)] == [4, 5]
    assert j.sources() == {"w0": (BIG, 4)}
    j.close()
    # reopened: same content
    j2 = SqliteJournal(tmp_path / "j.sqlite")
    assert [b for _, b in j2.read()] == bs
    j2.close()


def test_duplicate_batch_is_not_appended_twice(tmp_path) -> None:  # noqa: ANN001
    j = SqliteJournal(tmp_path / "j.sqlite")
    b = batch(0, store(1, 1, None, 64, "g1"))
    assert j.append(encode_batch(b), b) == 1
    assert j.append(encode_batch(b), b) is None
    assert j.append(encode_batch(b)) is None
    # same seq from another epoch or source is a different batch
    b2 = batch(0, store(1, 1, None, 64, "g1"), epoch=3)
    b3 = batch(0, store(1, 1, None, 64, "g1"), source="w1")
    assert j.append(encode_batch(b2), b2) == 2
    assert j.append(encode_batch(b3), b3) == 3
    assert j.duplicates == 2
    assert len(j) == 3
    assert j.contains("w0", BIG, 0) and not j.contains("w0", BIG, 1)


def test_bad_payloads_never_enter_the_journal(tmp_path) -> None:  # noqa: ANN001
    j = SqliteJournal(tmp_path / "j.sqlite")
    good = batch(0, store(1, 1, None, 64, "g1"))
    j.append(encode_batch(good), good)
    with pytest.raises(BadPayloadError):
        j.append(b"\x93\x01\x02")  # not a batch
    with pytest.raises(BadPayloadError):
        j.append(encode_batch(good)[:-3])  # truncated
    other = batch(1, remove(1, 1, None, 64, "g1"))
    with pytest.raises(BadPayloadError):
        j.append(encode_batch(other), good)  # bytes of another batch
    assert j.rejected == 3
    assert [b for _, b in j.read()] == [good]  # nothing lost, nothing added
    nxt = batch(1, remove(1, 1, None, 64, "g1"))
    assert j.append(encode_batch(nxt), nxt) == 2


def test_too_deep_metadata_never_enters_the_journal_even_unverified(tmp_path) -> None:  # noqa: ANN001
    """A batch built in process (an adapter's, appended with ``verify=False``) gets the
    decoder's checks too: nothing enters the log that a replay would refuse."""
    from event_plane.codec import MAX_METADATA_DEPTH

    j = SqliteJournal(tmp_path / "j.sqlite")
    meta: dict = {"hits": 1}
    for _ in range(MAX_METADATA_DEPTH):
        meta = {"a": meta}
    deep = batch(0, store(1, 1, None, 64, "g1", meta))
    for verify in (True, False):
        with pytest.raises(BadPayloadError, match="nests more than 32 levels"):
            j.append(encode_batch(deep), deep, verify=verify)
    assert j.rejected == 2 and len(j) == 0
    ok = batch(0, store(1, 1, None, 64, "g1", meta["a"]))
    assert j.append(encode_batch(ok), ok, verify=False) == 1


def test_folding_the_journal_twice_rebuilds_the_same_index(tmp_path) -> None:  # noqa: ANN001
    j = SqliteJournal(tmp_path / "j.sqlite")
    live = PrefixIndex()
    evs = [
        [store(1, 1, None, 64, "g1"), store(2, 1, 1, 64, "g1")],
        [store(1, 1, None, 64, "slow"), store(2, 1, 1, 64, "slow")],
        [remove(1, 1, None, 64, "g1")],
        [store(3, 1, 2, 64, "g1")],
    ]
    for i, e in enumerate(evs):
        b = batch(i, *e)
        if j.append(encode_batch(b), b) is not None:
            live.apply_batch(b)
        j.append(encode_batch(b), b)  # a re-send is ignored
    a, b2 = PrefixIndex(), PrefixIndex()
    for _, bb in j.read():
        a.apply_batch(bb)
    for _, bb in j.read():
        b2.apply_batch(bb)
    assert a.dump() == b2.dump() == live.dump()
    assert a.lookup([1, 2, 3]) == {"slow": 2}


def test_verify_compares_wire_values_not_python_equality(tmp_path) -> None:  # noqa: ANN001
    """``append(payload, batch)`` checks that ``payload`` is ``batch``'s wire form. Python's
    ``==`` is the wrong test both ways: a NaN in ``extra_metadata`` never equals itself (the
    batch decoded from the very payload was refused), while ``True == 1 == 1.0`` let a batch
    with ``{"hits": True}`` be journaled as the bytes of ``{"hits": 1}``: live the index
    counts no hit (it reads int hits only), the replay one."""
    import math

    from event_plane.codec import decode_batch

    j = SqliteJournal(tmp_path / "j.sqlite")
    nan = batch(0, store(1, 1, None, 64, "fast", {"score": float("nan")}))
    payload = encode_batch(nan)
    assert j.append(payload, decode_batch(payload)) == 1
    assert math.isnan(next(iter(j.read()))[1].events[0].extra_metadata["score"])

    as_int = batch(1, store(2, 2, None, 64, "fast", {"hits": 1}))
    for other in ({"hits": True}, {"hits": 1.0}):
        looks_equal = batch(1, store(2, 2, None, 64, "fast", other))
        assert looks_equal == as_int  # what the old check compared
        with pytest.raises(BadPayloadError, match="not the batch"):
            j.append(encode_batch(as_int), looks_equal)
    # the order of a map's keys is not part of the value
    ab = batch(2, store(3, 3, None, 64, "fast", {"a": 1, "b": [1, 2]}))
    ba = batch(2, store(3, 3, None, 64, "fast", {"b": (1, 2), "a": 1}))
    assert j.append(encode_batch(ab), ba) == 2
    assert j.rejected == 2 and len(j) == 2


def test_verify_refuses_a_batch_that_does_not_encode(tmp_path) -> None:  # noqa: ANN001
    """A hand-built batch no encoder can write is not the batch of any payload: refused as a
    bad payload, not an encoder error escaping ``append``."""
    j = SqliteJournal(tmp_path / "j.sqlite")
    good = batch(0, store(1, 1, None, 64, "fast", {"k": {1: 2}}))  # non-str key inside: not sortable
    assert j.append(encode_batch(good), good) == 1
    for odd in ({"k": object()}, {"k": 1 << 70}):
        with pytest.raises(BadPayloadError, match="not the batch"):
            j.append(encode_batch(good), batch(0, store(1, 1, None, 64, "fast", odd)))
