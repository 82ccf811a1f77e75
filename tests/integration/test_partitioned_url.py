"""Any publisher, the runtime's included, routes to the index partitions from its URL alone:
``jetstream://...?namespace=NS&partitions=P`` (real nats-server).

A KVBM worker (``kvbm_runtime.BlockManager``, the runtime the vLLM connector embeds) given
such a URL publishes each block to the partition that owns it, a trunk block to every
partition, and its ``stats()`` sum the partitions' publishers.
"""

from __future__ import annotations

import uuid

import pytest

from event_plane.errors import EventURLError
from event_plane.partition import TRUNK, PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_namespace
from event_plane.urls import make_publisher, subscribe
from kvadvisor.trace import bundled_trace, read_mooncake, request_tokens
from kvbm_runtime import BlockManager, RuntimeConfig, fill_synthetic_kv
from tests.logs import fold_log


def test_a_worker_given_a_partitioned_url_feeds_each_partition_its_blocks(js_url: str) -> None:
    ns = "u" + uuid.uuid4().hex[:8]
    scheme = PartitionScheme(partitions=4, trunk_depth=1, stretch=2)
    url = f"jetstream://{js_url.split('://')[1]}?namespace={ns}&partitions=4&trunk_depth=1&stretch=2"
    pub = make_publisher(url, "w0", epoch=11, manage_stream=True)  # first on its server
    assert isinstance(pub, PartitionedPublisher) and (pub.source, pub.epoch) == ("w0", 11)
    cfg = RuntimeConfig(model_name="test/partitioned-url", num_layers=1, outer_dim=2, page_size=512, inner_dim=2,
                        kv_dtype="float16", g1_blocks=2048, g2_blocks=2048)  # nothing evicted
    mgr = BlockManager(cfg, pub)
    chains = []
    try:
        for req in read_mooncake(bundled_trace(), limit=40):
            chains.append(list(mgr.serve(request_tokens(req, 512), fill_synthetic_kv).sequence_hashes))
    finally:
        mgr.close()
        pub.close()
    parts = [fold_log(js_url, partition_namespace(ns, k)) for k in range(scheme.partitions)]
    want: list[set[int]] = [set() for _ in range(scheme.partitions)]
    for chain in chains:
        for h, owner in zip(chain, scheme.owners(chain)):
            for k in (range(scheme.partitions) if owner == TRUNK else [owner]):
                want[k].add(h)
    got = [set(idx.hashes()) for idx in parts]
    assert all(got), got
    assert got == want  # every block where its partition is, and nowhere else
    total = pub.stats()
    assert total.dropped == 0
    assert total.events == sum(st.events for st in pub.partition_stats()) > 0
    assert total.batches == sum(st.batches for st in pub.partition_stats())


def test_partition_parameters_are_checked_and_publisher_only(js_url: str) -> None:
    base = f"jetstream://{js_url.split('://')[1]}?namespace=bad"
    for q in ("&partitions=0", "&partitions=x", "&partitions=4&stretch=0", "&trunk_depth=1", "&stretch=4"):
        with pytest.raises(EventURLError):
            make_publisher(base + q, "w0")
    with pytest.raises(EventURLError, match="publisher parameters"):
        subscribe(base + "&partitions=4")
