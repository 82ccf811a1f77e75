"""Fuzz target: the KVEvent v1 wire codec (``event_plane.codec``) on arbitrary bytes.

Invariants of :func:`check`:

* ``decode_batch`` and ``decode_event`` raise nothing but ``CodecError``;
* the index's one-pass decoder agrees with ``decode_batch``: ``PrefixIndex.apply_payload``
  raises ``CodecError`` with the same message exactly when ``decode_batch`` does (and then
  applies nothing), else folds to the state ``apply_batch`` of the decoded batch gives, and
  to the state of the pure-Python reference fold (``ReferencePrefixIndex``, whose branches
  are also what gives the fuzzer coverage to follow: msgspec and the compiled core are not
  instrumented);
* the one-pass quota check (``PrefixIndex.apply_payload_within``, limits nothing reaches)
  never raises on bytes: it declines (-1, nothing applied) every batch ``decode_batch``
  refuses, and a batch it takes folds to the state ``apply_batch`` gives;
* an accepted batch re-encodes to bytes that decode again, to an equal batch, whose encoding
  is the same bytes (``encode_batch_parts`` of its encoded events too), and each event
  decodes alone with ``decode_event``;
* no accepted ``extra_metadata`` nests deeper than :data:`MAX_METADATA_DEPTH` (maps,
  arrays and arrays used as map keys, counted by ``_fuzzlib.nesting_depth``);
* acceptance does not depend on the stack depth the decoder runs at: an accepted batch
  decodes again with only about :data:`STACK_BUDGET` levels of recursion left, which is
  enough for the deepest legal batch.

Run: ``python tests/fuzz/fuzz_codec.py [-max_total_time=60] [corpus dirs]``.
"""

from __future__ import annotations

import sys

import _fuzzlib

with _fuzzlib.instrumented(__name__ == "__main__"):
    from advisor.index.prefix_index import PrefixIndex
    from advisor.index.reference import ReferencePrefixIndex
    from event_plane.codec import (
        MAX_METADATA_DEPTH,
        CodecError,
        decode_batch,
        decode_event,
        encode_batch,
        encode_batch_parts,
        encode_event,
    )

NAME = "codec"

STACK_BUDGET = 60
"""Recursion levels left to the deep-stack decode. The deepest legal batch needs fewer
(``tests/fuzz/test_fuzz_bounded.py`` checks it decodes with this budget); msgspec counts one
level per nested container, so a batch that nests well past :data:`MAX_METADATA_DEPTH`
anywhere fails there."""

_EMPTY_DUMP = PrefixIndex().dump()


def _decode_error(data: bytes) -> tuple[object, str | None]:
    try:
        return decode_batch(data), None
    except CodecError as exc:
        return None, str(exc)


def check(data: bytes) -> None:
    """Check the codec invariants (module docstring) on one input; raise on a violation."""
    batch, err = _decode_error(data)
    try:
        decode_event(data)
    except CodecError:
        pass

    within = PrefixIndex()
    taken = within.apply_payload_within(data, 1 << 62, 1 << 62, 1 << 62, 1 << 62)
    if taken < 0 or err is not None:
        assert taken == -1, f"apply_payload_within took {taken} events of a batch decode_batch refuses: {err}"
        assert within.dump() == _EMPTY_DUMP, "apply_payload_within applied part of a batch it declined"
        within = None

    idx = PrefixIndex()
    try:
        n = idx.apply_payload(data)
    except CodecError as exc:
        assert err is not None, f"apply_payload refused a batch decode_batch accepts: {exc}"
        assert str(exc) == err, f"apply_payload error {exc!r} differs from decode_batch's {err!r}"
        assert idx.dump() == _EMPTY_DUMP, "apply_payload applied part of a refused batch"
        return
    assert err is None, f"apply_payload accepted a batch decode_batch refuses: {err}"
    assert batch is not None
    assert n == len(batch.events), f"apply_payload folded {n} events of {len(batch.events)}"
    ref = PrefixIndex()
    ref.apply_batch(batch)
    assert idx.dump() == ref.dump(), "apply_payload and apply_batch fold the same batch differently"
    if within is not None:
        assert taken == len(batch.events), f"apply_payload_within folded {taken} events of {len(batch.events)}"
        assert within.dump() == ref.dump(), "apply_payload_within and apply_batch fold the same batch differently"
    spec = ReferencePrefixIndex()
    spec.apply_batch(batch)
    assert spec.dump() == ref.dump(), "the compiled fold differs from the reference fold"

    wire = encode_batch(batch)
    try:
        again = decode_batch(wire)
    except CodecError as exc:
        raise AssertionError(f"an accepted batch does not decode after re-encoding: {exc}") from exc
    assert encode_batch(again) == wire, "re-encoding is not stable"
    if not _fuzzlib.has_nan(batch):
        assert again == batch, "the re-encoded batch decodes to another batch"
    encoded = [encode_event(ev) for ev in batch.events]
    assert encode_batch_parts(batch.source, batch.epoch, batch.seq, batch.ts_ns, encoded) == wire, \
        "encode_batch_parts differs from encode_batch"
    for ev, raw in zip(batch.events, encoded):
        try:
            one = decode_event(raw)
        except CodecError as exc:
            raise AssertionError(f"an event of an accepted batch does not decode alone: {exc}") from exc
        assert encode_event(one) == raw, "an event decodes alone to another event"

    for ev in batch.events:
        depth = _fuzzlib.nesting_depth(ev.extra_metadata)
        assert depth <= MAX_METADATA_DEPTH, f"accepted extra_metadata nesting {depth} levels deep"
    try:
        _fuzzlib.call_with_stack_budget(STACK_BUDGET, lambda: decode_batch(data))
    except CodecError as exc:
        raise AssertionError(
            f"a batch accepted at a shallow stack is refused with {STACK_BUDGET} levels of recursion left "
            f"(nesting past MAX_METADATA_DEPTH={MAX_METADATA_DEPTH} was not refused): {exc}"
        ) from exc


if __name__ == "__main__":
    _fuzzlib.main(check, NAME)
    sys.exit(0)
