"""Volume stats exported to Prometheus: scrape a CollectorRegistry (text format) and check
exact values after puts, gets, deletes and a compaction, on a posix and an S3 volume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from storage_backends import (
    BlockKey,
    LocalS3,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
    register_storage_metrics,
)


def scrape(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(m: dict, name: str, volume: str, **labels: str) -> float:  # type: ignore[type-arg]
    return m[(name, tuple(sorted({"volume": volume, **labels}.items())))]


@pytest.fixture
def agent(tmp_path: Path, local_s3: LocalS3) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"metrics-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 10 << 20, root=str(tmp_path / "f")))
    a.register_volume(VolumeDescriptor("cold", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=local_s3.endpoint,
                                       bucket=f"kvadvisor-metrics-{tmp_path.name[-20:].lower().replace('_', '-')}",
                                       access_key=local_s3.access_key, secret_key=local_s3.secret_key))
    yield a
    a.close()
    cat.close()


def test_scrape_after_puts_gets_deletes_and_compaction(agent: StorageAgent) -> None:
    reg = CollectorRegistry()
    register_storage_metrics(agent, reg)
    m = scrape(reg)
    assert v(m, "kvadvisor_storage_capacity_bytes", "fast") == 10 << 20
    assert v(m, "kvadvisor_storage_used_bytes", "fast") == 0 and v(m, "kvadvisor_storage_segments", "cold") == 0

    keys = [BlockKey("ns", i) for i in range(4)]
    agent.put([(k, torch.full((1000 * (i + 1),), i, dtype=torch.uint8)) for i, k in enumerate(keys)], "fast")
    agent.put([(BlockKey("ns", 9), torch.ones(3000, dtype=torch.uint8))], "cold")
    agent.get(keys[:2])
    agent.get([keys[0]])
    agent.get([BlockKey("ns", 9)])
    agent.delete([keys[1], keys[3]])  # 2000 + 4000 bytes become dead
    m = scrape(reg)
    assert v(m, "kvadvisor_storage_used_bytes", "fast") == 10_000
    assert v(m, "kvadvisor_storage_live_bytes", "fast") == 4000
    assert v(m, "kvadvisor_storage_dead_bytes", "fast") == 6000
    assert v(m, "kvadvisor_storage_segments", "fast") == 1 and v(m, "kvadvisor_storage_blocks", "fast") == 2
    assert v(m, "kvadvisor_storage_blocks_written_total", "fast") == 4
    assert v(m, "kvadvisor_storage_blocks_read_total", "fast") == 3
    assert v(m, "kvadvisor_storage_bytes_written_total", "fast") == 10_000
    assert v(m, "kvadvisor_storage_bytes_read_total", "fast") == 1000 + 2000 + 1000
    assert v(m, "kvadvisor_storage_bytes_read_cached_total", "fast") == 1000 + 2000 + 1000  # just written: in memory
    assert v(m, "kvadvisor_storage_bytes_read_cached_total", "cold") == 0
    assert v(m, "kvadvisor_storage_segments_written_total", "fast") == 1
    assert v(m, "kvadvisor_storage_live_bytes", "cold") == 3000 and v(m, "kvadvisor_storage_blocks_written_total", "cold") == 1
    assert v(m, "kvadvisor_storage_blocks_read_total", "cold") == 1
    assert v(m, "kvadvisor_storage_volume_events_total", "cold", event="ranged_gets") == 1

    seg = agent.segments("fast")[0].segment_id
    assert agent.compact("fast", seg) == 2
    m = scrape(reg)
    assert (v(m, "kvadvisor_storage_used_bytes", "fast"), v(m, "kvadvisor_storage_dead_bytes", "fast")) == (4000, 0)
    assert v(m, "kvadvisor_storage_segments_deleted_total", "fast") == 1
    assert v(m, "kvadvisor_storage_segments_written_total", "fast") == 2
    assert m[("kvadvisor_storage_agent_events_total", (("event", "segments_dropped"),))] == 1

    agent.delete([keys[0], keys[2], BlockKey("ns", 9)])
    m = scrape(reg)
    assert v(m, "kvadvisor_storage_used_bytes", "fast") == 0 and v(m, "kvadvisor_storage_segments", "cold") == 0
    assert v(m, "kvadvisor_storage_segments_deleted_total", "cold") == 1
    assert m[("kvadvisor_storage_agent_events_total", (("event", "segments_dropped"),))] == 3
