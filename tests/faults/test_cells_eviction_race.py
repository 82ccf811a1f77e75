"""Blocks evicted (deleted, their segment freed) under a move or a compaction: only the
vanished blocks drop out.  A move group keeps its other blocks, the route is not marked
failed, and ``compact()`` skips deleted blocks, all of them included (docs/reliability.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from advisor import AdvisorService, PlanKind, PlanStatus
from advisor.policy.plan import PlanItem
from storage_backends import BlockKey, SqliteCatalog, StorageAgent
from tests.conftest import posix_agent
from tests.faults._world import NS, Worker, settings

NS_C = "ns-faults-compact-race"


def _after(obj: Any, name: str, then: Callable[[], None]) -> None:
    """Run ``then`` right after each call of ``obj.name`` returns (the race's window)."""
    orig = getattr(obj, name)

    def wrapped(*a: Any, **kw: Any) -> Any:
        out = orig(*a, **kw)
        if isinstance(out, Iterator):
            out = list(out)
        then()
        return out

    setattr(obj, name, wrapped)


def _promote(h: int) -> PlanItem:
    return PlanItem(PlanKind.PROMOTE, "test", "slow", "fast", sequence_hash=h, namespace=NS, bytes=64 << 10)


def _demote(h: int) -> PlanItem:
    return PlanItem(PlanKind.DEMOTE, "test", "fast", "slow", sequence_hash=h, namespace=NS, bytes=64 << 10)


def test_a_block_evicted_between_locate_and_copy_drops_only_that_block(tmp_path: Path) -> None:
    s = settings(tmp_path)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            first, second = [11, 12, 13, 14], [21, 22, 23]
            for h in first + second:
                w.put([h], "slow")  # one segment each: deleting a block frees its segment
            w.put([31], "fast")
            victim = 12
            gone = {"done": False}

            def evict() -> None:  # another process evicts the block once, right after the locate
                if not gone["done"]:
                    gone["done"] = True
                    assert w.agent.delete([BlockKey(NS, victim)]) == 1

            assert svc.mover is not None
            _after(svc.mover.agent, "locate", evict)
            items = [*map(_promote, first), _demote(31), *map(_promote, second)]
            res = {r.item.sequence_hash: r for r in svc.mover.execute_many(items)}
            assert gone["done"]
            assert res[victim].status is PlanStatus.SKIPPED, res[victim]
            for h in first + second:
                if h != victim:
                    assert res[h].status is PlanStatus.DONE, (h, res[h])
            assert res[31].status is PlanStatus.DONE
            assert w.where(first + second) == ["fast", None, "fast", "fast", "fast", "fast", "fast"]
            assert w.reads_back([h for h in first + second if h != victim] + [31])
    finally:
        w.close()


@pytest.mark.parametrize("deleted", [1, 4], ids=["one_of_four", "all_four"])
def test_compact_skips_blocks_deleted_under_it(tmp_path: Path, deleted: int) -> None:
    mover = posix_agent(tmp_path, "mover")
    other = StorageAgent(SqliteCatalog(tmp_path / "catalog.sqlite"), "other")
    try:
        for v in mover.volumes():
            other.register_volume(v)
        keys = [BlockKey(NS_C, h) for h in range(1, 9)]
        blocks = {k: torch.full((8192,), k.sequence_hash, dtype=torch.uint8) for k in keys}
        olds = mover.put([(k, blocks[k]) for k in keys], "fast")
        seg = olds[0].segment_id
        assert {p.segment_id for p in olds} == {seg}
        other.delete(keys[4:])  # half dead: a compaction candidate
        victims = keys[:deleted]
        _after(mover.catalog, "iter_segment", lambda: other.delete(victims))  # deleted after the listing
        moved = mover.compact("fast", seg)
        assert moved == 4 - deleted
        assert mover.catalog.segment("fast", seg) is None  # the old segment is gone either way
        assert other.exists(victims) == [False] * deleted
        rest = keys[deleted:4]
        got = other.get(rest)
        assert all(torch.equal(g, blocks[k]) for g, k in zip(got, rest))
    finally:
        other.close()
        mover.close()
