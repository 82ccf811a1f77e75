"""Injective names: encoded components, S3 object keys (case C13 for names), checksums."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from storage_backends import MediaClass, VolumeConfigError, VolumeDescriptor, VolumeKind, checksum, validate_descriptor
from storage_backends.keys import (
    MAX_OBJECT_KEY_BYTES,
    encode_component,
    parse_segment_name,
    segment_file_name,
    segment_object_key,
    validate_volume_id,
)

NASTY = ["org/model_a", "org_model/a", "a-SEP-b", "a%2Fb", "a/b", "with space", "a+b", "a=b", "βeta", ".", "..", "x" * 100]


def test_encoded_components_are_distinct_and_safe() -> None:
    enc = [encode_component(n) for n in NASTY]
    assert len(set(enc)) == len(NASTY)
    for e in enc:
        assert e and "/" not in e and e not in (".", "..")
        assert all(c.isalnum() or c in "%_-" for c in e)


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_encode_component_is_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_component(a) != encode_component(b)


def test_object_keys_distinct_valid_and_bounded() -> None:
    prefixes = ["", "kv", "org/model_a", "org_model/a", "p with space/+=/βeta", "y" * 600]
    keys = {segment_object_key(p, v, s) for p in prefixes for v in NASTY for s in (1, 10**15)}
    assert len(keys) == len(prefixes) * len(NASTY) * 2
    for k in keys:
        raw = k.encode("utf-8")
        assert 0 < len(raw) <= MAX_OBJECT_KEY_BYTES
        assert not k.startswith("/") and "//" not in k
        assert parse_segment_name(k) is not None


def test_overlong_or_bad_prefixes_are_refused() -> None:
    with pytest.raises(VolumeConfigError, match="600"):
        segment_object_key("z" * 901, "v", 1)
    with pytest.raises(VolumeConfigError, match="segment"):
        segment_object_key("a//b", "v", 1)
    with pytest.raises(VolumeConfigError, match="control"):
        segment_object_key("a\nb", "v", 1)


def test_segment_names_round_trip() -> None:
    for s in (0, 1, 123456789012, 10**15):
        assert parse_segment_name(segment_file_name(s)) == s
    assert parse_segment_name("seg-1.kvs") is None
    assert parse_segment_name("other") is None


def test_checksum_is_xxh3_of_the_contiguous_bytes() -> None:
    t = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    assert checksum(t) == xxhash.xxh3_64_intdigest(t.numpy().tobytes())
    assert checksum(t.t()) == xxhash.xxh3_64_intdigest(t.t().contiguous().numpy().tobytes())
    b = torch.ones(8, dtype=torch.bfloat16)
    assert checksum(b) == xxhash.xxh3_64_intdigest(b.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(
    ("vid", "rule"),
    [
        ("", "non-empty"), (" ", "whitespace"), ("\t", "control"), ("fast ssd", "whitespace"),
        ("fast\u00a0ssd", "whitespace"), ("a\x85b", "control"), ("w/g1", "'/'"), ("/", "'/'"),
        (".", "'.' and '..'"), ("..", "'.' and '..'"), ("g1", "reserved"), ("g2", "reserved"),
        ("G1", "reserved"), ("G2", "reserved"), ("x" * 129, "longer than 128"), ("é" * 65, "longer than 128"),
        (None, "non-empty"), (7, "non-empty"),
    ],
)
def test_volume_ids_must_be_single_tokens_and_not_tier_names(vid: object, rule: str) -> None:
    """A volume id is an event ``storage_location``: one token, never ``g1``/``g2``."""
    with pytest.raises(VolumeConfigError, match=rule):
        validate_volume_id(vid)  # type: ignore[arg-type]
    if isinstance(vid, str) and vid:
        with pytest.raises(VolumeConfigError, match=rule):  # what register_volume runs first
            validate_descriptor(VolumeDescriptor(vid, VolumeKind.POSIX, MediaClass.NVME, 1 << 20, root="/tmp/x"))


@pytest.mark.parametrize("vid", ["fast", "g3", "g12", "G1x", "nvme-0", "a.b", "...", "a%2Fb", "βeta", "x" * 128])
def test_ordinary_volume_ids_are_accepted(vid: str) -> None:
    validate_volume_id(vid)
