"""A deleted event stream makes the cluster's health fail, over a real JetStream and Redis:
someone with the advisor's NATS rights deletes ``KVADVISOR_EVENTS`` under a running advisor
(every fold's consumer goes with it, so the index would silently stop changing; on main
``/healthz`` kept answering 200 with the stale index). The advisor then answers every query
``unavailable``: the cluster API's health is 503 and lookups are 503, not stale answers."""

from __future__ import annotations

import asyncio
import uuid

from advisor.cluster.node import ClusterClient, ClusterNode, ClusterSettings, PartitionUnavailable, wait_until
from advisor.cluster.query import ClusterQuery
from event_plane.nats_transport import STREAM_NAME, connect_nats
from event_plane.partition import PartitionScheme
from kvadvisor.localcluster import NatsCluster

SCHEME = PartitionScheme(partitions=2)


def test_a_deleted_stream_makes_health_fail(tmp_path, redis_url: str) -> None:  # noqa: ANN001
    ns = "m" + uuid.uuid4().hex[:8]
    with NatsCluster(tmp_path / "nats", nodes=1) as cluster:
        url = cluster.advisor_url
        node = ClusterNode(ClusterSettings(nats_url=url, redis_url=redis_url, advisor_id="adv-m", scheme=SCHEME,
                                           namespace=ns, lease_ttl_s=3.0, heartbeat_s=0.5)).start()
        client = ClusterClient(url, SCHEME, ns, timeout_s=2.0)
        try:
            query = ClusterQuery(client)
            assert wait_until(lambda: query.health()["status"] == "ok", 30)

            async def delete() -> None:
                nc = await connect_nats(url, 5.0, {})
                await nc.jetstream().delete_stream(STREAM_NAME)
                await nc.close()

            asyncio.run(delete())
            assert wait_until(lambda: query.health()["status"] == "degraded", 20)
            try:
                client.lookup([1, 2, 3])
                raise AssertionError("a lookup was answered from a fold that reads nothing")
            except PartitionUnavailable as exc:
                assert "stream" in str(exc) and "missing" in str(exc)
        finally:
            client.close()
            node.stop()
