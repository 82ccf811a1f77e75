"""Write the seed corpora of the fuzz targets (``tests/fuzz/corpus/<target>/``).

Every seed is built with the real encoders (``event_plane.codec`` for KVEvent v1, msgspec
for the peers' payloads, in the shapes ``event_plane.adapters`` documents), plus a few
hand-made encodings the encoders never write (non-shortest integers, omitted trailing
fields, refused batches). Run ``python tests/fuzz/make_seeds.py`` after changing it and
commit the result; the fuzzers only read these files.
"""

from __future__ import annotations

import datetime
import struct

import _fuzzlib
import msgspec

from event_plane.codec import MAX_METADATA_DEPTH, encode_batch
from event_plane.schema import U32_MAX, U64_MAX, WIRE_VERSION, EventBatch, cleared, remove, store

TS = 1_700_000_000_000_000_000
U64 = U64_MAX


def _batch(source: str, epoch: int, seq: int, events: list, ts: int = TS) -> bytes:
    return encode_batch(EventBatch(WIRE_VERSION, source, epoch, seq, ts, events))


def _nested(depth: int) -> dict:
    """``extra_metadata`` ``depth`` containers deep (the map itself is level 1)."""
    inner: object = 1
    for level in range(depth - 1, 0, -1):
        inner = [inner] if level % 2 else {"k": inner}
    return {"deep": inner}


def _chain(loc: str, hashes: list[int], size: int = 4096) -> list:
    out = []
    parent = None
    for h in hashes:
        out.append(store(h, hashes[0], parent, size, loc))
        parent = h
    return out


def codec_seeds() -> dict[str, bytes]:
    """Single KVEvent v1 payloads, valid and not."""
    s: dict[str, bytes] = {
        "empty_batch": _batch("w0", 1, 0, []),
        "store_chain_g1": _batch("w0", 1, 0, _chain("g1", [11, 12, 13])),
        "store_remove_cleared": _batch("w0", 1, 1, [store(21, 21, None, 4096, "g2"), remove(21, 21, None, 4096, "g2"),
                                                    cleared("g1")]),
        "volumes_meta": _batch("w1", 2, 5, [store(31, 31, None, 65536, "fast", {"hits": 3}),
                                            store(32, 31, 31, 65536, "s3", {"moved_from": "fast", "reconciled": True}),
                                            remove(31, 31, None, 65536, "fast"), cleared("s3")]),
        "extremes": _batch("w" * 255, U64, U64, [store(U64, U64 - 1, 1 << 63, U32_MAX, "v" * 255),
                                                  store(0, 0, None, 0, "g1")], ts=U64),
        "unicode": _batch("wörker-é", 3, 2, [store(41, 41, None, 1, "vol-ü"), remove(41, 41, None, 1, "vol-ü")]),
        "meta_max_depth": _batch("w2", 1, 0, [store(51, 51, None, 8, "fast", _nested(MAX_METADATA_DEPTH))]),
        "meta_too_deep": _batch("w2", 1, 1, [store(52, 52, None, 8, "fast", _nested(MAX_METADATA_DEPTH + 1))]),
        "meta_any": _batch("w3", 1, 0, [store(61, 61, None, 8, "fast", {
            "f": 0.5, "b": b"\x00\xff", "l": [1, -1, None, True], "m": {"1": {"x": "y"}},
            "t": datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc), "e": msgspec.msgpack.Ext(5, b"ab"),
            "n": -(1 << 63), "u": U64})]),
        "self_parented": _batch("w4", 1, 0, [store(71, 71, 71, 8, "g1")]),
        "version_2": encode_batch(EventBatch(2, "w0", 1, 0, TS, [])),
        "truncated": _batch("w0", 1, 0, _chain("g1", [11, 12]))[:-3],
        "trailing_byte": _batch("w0", 1, 0, []) + b"\xc0",
    }
    # hand-made: non-shortest integers, 6-field events (extra_metadata left out), a float32
    # and an int-keyed map inside extra_metadata
    s["long_ints_short_events"] = (
        b"\x96\x01\xa2w5\xcf" + (1).to_bytes(8, "big") + b"\xce\x00\x00\x00\x02\xcc\x03\x92"
        + b"\x96\x00\xcd\x00\x51\xcf" + (81).to_bytes(8, "big") + b"\xc0\xce\x00\x00\x10\x00\xa2g1"
        + b"\x97\x01\x51\x51\xc0\xcc\x00\xa2g1\xc0"
    )
    s["float32_int_key_meta"] = (
        b"\x96\x01\xa2w6\x01\x00\x00\x91\x97\x00\x5b\x5b\xc0\x00\xa4fast"
        + b"\x82\xa1f\xca" + struct.pack(">f", 1.5) + b"\xa1m\x81\x07\x91\xa1x"
    )
    return s


def _peer(ts: object, events: list, dp: object = None) -> bytes:
    body = [ts, events] if dp is None else [ts, events, dp]
    return msgspec.msgpack.encode(body)


def _rec(seq: int, payload: bytes) -> bytes:
    return seq.to_bytes(2, "big") + payload


