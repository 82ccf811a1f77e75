"""The test vectors of docs/events.md §9 match the code byte for byte."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from event_plane import CodecError, EventBatch, decode_batch, encode_batch

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"
_BLOCK = re.compile(r"```kvevent-vector\n(.*?)```", re.S)


def _vectors() -> list[dict[str, str]]:
    vectors = []
    for body in _BLOCK.findall(DOC.read_text(encoding="utf-8")):
        fields: dict[str, str] = {}
        for line in body.strip().splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        vectors.append(fields)
    return vectors


VECTORS = _vectors()


def test_doc_has_at_least_three_valid_and_two_rejected_vectors() -> None:
    valid = [v for v in VECTORS if v.get("expect") != "error"]
    rejected = [v for v in VECTORS if v.get("expect") == "error"]
    assert len(valid) >= 3 and len(rejected) >= 2
    assert len({v["name"] for v in VECTORS}) == len(VECTORS)


@pytest.mark.parametrize("vector", [v for v in VECTORS if v.get("expect") != "error"], ids=lambda v: v["name"])
def test_vector_decodes_and_encodes_byte_exact(vector: dict[str, str]) -> None:
    wire = bytes.fromhex(vector["hex"])
    expected = msgspec.convert(json.loads(vector["value"]), EventBatch)
    assert decode_batch(wire) == expected
    assert encode_batch(expected) == wire
    # and the decoded value, re-encoded, is the same bytes
    assert encode_batch(decode_batch(wire)) == wire


@pytest.mark.parametrize("vector", [v for v in VECTORS if v.get("expect") == "error"], ids=lambda v: v["name"])
def test_rejected_vector_raises_codec_error(vector: dict[str, str]) -> None:
    with pytest.raises(CodecError):
        decode_batch(bytes.fromhex(vector["hex"]))


def test_u64_vector_keeps_hashes_above_2_63_unsigned() -> None:
    (vector,) = [v for v in VECTORS if v["name"] == "metadata-u64"]
    batch = decode_batch(bytes.fromhex(vector["hex"]))
    ev = batch.events[0]
    assert (ev.sequence_hash, ev.prefix_hash, ev.parent_hash) == (2**63, 2**63 + 1, 2**64 - 2)
    assert ev.extra_metadata == {"hits": 3, "tier": "nvme"}
    assert batch.epoch == 2**64 - 1
