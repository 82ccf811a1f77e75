"""Block exports (kvbm_runtime.remote): hashes are checked when an export is decoded."""

from __future__ import annotations

import msgspec
import pytest

from kvbm_runtime.remote import BlockExport, ExportedLayout, RemoteBlock, RemoteBlockError

LAYOUT = ExportedLayout("owner", b"meta", b"descs", "DRAM", 0, {"kind": "FullyContiguous"}, "g2")


def test_an_export_round_trips_with_full_u64_hashes() -> None:
    exp = BlockExport(7, LAYOUT, [RemoteBlock(2**64 - 1, None, 2**64 - 1, 3, 0), RemoteBlock(5, 2**64 - 1, 2**64 - 1, 3, 1)])
    assert BlockExport.from_bytes(exp.to_bytes()) == exp
    assert [b.meta().sequence_hash for b in exp.blocks] == [2**64 - 1, 5]


@pytest.mark.parametrize(
    "block",
    [
        RemoteBlock(-1, None, 1, 3, 0),
        RemoteBlock(1, -2, 1, 3, 0),
        RemoteBlock(1, None, -1, 3, 0),
    ],
)
def test_a_negative_hash_is_a_malformed_export(block: RemoteBlock) -> None:
    """Refused at decode (RemoteBlockError, nothing allocated yet), not later as a
    BlockMetaError or an event the publisher rejects after registration."""
    data = BlockExport(7, LAYOUT, [block]).to_bytes()
    with pytest.raises(RemoteBlockError, match="malformed block export"):
        BlockExport.from_bytes(data)


def test_garbage_is_a_malformed_export() -> None:
    with pytest.raises(RemoteBlockError, match="malformed block export"):
        BlockExport.from_bytes(msgspec.msgpack.encode([1, 2, 3]))