def adapter_seeds() -> dict[str, bytes]:
    """Record streams of vLLM / SGLang payloads (flags byte: see ``fuzz_adapters``)."""
    digest = bytes(range(32))
    vllm_store = ["BlockStored", [101, 102, 103], None, list(range(48)), 16, None, "GPU", None, None, 0, "full", None]
    vllm_store_cpu = ["BlockStored", [102], None, [], 16, None, "CPU"]
    vllm_remove = ["BlockRemoved", [101, 102], "GPU", 0]
    vllm_digest = ["BlockStored", [digest, digest[::-1]], digest, [], 16, 3, "DISK", "lora-a", [["x", 1]], 1]
    sg_store = ["BlockStored", [-5, 6, -(1 << 63)], None, [1, 2, 3], 1, None, "CPU_PINNED", "salt", "sess"]
    sg_remove = ["BlockRemoved", [-5], "EXTERNAL"]
    map_store = {"type": "BlockStored", "block_hashes": [201, 202], "parent_block_hash": 200, "block_size": 32,
                 "medium": "nvme", "lora_name": "l", "group_idx": 2}
    map_remove = {"type": "BlockRemoved", "block_hashes": [201], "medium": "nvme"}
    cleared_ev = ["AllBlocksCleared"]
    unknown = ["BlockMoved", 1, 2]
    bad = ["BlockStored", "not-a-list", None, [], -1]
    vllm_batch = _peer(1_700_000_000.25, [vllm_store, vllm_store_cpu, vllm_remove, cleared_ev], 0)
    return {
        "vllm_store_remove": _fuzzlib.join_records(0, [_rec(0, vllm_batch), _rec(1, _peer(1.5, [vllm_remove]))]),
        "vllm_keep_fields": _fuzzlib.join_records(2 | 8, [_rec(0, _peer(2.0, [vllm_digest, map_store], 3)),
                                                          _rec(1, _peer(2.0, [map_remove]))]),
        "vllm_restart_replay": _fuzzlib.join_records(32 | 4, [_rec(5, vllm_batch), _rec(4, vllm_batch),
                                                              _rec(1, _peer(-1.0, [vllm_store]))]),
        "vllm_map_batch": _fuzzlib.join_records(0, [_rec(0, msgspec.msgpack.encode(
            {"ts": 3.0, "events": [map_store, map_remove, unknown, bad], "data_parallel_rank": 1}))]),
        "sglang_store_remove": _fuzzlib.join_records(1 | 2 | 12, [_rec(0, _peer(4, [sg_store, sg_remove], 1)),
                                                                  _rec(1, _peer(4, [cleared_ev]))]),
        "sglang_lru": _fuzzlib.join_records(1 | 16, [_rec(i, _peer(5.0, [["BlockStored", [300 + i], 299 + i, [], 1]]))
                                                     for i in range(6)] + [_rec(6, _peer(5.0, [["BlockRemoved", [300]]]))]),
        "not_msgpack": _fuzzlib.join_records(0, [_rec(0, b"\xc1\xc1"), _rec(1, msgspec.msgpack.encode({"ts": 1}))]),
    }


def journal_seeds() -> dict[str, bytes]:
    """Record streams of KVEvent v1 payloads for one advisor (flags: see ``fuzz_journal``)."""
    a0 = _batch("w0", 1, 0, _chain("g1", [11, 12, 13]))
    a1 = _batch("w0", 1, 1, [store(12, 11, 11, 4096, "fast", {"hits": 2}), remove(13, 11, 12, 4096, "g1")])
    a_restart = _batch("w0", 2, 0, [store(14, 14, None, 4096, "g1"), store(11, 11, None, 4096, "s3")])
    a_stale = _batch("w0", 1, 2, [store(15, 15, None, 4096, "fast"), remove(12, 11, 11, 4096, "g1")])
    b0 = _batch("w1", 9, 0, [store(12, 11, 11, 4096, "fast"), store(16, 11, 12, 4096, "fast", {"moved_from": "g2"})])
    b1 = _batch("w1", 9, 1, [cleared("fast"), cleared("g1"), store(17, 17, 17, 1, "g2")])
    odd = _batch("wörker", 3, 0, [store(18, 18, None, 1, "vol-é", {"hits": 1.5}), store(19, 18, 18, 1, "bad/loc")])
    streams = [a0, a1, b0, a_restart, a_stale, b1, odd]
    return {
        "verify_all": _fuzzlib.join_records(0, streams),
        "subscriber_path": _fuzzlib.join_records(1, streams),
        "snapshots": _fuzzlib.join_records(2, streams),
        "snapshots_on_stop": _fuzzlib.join_records(6, streams[:3]),
        "duplicates_and_junk": _fuzzlib.join_records(0, [a0, a0, b"\x96\x01", a1, b0, b0]),
        "nonshortest_ints": _fuzzlib.join_records(1, [codec_seeds()["long_ints_short_events"], a0]),
    }


def main() -> None:
    """(Re)write the seed files of every target."""
    for name, seeds in (("codec", codec_seeds()), ("adapters", adapter_seeds()), ("journal", journal_seeds())):
        d = _fuzzlib.corpus_dir(name)
        d.mkdir(parents=True, exist_ok=True)
        for seed_name, data in seeds.items():
            (d / seed_name).write_bytes(data)
        print(f"{d}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
