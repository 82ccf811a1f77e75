"""`kvadvisor up --nodes 1`: one nats-server with JetStream and no cluster block (a cluster
block without routes is refused: "JetStream cluster requires configured routes")."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvadvisor.localcluster import NatsCluster


def test_a_single_node_serves_jetstream(tmp_path: Path) -> None:
    async def roundtrip(url: str) -> bytes:
        import nats

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            await js.add_stream(name="one", subjects=["one.>"], num_replicas=1)
            await js.publish("one.a", b"block")
            msg = await js.get_msg("one", seq=1)
            return msg.data
        finally:
            await nc.close()

    with NatsCluster(tmp_path / "nats", nodes=1) as cluster:
        assert "cluster {" not in (tmp_path / "nats" / "n0.conf").read_text()
        assert asyncio.run(roundtrip(cluster.advisor_url)) == b"block"
