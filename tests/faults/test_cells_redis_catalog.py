"""Fault cell: the Redis placement catalog killed (-9) mid-move, then restarted from its
append-only file (a private ``redis-server``, ``appendfsync always``, as a deployment that
keeps its catalog runs it), under the scaled mover (private JetStream, POSIX volumes
through NIXL).  The round's moves fail with the catalog's error and lose nothing; once Redis
is back the next rounds promote, every partition's index agrees with the catalog, every
block reads back byte-exact, and the killed moves' copies are collected
(docs/reliability.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from advisor import PlanStatus
from storage_backends import free_port
from tests.faults._world import start_redis
from tests.integration.test_cluster_mover_races import Rig, _chain


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    d = tmp_path / "redis"
    d.mkdir()
    r = {"port": port, "dir": d, "proc": start_redis(port, d), "url": f"redis://127.0.0.1:{port}/0"}
    yield r
    r["proc"].kill()
    r["proc"].wait()


def test_redis_catalog_killed_mid_move_and_restarted(tmp_path: Path, js_url: str, private_redis: dict) -> None:
    rig = Rig(tmp_path / "rig", js_url, private_redis["url"], partitions=2)
    try:
        chain = _chain(6, 28)
        rig.offload(chain)
        node = rig.start()
        agent = node.mover.agent
        real_copy = agent.copy_many
        killed: list[int] = []

        def copy_then_kill_redis(*a: Any, **kw: Any) -> Any:
            out = real_copy(*a, **kw)  # copied and verified on fast, not committed
            if not killed:
                private_redis["proc"].kill()
                private_redis["proc"].wait()
                killed.append(len(out))
            return out

        agent.copy_many = copy_then_kill_redis  # type: ignore[method-assign]
        rig.folded(node)
        results = node.mover.run_round()  # must not raise
        agent.copy_many = real_copy  # type: ignore[method-assign]
        assert killed, [(r.item, r.status, r.detail) for r in results]
        moves = [r for r in results if r.item.sequence_hash is not None]
        assert moves and all(r.status is not PlanStatus.DONE for r in moves), [(r.status, r.detail) for r in moves]
        assert any(r.status is PlanStatus.FAILED for r in moves)
        private_redis["proc"] = start_redis(private_redis["port"], private_redis["dir"])  # back, from its AOF
        assert rig.settle(node) == []
        assert {pl.volume_id for pl in rig.catalog.iter_volume("fast")} == {"fast"}
        promoted = {pl.key.sequence_hash for pl in rig.catalog.iter_volume("fast")}
        assert promoted == set(chain)
        rig.read_back()
        # the killed moves' copies (unsealed, without a live block) are collected
        agent.collect_garbage("fast", min_age_s=0)
        segs = {s.segment_id: s for s in rig.catalog.segments("fast")}
        assert all(s.live_blocks > 0 for s in segs.values()), segs
        on_disk = {int(p.name.split("-")[1].split(".")[0]) for p in (tmp_path / "rig" / "fast").rglob("seg-*")}
        assert on_disk == set(segs), (on_disk, set(segs))
    finally:
        rig.close()
