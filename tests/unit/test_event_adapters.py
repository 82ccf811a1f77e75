"""vLLM / SGLang adapters, in-process: every event shape, hash kind and mapping rule.
(Real-socket tests: tests/integration/test_event_adapters_zmq.py.)"""

from __future__ import annotations

import hashlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from event_plane import CodecError, EventType, EventURLError, KVEvent, make_publisher, subscribe
from event_plane.adapters import (
    PeerConfig,
    PeerFormatError,
    hash_to_u64,
    sglang_config,
    sglang_converter,
    vllm_config,
    vllm_converter,
)
from event_plane.adapters.emit import peer_batch, peer_event
from event_plane.errors import ConfigError

S, R, C = EventType.STORE, EventType.REMOVE, EventType.CLEARED
enc = msgspec.msgpack.encode


def rows(batch) -> list[tuple]:  # type: ignore[no-untyped-def]
    return [(e.type, e.sequence_hash, e.prefix_hash, e.parent_hash, e.block_size, e.storage_location) for e in batch.events]


def test_vllm_array_form_with_trailing_defaults_left_out() -> None:
    conv = vllm_converter(vllm_config("pod-a", bytes_per_token=2048, epoch=77))
    events = [
        ["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU"],  # up to medium
        ["BlockStored", [13], 12, list(range(16)), 16, None, "GPU", "lora-x", None, 0],  # longer release
        ["BlockStored", [20], None, list(range(16)), 16, None],  # legacy: no medium -> GPU
        ["BlockRemoved", [12], "GPU"],
        ["BlockRemoved", [13]],  # no medium
        ["AllBlocksCleared"],
    ]
    batch = conv.convert(4, peer_batch(events, ts=1700000000.5))
    assert (batch.version, batch.source, batch.epoch, batch.seq, batch.ts_ns) == (1, "pod-a", 77, 4, 1700000000500000000)
    sz = 16 * 2048
    assert rows(batch) == [
        (S, 11, 11, None, sz, "g1"),
        (S, 12, 11, 11, sz, "g1"),
        (S, 13, 11, 12, sz, "g1"),  # prefix of the chain it continues
        (S, 20, 20, None, sz, "g1"),
        (R, 12, 11, 11, sz, "g1"),  # parent / prefix / size remembered from the Store
        (R, 13, 11, 12, sz, "g1"),
        (C, 0, 0, None, 0, "g1"),
    ]
    assert conv.stats.peer_events == 6 and conv.stats.events == 7 and conv.stats.invalid_events == 0


