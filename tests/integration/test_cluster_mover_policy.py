"""The scaled mover ranks each partition's moves by that partition's own expert selection
(advisor/cluster/mover.py, "Ranking"), on a private nats-server (JetStream, lease bucket),
Redis (snapshots, placement catalog) and POSIX volumes through NIXL: one in-process cluster
advisor over 2 partitions and workers announcing through :class:`PartitionedPublisher`
(the rig of ``test_cluster_mover_races``).

The workload is the live selector's own case (``tests/unit/test_live_selector.py``,
``conversations``): conversations taking turns, whose blocks are next read after S3-FIFO's
small queue let them go, so S3-FIFO, the starting leader, loses.  Checked: each partition's
selector, fed only the batches its replica folds, leaves S3-FIFO for the leader the
evaluator's selection gives on the same window (one implementation); a round's demotions
are ranked in that leader's order (their reasons name it); the cluster API's ``/v1/stats``
shows each partition's leader; a mover's batches are not requests; and a partition's round
demotes the branches its selector names superseded first (``LiveSelector.superseded``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient

from advisor.cluster.node import ClusterClient, PartitionUnavailable
from advisor.cluster.query import ClusterQuery
from advisor.policy.eviction import experts
from advisor.policy.eviction.compact import compact
from advisor.policy.plan import PlanKind
from api.app import create_app
from event_plane.partitioned import PartitionedPublisher, partition_url
from event_plane.schema import store
from event_plane.urls import make_publisher
from storage_backends import BlockKey
from tests.integration.test_cluster_mover_races import BLK, KEY_NS, _chain, _data, rig_factory  # noqa: F401
from tests.polling import wait_until
from tests.unit.test_live_selector import conversations


def _announce_requests(rig: Any, w: str, reqs: list[list[int]]) -> None:
    """Each request Stores its whole path at g1, as a worker that served it."""
    for r in reqs:
        rig.announce(w, [store(h, r[0], r[d - 1] if d else None, BLK, "g1") for d, h in enumerate(r)])


def _cluster_api(rig: Any) -> tuple[Any, ClusterClient, TestClient]:
    """Start the rig's cluster advisor; ``(node, client, http)``: a client of the cluster and
    the REST API over it (close both)."""
    node = rig.start()
    client = ClusterClient(rig.js_url, rig.scheme, rig.ns, timeout_s=5.0)
    return node, client, TestClient(create_app(ClusterQuery(client)), base_url="http://127.0.0.1")


def _partitions_policy(http: TestClient) -> dict[str, Any]:
    """``/v1/stats``'s ``policy.partitions``: each partition's expert selection."""
    r = http.get("/v1/stats")
    assert r.status_code == 200, r.text
    return r.json()["policy"]["partitions"]  # type: ignore[no-any-return]


def _folded(rig: Any, node: Any, marker: int) -> None:
    """Announce a one-block chain (a trunk block: every partition folds it) and wait until
    every replica indexed it, so every partition folded what was announced before."""
    rig.announce("w0", [store(marker, marker, None, BLK, "g1")])

    def known(rep: Any) -> bool:
        with rep.lock:
            return rep.index.block(marker) is not None
    wait_until(lambda: all(known(rep) for rep in node.serving().values()), 60, "every partition known")


def test_each_partition_ranks_by_its_own_leader_and_stats_show_it(rig_factory: Any) -> None:  # noqa: F811
    # fast: 4 MiB = 256 blocks, 128 per partition's share; demote below half of that share
    rig = rig_factory(partitions=2, demotion={"high_watermark": 0.5, "low_watermark": 0.3})
    node, client, http = _cluster_api(rig)
    try:
        def policy() -> dict[str, Any]:
            return _partitions_policy(http)

        assert {p: st["leader"] for p, st in policy().items()} == {"0": "s3fifo_tail", "1": "s3fifo_tail"}
        # blocks on fast, announced there: each partition's share is over its watermark
        rng = random.Random(11)
        on_fast = [[rng.getrandbits(63) for _ in range(8)] for _ in range(22)]
        rig.agent.put([(BlockKey(KEY_NS, h), _data(h)) for c in on_fast for h in c], "fast")
        for c in on_fast:
            rig.announce("w0", [store(h, c[0], c[d - 1] if d else None, BLK, "fast") for d, h in enumerate(c)])
        _announce_requests(rig, "w1", conversations())
        _folded(rig, node, 1 << 62)
        reps = node.serving()
        before = {p: rep.selector.stats()["requests"] for p, rep in reps.items()}
        assert all(n > 0 for n in before.values()), before

        # a mover's batches (any advisor's "<id>-mover") are moves, not requests
        host = rig.js_url.split("//", 1)[1]
        base = f"jetstream://{host}?namespace={rig.ns}"
        mover_pub = PartitionedPublisher(rig.scheme, lambda k: make_publisher(
            partition_url(base, k), "a9-mover", epoch=5))
        try:
            c = _chain(6, 3)
            mover_pub.publish([store(h, c[0], c[d - 1] if d else None, BLK, "g1") for d, h in enumerate(c)])
            mover_pub.flush()
        finally:
            mover_pub.close()
        _folded(rig, node, (1 << 62) + 1)  # one worker request (a run) per partition
        assert {p: rep.selector.stats()["requests"] for p, rep in reps.items()} == {p: n + 1 for p, n in before.items()}

        results = node.mover.run_round()
        cap = rig.storage.volumes[0].capacity_bytes // rig.scheme.partitions // BLK
        leaders = {}
        for p, rep in sorted(reps.items()):
            # the evaluator's selection on the very requests this partition's selector holds
            want = experts.EXPERTS[experts.next_leader(compact([list(w.path) for w in rep.selector.window()]), cap)[0]]
            assert rep.selector.leader == want != "s3fifo_tail", (p, rep.selector.stats())
            leaders[str(p)] = want
        stats = policy()
        assert {p: st["leader"] for p, st in stats.items()} == leaders
        assert all(st["switches"] >= 1 and st["window_refs"] > 0 for st in stats.values()), stats
        # the round's demotions are ranked in the partitions' leaders' order, not the starting one's
        demoted = [r.item.reason for r in results if r.item.kind is PlanKind.DEMOTE]
        assert demoted, [(r.item.kind, r.status, r.detail) for r in results]
        names = {ld.replace("_", "-") for ld in leaders.values()}
        assert all(any(f"{n} leaf" in why for n in names) and "s3fifo-tail" not in why for why in demoted), demoted[:3]
    finally:
        http.close()
        client.close()


def test_a_partition_demotes_the_superseded_branch_first(rig_factory: Any) -> None:  # noqa: F811
    # the scaled twin of the embedded service's test (tests/unit/test_live_selector.py): one
    # partition's selector, fed the requests its replica folds, names the branches its
    # prefix_value replay ranks first (conversations that compacted and left them), and the
    # partition's round hands that verdict to the planner: the first demotions from fast are
    # the dead branch's leaves, though the live branch beside it was accessed earlier
    from tests.unit.test_eviction_prefix_value import compactions

    cap = (4 << 20) // BLK  # the one partition's share of fast, in blocks
    rig = rig_factory(partitions=1, demotion={"scoring": "prefix_value", "high_watermark": 8.5 / cap,
                                              "low_watermark": 7 / cap})
    node = rig.start()
    reqs, dead, new = compactions(5_000)
    live = new[0][2:]
    _announce_requests(rig, "w1", reqs)
    for branch in (live, dead[-1]):  # offloaded to fast: the live branch first
        rig.agent.put([(BlockKey(KEY_NS, h), _data(h)) for h in branch], "fast")
        rig.announce("w0", [store(h, branch[0], branch[d - 1] if d else None, BLK, "fast")
                            for d, h in enumerate(branch)])
    _folded(rig, node, 1 << 62)
    (rep,) = node.serving().values()
    results = node.mover.run_round()
    assert set(dead[-1]) <= rep.selector.superseded and not set(live) & rep.selector.superseded
    demoted = [r.item.sequence_hash for r in results if r.item.kind is PlanKind.DEMOTE]
    assert demoted == dead[-1][::-1][:2], [(r.item.sequence_hash, r.item.reason) for r in results]
    assert all("superseded branch" in r.item.reason for r in results if r.item.kind is PlanKind.DEMOTE)


def test_the_cluster_api_hands_a_finish_hint_to_the_partition_that_saw_the_request(rig_factory: Any) -> None:  # noqa: F811
    # POST /v1/finished on a partitioned cluster's API: the hint goes to the owner of the
    # prompt's last piece (whose selector saw the request's Stores), an all-trunk prompt to
    # every partition, and a malformed hint from a peer on the query subject is refused
    rig = rig_factory(partitions=2)
    node, client, http = _cluster_api(rig)
    try:
        def hints() -> dict[str, int]:
            return {p: int(st["finish_hints"]) for p, st in _partitions_policy(http).items()}

        chain = _chain(12, 12)  # trunk block, then a stretch of 8, then one more stretch
        owner = rig.scheme.pieces(chain)[-1].partition
        assert owner in (0, 1) and rig.scheme.pieces(chain)[1].partition >= 0
        other = 1 - owner
        assert hints() == {"0": 0, "1": 0}
        r = http.post("/v1/finished", json={"sequence_hashes": [hex(h) for h in chain], "finish_reason": "tool_calls"})
        assert r.status_code == 200, r.text
        assert r.json() == {"taken": True, "finish_class": "tool_call"}
        assert hints() == {str(owner): 1, str(other): 0}
        r = http.post("/v1/finished", json={"sequence_hashes": chain[:1], "finish_reason": "end_turn"})
        assert r.status_code == 200 and r.json()["finish_class"] == "end_turn", r.text
        assert hints() == {str(owner): 2, str(other): 1}
        for bad in ({"op": "finished", "hash": -1, "reason": "stop"}, {"op": "finished", "hash": True, "reason": "x"},
                    {"op": "finished", "hash": 5, "reason": 7}, {"op": "finished", "hash": "5", "reason": "x"}):
            with pytest.raises(PartitionUnavailable, match="bad request"):
                client._request(owner, bad)
        assert hints() == {str(owner): 2, str(other): 1}
        # an all-trunk hint while one partition cannot answer (rebuilding): the other still
        # takes it, whichever of the two is asked first, and the router is told to retry
        for down in (0, 1):
            up = 1 - down
            before = hints()[str(up)]
            part = node.serving()[down]
            part.ready.clear()
            try:
                r = http.post("/v1/finished", json={"sequence_hashes": [0xABC0 + down], "finish_reason": "stop"})
                assert r.status_code == 503 and "Retry-After" in r.headers, (r.status_code, r.text)
            finally:
                part.ready.set()
            assert hints()[str(up)] == before + 1, (down, hints())
    finally:
        http.close()
        client.close()
