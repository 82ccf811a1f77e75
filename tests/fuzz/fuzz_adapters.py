"""Fuzz target: the vLLM and SGLang adapters (``event_plane.adapters``) on arbitrary payloads.

Input: a record stream (``_fuzzlib.split_records``). The flags byte picks the converter and
its settings:

* bit 0: SGLang (``sglang_converter``, digest rule ``first8``), else vLLM (``last8``);
* bit 1: ``keep_peer_fields`` (peer fields copied into ``extra_metadata``);
* bits 2-3: ``bytes_per_token`` 0, 2, 4096 or 2**20 (sizes past u32 then);
* bit 4: ``prefix_memory`` of 4 hashes (its LRU evicts), else the default;
* bit 5: every second record is a replayed one (``live=False``).

Each record is a 2-byte big-endian peer seq and the peer's payload; the records go through
one converter in order, as a subscriber feeds it. Invariants of :func:`check`:

* ``PeerConverter.convert`` raises nothing but ``CodecError`` (its documented error:
  malformed events are skipped and counted, never raised);
* a converted batch is a valid KVEvent v1 batch: it encodes, the bytes decode with
  ``decode_batch`` (the decoder the advisor and its journal replay use) to an equal batch,
  and its envelope is the converter's source, epoch and the peer's seq;
* the counters add up: ``stats.events`` grows by the events converted, ``stats.batches``
  by one per converted payload.

Run: ``python tests/fuzz/fuzz_adapters.py [-max_total_time=60] [corpus dirs]``.
"""

from __future__ import annotations

import sys

import _fuzzlib

with _fuzzlib.instrumented(__name__ == "__main__"):
    from event_plane.adapters.peer import PeerConverter
    from event_plane.adapters.sglang import sglang_config, sglang_converter
    from event_plane.adapters.vllm import vllm_config, vllm_converter
    from event_plane.codec import CodecError, decode_batch, encode_batch

NAME = "adapters"
SOURCE = "fuzz-peer"
BYTES_PER_TOKEN = (0, 2, 4096, 1 << 20)


def converter(flags: int) -> PeerConverter:
    """The converter the flags byte selects (see the module docstring)."""
    options = {
        "bytes_per_token": BYTES_PER_TOKEN[(flags >> 2) & 3],
        "keep_peer_fields": bool(flags & 2),
        "epoch": 7,
    }
    if flags & 16:
        options["prefix_memory"] = 4
    if flags & 1:
        return sglang_converter(sglang_config(SOURCE, **options))
    return vllm_converter(vllm_config(SOURCE, **options))


def check(data: bytes) -> None:
    """Check the adapter invariants (module docstring) on one input; raise on a violation."""
    if not data:
        return
    flags = data[0]
    conv = converter(flags)
    for i, record in enumerate(_fuzzlib.split_records(data[1:])):
        seq = int.from_bytes(record[:2], "big")
        payload = record[2:]
        live = not (flags & 32 and i % 2)
        events0, batches0 = conv.stats.events, conv.stats.batches
        try:
            batch = conv.convert(seq, payload, live=live)
        except CodecError:
            assert conv.stats.batches == batches0, "a refused payload was counted as converted"
            continue
        assert conv.stats.batches == batches0 + 1, "a converted payload was not counted"
        assert conv.stats.events == events0 + len(batch.events), "stats.events differs from the events converted"
        assert (batch.source, batch.epoch, batch.seq) == (SOURCE, conv.epoch, seq), "wrong batch envelope"
        try:
            wire = encode_batch(batch)
        except Exception as exc:  # noqa: BLE001 - anything here is the finding
            raise AssertionError(f"a converted batch does not encode: {type(exc).__name__}: {exc}") from exc
        try:
            again = decode_batch(wire)
        except CodecError as exc:
            raise AssertionError(f"a converted batch is not a valid KVEvent v1 batch: {exc}") from exc
        if not _fuzzlib.has_nan(batch):
            assert again == batch, "a converted batch decodes to another batch"
        assert encode_batch(again) == wire, "a converted batch's encoding is not stable"


if __name__ == "__main__":
    _fuzzlib.main(check, NAME)
    sys.exit(0)