def test_map_form_with_default_fields_left_out_and_map_batch() -> None:
    conv = vllm_converter(vllm_config("pod-a", bytes_per_token=10, epoch=1))
    events = [
        {"type": "BlockStored", "block_hashes": [1, 2, 3], "token_ids": [0] * 12, "block_size": 4, "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": 99, "block_size": 4, "lora_name": "x"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
    ]
    batch = conv.convert(0, enc({"ts": 1.0, "events": events, "data_parallel_rank": 1}))
    assert rows(batch) == [
        (S, 1, 1, None, 40, "g2"),
        (S, 2, 1, 1, 40, "g2"),
        (S, 3, 1, 2, 40, "g2"),
        (S, 4, 4, 99, 40, "g1"),  # parent never seen: the block is its own prefix
        (R, 2, 1, 1, 40, "g2"),
        (C, 0, 0, None, 0, "g1"),
    ]
    assert all(e.extra_metadata is None for e in batch.events)


def test_signed_unsigned_and_digest_hashes() -> None:
    digest = hashlib.sha256(b"block").digest()
    assert hash_to_u64(5) == 5 and hash_to_u64(2**64 - 1) == 2**64 - 1
    assert hash_to_u64(-1) == 2**64 - 1 and hash_to_u64(-(2**63)) == 2**63
    # vLLM's int form is int.from_bytes(digest, "big") mod 2**64: the digest reduces to it
    assert hash_to_u64(digest, "last8") == int.from_bytes(digest, "big") & (2**64 - 1)
    # SGLang's int form is the first 8 bytes as a signed int: same bits as "first8"
    signed = int.from_bytes(digest[:8], "big", signed=True)
    assert hash_to_u64(digest, "first8") == hash_to_u64(signed)
    assert hash_to_u64(b"\x01\x02", "last8") == 0x0102
    for bad in ("12", 1.5, None, True, b"", 2**64, -(2**63) - 1, [1]):
        with pytest.raises(PeerFormatError):
            hash_to_u64(bad)

    conv = sglang_converter(sglang_config("sg-0", epoch=3))
    batch = conv.convert(0, enc([1.0, [["BlockStored", [-5, signed, digest], -9, [], 1, None, "CPU_PINNED"]], 0]))
    assert rows(batch) == [
        (S, 2**64 - 5, 2**64 - 5, 2**64 - 9, 0, "g2"),
        (S, hash_to_u64(signed), 2**64 - 5, 2**64 - 5, 0, "g2"),
        (S, hash_to_u64(digest, "first8"), 2**64 - 5, hash_to_u64(signed), 0, "g2"),
    ]
    vconv = vllm_converter(vllm_config("v", epoch=3))
    vb = vconv.convert(0, enc([1.0, [["BlockStored", [digest], None, [], 16, None, "GPU"]]]))
    assert vb.events[0].sequence_hash == int.from_bytes(digest, "big") & (2**64 - 1)


def test_media_mapping() -> None:
    conv = sglang_converter(sglang_config("s", disk_volume="nvme-0", external_volume="3fs", media={"hbm2": "g1"}, epoch=1))
    media = ["GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL", "HBM2", "Weird_Tier"]
    events = [["BlockStored", [i + 1], None, [], 1, None, m] for i, m in enumerate(media)]
    batch = conv.convert(0, peer_batch(events))
    assert [e.storage_location for e in batch.events] == ["g1", "g2", "g2", "nvme-0", "3fs", "g1", "weird_tier"]


def test_malformed_events_are_skipped_alone_and_counted() -> None:
    conv = vllm_converter(vllm_config("v", bytes_per_token=2**30, epoch=1))
    events = [
        ["BlockStored", [1], None, [], 1, None, "GPU"],
        ["BlockStored", ["not-a-hash"], None, [], 1, None, "GPU"],
        ["BlockStored", 7, None, [], 1],  # block_hashes not a list
        ["BlockStored", [2], None, [], 16, None, "GPU"],  # 16 tokens x 1 GiB > u32
        ["BlockStored", [3], None, [], -1, None, "GPU"],
        ["BlockStored", [4], None, [], 1, None, 5],  # medium not a str
        [7, [1]],  # tag not a str
        [],
        42,
        {"block_hashes": [1]},  # map without "type"
        ["BlockFrobbed", [1]],  # unknown kind: skipped, counted apart
        {"type": "KVCacheReset"},
        ["BlockRemoved", [b""]],  # empty digest
        ["BlockStored", [5], 1, [], 1, None, "GPU"],
    ]
    batch = conv.convert(0, peer_batch(events))
    assert [e.sequence_hash for e in batch.events] == [1, 5]
    assert (conv.stats.invalid_events, conv.stats.unknown_events, conv.stats.peer_events) == (10, 2, 14)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x93garbage", enc(5), enc([1.0]), enc([1.0, 5]), enc({"ts": 1.0}), enc("str"), enc([1.0, [], 0]) + b"x"],
)
def test_malformed_batches_raise_codec_error(payload: bytes) -> None:
    conv = vllm_converter(vllm_config("v", epoch=1))
    with pytest.raises(CodecError):
        conv.convert(0, payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_convert_or_raise_codec_error(data: bytes) -> None:
    conv = sglang_converter(sglang_config("s", epoch=1))
    try:
        batch = conv.convert(0, data)
    except CodecError:
        return
    assert all(isinstance(e, KVEvent) for e in batch.events)


def test_keep_peer_fields_and_timestamp_fallback() -> None:
    conv = vllm_converter(vllm_config("v", keep_peer_fields=True, epoch=1))
    ev = peer_event("BlockStored", {"block_hashes": [1], "parent_block_hash": None, "token_ids": [], "block_size": 1,
                                    "medium": "CPU", "lora_name": "L", "group_idx": 2})
    batch = conv.convert(0, enc(["not-a-time", [ev], 3]))
    assert batch.events[0].extra_metadata == {"medium": "CPU", "lora_name": "L", "group_idx": 2, "dp_rank": 3}
    assert batch.ts_ns > 1_600_000_000 * 10**9  # unusable ts -> now


def test_live_seq_going_back_is_a_restart_replay_is_not() -> None:
    conv = vllm_converter(vllm_config("v", epoch=1))
    one = peer_batch([["BlockStored", [1], None, [], 1, None, "GPU"]])
    assert conv.convert(0, one).epoch == 1
    assert conv.convert(5, one).epoch == 1
    assert conv.convert(3, one, live=False).epoch == 1  # a replayed older batch
    again = conv.convert(0, one)  # the peer restarted: seq 0 after 5
    assert again.epoch != 1 and conv.stats.restarts == 1
    assert conv.convert(1, one).epoch == again.epoch


def test_parse_then_enrich_in_seq_order_fills_removes() -> None:
    conv = vllm_converter(vllm_config("v", bytes_per_token=1, epoch=1))
    later = conv.parse(1, peer_batch([["BlockRemoved", [2], "GPU"]]))  # arrived first
    earlier = conv.parse(0, peer_batch([["BlockStored", [1, 2], None, [], 8, None, "GPU"]]))
    assert rows(later) == [(R, 2, 2, None, 0, "g1")]  # parse alone knows nothing
    conv.enrich(earlier)
    assert rows(conv.enrich(later)) == [(R, 2, 1, 1, 8, "g1")]


def test_adapter_urls() -> None:
    sub = subscribe("vllm+zmq://127.0.0.1:5557?replay=5558&source=pod-a&bytes_per_token=4096&disk_volume=nvme")
    assert type(sub).__name__ == "VllmSubscriber"
    conv = sub.converter  # type: ignore[attr-defined]
    assert (conv.config.source, conv.config.bytes_per_token, conv.config.disk_volume) == ("pod-a", 4096, "nvme")
    sg = subscribe("sglang+zmq://127.0.0.1:6000")
    assert type(sg).__name__ == "SglangSubscriber"
    assert sg.converter.config.source == "sglang@127.0.0.1:6000" and sg.converter.config.digest_rule == "first8"  # type: ignore[attr-defined]
    for bad in (
        "vllm+zmq://127.0.0.1:5557?bytes_per_token=-1",
        "vllm+zmq://127.0.0.1:5557?keep_peer_fields=maybe",
        "vllm+zmq://127.0.0.1:5557?namespace=x",
        "vllm+zmq://127.0.0.1",
        "vllm+zmq://0.0.0.0:5557",
        "sglang+zmq://127.0.0.1:1?source=" + "x" * 300,
    ):
        with pytest.raises(EventURLError):
            subscribe(bad)
    with pytest.raises(EventURLError, match="subscriber only"):
        make_publisher("vllm+zmq://127.0.0.1:5557", "w0")
    with pytest.raises(ConfigError):
        PeerConfig("s", bytes_per_token=-1)


def test_store_without_parent_of_a_known_block_keeps_its_recorded_parent_and_prefix() -> None:
    """vLLM's offloading events carry ``parent_block_hash=None`` for blocks it announced
    before (here blocks 2 and 3 stored on GPU, then offloaded to CPU)."""
    conv = vllm_converter(vllm_config("v", bytes_per_token=1, epoch=1))
    conv.convert(0, peer_batch([["BlockStored", [1, 2, 3], None, [], 4, None, "GPU"]]))
    offload = conv.convert(1, peer_batch([["BlockStored", [2, 3], None, [], 4, None, "CPU"]]))
    assert rows(offload) == [(S, 2, 1, 1, 4, "g2"), (S, 3, 1, 2, 4, "g2")]
    # the record kept its parent: a later Remove (of either copy) still carries it
    removed = conv.convert(2, peer_batch([["BlockRemoved", [2], "GPU"], ["BlockRemoved", [3], "CPU"]]))
    assert rows(removed) == [(R, 2, 1, 1, 4, "g1"), (R, 3, 1, 2, 4, "g2")]
    # a root block (recorded without a parent) stays a root; an unknown block is its own prefix
    roots = conv.convert(3, peer_batch([["BlockStored", [1, 9], None, [], 4, None, "CPU"]]))
    assert rows(roots) == [(S, 1, 1, None, 4, "g2"), (S, 9, 1, 1, 4, "g2")]
    fresh = conv.convert(4, peer_batch([["BlockStored", [50], None, [], 4, None, "CPU"]]))
    assert rows(fresh) == [(S, 50, 50, None, 4, "g2")]


def test_keep_peer_fields_copies_only_fields_of_their_documented_types() -> None:
    """With ``keep_peer_fields`` a peer's ``lora_name`` (str) and ``group_idx`` (int) go into
    ``extra_metadata``; a value of another type made a batch receivers refuse (e.g. a list
    nested past ``MAX_METADATA_DEPTH``: the whole converted batch failed ``decode_batch``).
    Such an event is malformed: skipped alone and counted."""
    from event_plane.codec import decode_batch, encode_batch

    conv = vllm_converter(vllm_config("v", keep_peer_fields=True, epoch=1))
    deep: object = "L"
    for _ in range(40):
        deep = [deep]
    fields = {"block_hashes": [1], "parent_block_hash": None, "token_ids": [], "block_size": 1, "medium": "CPU"}
    bad = [peer_event("BlockStored", {**fields, "lora_name": deep}),
           peer_event("BlockStored", {**fields, "group_idx": [1]}),
           peer_event("BlockStored", {**fields, "group_idx": True})]
    good = peer_event("BlockStored", {**fields, "block_hashes": [2], "lora_name": "L", "group_idx": 0})
    batch = conv.convert(0, enc([1.0, [*bad, good]]))
    assert decode_batch(encode_batch(batch)) == batch
    assert [e.sequence_hash for e in batch.events] == [2] and conv.stats.invalid_events == 3
    assert batch.events[0].extra_metadata == {"medium": "CPU", "lora_name": "L", "group_idx": 0}
    # without keep_peer_fields those fields are not read at all
    plain = vllm_converter(vllm_config("v", epoch=1)).convert(0, enc([1.0, [*bad, good]]))
    assert [e.sequence_hash for e in plain.events] == [1, 1, 1, 2]


def test_media_keeps_the_named_media_only() -> None:
    """``media=GPU``: an advisor that takes an offloading connector's tiers from the
    connector's own publisher skips them in vLLM's stream (counted); Cleared always passes."""
    sub = subscribe("vllm+zmq://127.0.0.1:5557?source=v&media=gpu")
    conv = sub.converter  # type: ignore[attr-defined]
    assert conv.config.only_media == ("GPU",)
    batch = conv.convert(0, peer_batch([
        ["BlockStored", [1], None, [], 1, None, "GPU"],
        ["BlockStored", [1], None, [], 1, None, "CPU"],
        ["BlockStored", [2], None, [], 1, None],  # no medium: GPU
        ["BlockRemoved", [1], "DISK"],
        ["BlockRemoved", [2], "GPU"],
        ["AllBlocksCleared"],
    ]))
    assert [(e.type, e.sequence_hash, e.storage_location) for e in batch.events] == [
        (S, 1, "g1"), (S, 2, "g1"), (R, 2, "g1"), (C, 0, "g1")]
    assert conv.stats.other_media_events == 2
    both = vllm_converter(vllm_config("v", only_media=("GPU", "CPU"), epoch=1))
    assert len(both.convert(0, peer_batch([["BlockStored", [1], None, [], 1, None, "CPU"]])).events) == 1
    with pytest.raises(EventURLError):
        subscribe("vllm+zmq://127.0.0.1:5557?media=,")
    with pytest.raises(ConfigError):
        vllm_config("v", only_media=("gpu",))
