"""Hostile review of SqliteCatalog's placement cache through StorageAgent (commit 7290f78):
two agents, each with its own SqliteCatalog on one catalog file and one POSIX volume (real
NIXL POSIX transfers); one agent deletes, compacts, moves and re-puts while the other has
every placement cached.  The truth is read through a separate plain sqlite3 connection."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    MediaClass,
    Placement,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)

NS = "00000000cafef00d"
HASHES = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 1, (1 << 64) - 2, (1 << 64) - 1, 17, 18, 19]


def block(h: int) -> torch.Tensor:
    n = 512 + (h * 7919) % 4096
    g = torch.Generator().manual_seed(h % (1 << 62))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def truth(path: Path, keys: list[BlockKey]) -> list[Placement | None]:
    """Committed placements, through a new plain sqlite3 connection."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        out: list[Placement | None] = []
        for k in keys:
            seq = k.sequence_hash - (1 << 64) if k.sequence_hash >= 1 << 63 else k.sequence_hash
            r = db.execute("SELECT volume, segment, off, len, checksum, version FROM placements "
                           "WHERE ns=? AND seq=?", (k.namespace, seq)).fetchone()
            out.append(None if r is None else Placement(
                k, r[0], r[1], r[2], r[3], r[4] + (1 << 64) if r[4] < 0 else r[4], r[5]))
        return out
    finally:
        db.close()


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[tuple[StorageAgent, StorageAgent, Path]]:
    db = tmp_path / "catalog.sqlite"
    cats = [SqliteCatalog(db), SqliteCatalog(db)]
    out = []
    for i, cat in enumerate(cats):
        ag = StorageAgent(cat, name=f"cache-hostile-{i}-{tmp_path.name}")
        for vid, media in (("fast", MediaClass.NVME), ("slow", MediaClass.HDD)):
            ag.register_volume(VolumeDescriptor(vid, VolumeKind.POSIX, media, 1 << 30, root=str(tmp_path / vid)))
        out.append(ag)
    yield out[0], out[1], db
    for ag, cat in zip(out, cats):
        ag.close()
        cat.close()


def _check(a: StorageAgent, db: Path, keys: list[BlockKey]) -> None:
    """a's locate / exists answer the database, and every stored block reads back right."""
    want = truth(db, keys)
    assert a.locate(keys) == want
    assert a.exists(keys) == [p is not None for p in want]
    live = [k for k, p in zip(keys, want) if p is not None]
    for k, g in zip(live, a.get(live)):
        assert torch.equal(g, block(k.sequence_hash))
    assert a.catalog.quarantined() == []  # nothing condemned on the way


def test_the_other_agents_deletes_compactions_and_moves_are_seen(agents) -> None:  # type: ignore[no-untyped-def]
    a, b, db = agents
    keys = [BlockKey(NS, h) for h in HASHES]
    ps = a.put([(k, block(k.sequence_hash)) for k in keys], "fast")
    seg = ps[0].segment_id
    _check(a, db, keys)  # a has everything cached now
    # b deletes half: a must not find them any more
    assert b.delete(keys[::2]) == 5
    _check(a, db, keys)
    with pytest.raises(BlockNotFoundError):
        a.get([keys[0]])
    # b compacts the segment: its file is gone, a must read at the new place (no
    # quarantine of the blocks as "segment missing")
    old_file = a._vol("fast").path(seg)  # type: ignore[attr-defined]
    assert b.compact("fast", seg) == 5
    assert not old_file.exists()
    _check(a, db, keys)
    assert all(p is not None and p.segment_id != seg and p.version == 1 for p in a.locate(keys[1::2]))
    # b moves one block to the slow volume
    old = b.locate([keys[1]])[0]
    assert old is not None
    b.commit_move(old, b.copy(old, "slow"))
    _check(a, db, keys)
    assert a.locate([keys[1]])[0].volume_id == "slow"  # type: ignore[union-attr]
    # a deletes one: b sees it too
    assert a.delete([keys[3]]) == 1
    _check(b, db, keys)
    _check(a, db, keys)


def test_a_put_after_the_other_agent_deleted_the_key_stores_it_again(agents) -> None:  # type: ignore[no-untyped-def]
    """put skips keys the catalog already holds (get_many): a stale cached placement would
    make a's put skip a key b deleted, and the block would be lost."""
    a, b, db = agents
    keys = [BlockKey(NS, h) for h in HASHES]
    a.put([(k, block(k.sequence_hash)) for k in keys], "fast")
    assert all(a.exists(keys))
    assert b.delete(keys) == len(keys)
    ps = a.put([(k, block(k.sequence_hash)) for k in keys], "slow")
    assert [p.volume_id for p in ps] == ["slow"] * len(keys)
    assert all(p is not None for p in truth(db, keys))
    _check(a, db, keys)
    _check(b, db, keys)
