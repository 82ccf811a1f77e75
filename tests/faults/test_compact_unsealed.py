"""Finding 7: ``StorageAgent.compact`` refuses an unsealed segment, whose in-flight copy it
would otherwise destroy; the copy then commits and reads back byte-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage_backends import BlockKey, InvalidRequestError, SqliteCatalog, StorageAgent
from tests.conftest import posix_agent

NS = "ns-faults-compact"


def _block(h: int) -> torch.Tensor:
    return torch.full((8192,), h % 251, dtype=torch.uint8)


def test_compact_refuses_a_segment_with_an_in_flight_copy(tmp_path: Path) -> None:
    mover = posix_agent(tmp_path, "mover")
    other = StorageAgent(SqliteCatalog(tmp_path / "catalog.sqlite"), "other")
    try:
        for v in mover.volumes():
            other.register_volume(v)
        keys = [BlockKey(NS, h) for h in (1, 2, 3)]
        olds = mover.put([(k, _block(k.sequence_hash)) for k in keys], "fast")
        news = mover.copy_many(olds, "fast")  # copied, verified, not committed: segment unsealed
        seg = news[0].segment_id
        assert not mover.catalog.segment("fast", seg).sealed
        for agent in (mover, other):  # this process's pending copy, and another process's view
            with pytest.raises(InvalidRequestError, match="not sealed"):
                agent.compact("fast", seg)
        assert mover.catalog.segment("fast", seg) is not None  # nothing dropped
        for old, new in zip(olds, news):
            mover.commit_move(old, new)
        got = other.get(keys)
        assert all(torch.equal(g, _block(k.sequence_hash)) for g, k in zip(got, keys))
        assert [p.segment_id for p in other.locate(keys)] == [seg] * 3
        assert other.compact("fast", seg) == 3  # sealed now: compaction is allowed
        assert all(torch.equal(g, _block(k.sequence_hash)) for g, k in zip(other.get(keys), keys))
    finally:
        other.close()
        mover.close()
