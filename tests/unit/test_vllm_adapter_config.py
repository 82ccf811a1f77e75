"""The vLLM connector's configuration and KV-cache views, without starting an engine."""

from __future__ import annotations

import pytest
import torch

from kvbm_runtime.connector import ConnectorError
from kvbm_runtime.vllm_adapter import ConnectorSettings, _rank_url, engine_block_views, sync_load_volumes
from storage_backends.types import MediaClass, VolumeDescriptor, VolumeKind


def test_extra_config_splits_settings_from_runtime_fields() -> None:
    s, runtime = ConnectorSettings.parse({"events_url": "zmq://127.0.0.1:5600?replay=5601", "g2_blocks": 64,
                                          "volume": {"id": "v", "kind": "posix", "media": "ssd",
                                                     "capacity_bytes": 1 << 20, "root": "/tmp/x"}})
    assert s.events_url.startswith("zmq://") and runtime == {"g2_blocks": 64}
    assert s.volume is not None and s.volume.descriptor().root == "/tmp/x"


@pytest.mark.parametrize("extra", [
    {"secret_key": "s"},
    {"volume": {"id": "v", "kind": "s3", "media": "object", "capacity_bytes": 1, "secret_key": "s"}},
    {"token": "t"},
])
def test_secrets_in_the_extra_config_are_refused(extra: dict) -> None:
    with pytest.raises(ConnectorError, match="must not carry"):
        ConnectorSettings.parse(extra)


def test_an_events_url_takes_a_password_file_never_a_password_or_token() -> None:
    for url in ("jetstream://w0:s3cr3t@127.0.0.1:4222?namespace=ns", "nats://s3cr3t@127.0.0.1:4222"):
        with pytest.raises(ConnectorError, match="password_file=PATH") as info:
            ConnectorSettings.parse({"events_url": url})
        assert "s3cr3t" not in str(info.value)
    url = "jetstream://127.0.0.1:4222?namespace=ns&partitions=8&password_file=/run/secrets/w0.json"
    assert ConnectorSettings.parse({"events_url": url})[0].events_url == url


def test_unknown_keys_and_bad_volumes_are_named() -> None:
    with pytest.raises(ConnectorError, match="g2_blokcs"):
        ConnectorSettings.parse({"g2_blokcs": 3})
    with pytest.raises(ConnectorError, match="capacity_bytes"):
        ConnectorSettings.parse({"volume": {"id": "v", "kind": "posix", "media": "ssd", "capacity_bytes": 0}})


def test_block_views_of_both_layouts_share_the_engine_memory() -> None:
    blocks_first = torch.zeros(6, 2, 4, 16)  # CPU backend: [num_blocks, ...]
    kv_first = torch.zeros(2, 6, 4, 2, 8)  # flash attention: [2, num_blocks, page, heads, head]
    views = engine_block_views({"a": blocks_first, "b": kv_first}, num_blocks=6, page_size=4)
    assert views["a"].shape == (6, 2, 4, 16) and views["b"].shape == (6, 2, 4, 16)
    views["a"][3].fill_(1.0)
    views["b"][5, 1].fill_(2.0)
    assert blocks_first[3].eq(1.0).all() and kv_first[1, 5].eq(2.0).all() and kv_first[0, 5].eq(0).all()
    with pytest.raises(ConnectorError, match="no block dimension"):
        engine_block_views({"c": torch.zeros(3, 3, 4, 4)}, num_blocks=6, page_size=4)


def test_rank_urls_shift_zmq_ports_only() -> None:
    assert _rank_url("zmq://127.0.0.1:5600?replay=5601", 2) == "zmq://127.0.0.1:5602?replay=5603"
    assert _rank_url("nats://127.0.0.1:4222", 3) == "nats://127.0.0.1:4222"
    assert _rank_url("zmq://127.0.0.1:5600?replay=5601", 0) == "zmq://127.0.0.1:5600?replay=5601"


def test_one_storage_declaration_excludes_the_single_volume_keys() -> None:
    s, _ = ConnectorSettings.parse({"storage_config": "/etc/kvadvisor/advisor.json", "landing_volume": "fast",
                                    "catalog_url": "redis://127.0.0.1:6379/0"})
    assert (s.storage_config, s.landing_volume) == ("/etc/kvadvisor/advisor.json", "fast")
    with pytest.raises(ConnectorError, match=r"drop \['volume', 'storage_catalog'\]"):
        ConnectorSettings.parse({"storage_config": "a.json", "storage_catalog": "/tmp/c.sqlite",
                                 "volume": {"id": "v", "kind": "posix", "media": "ssd", "capacity_bytes": 1, "root": "/t"}})
    with pytest.raises(ConnectorError, match="need \"storage_config\""):
        ConnectorSettings.parse({"landing_volume": "fast"})


def test_a_catalog_url_with_a_password_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConnectorError, match="KVADVISOR_CLUSTER_REDIS_URL") as ei:
        ConnectorSettings.parse({"storage_config": "s.json", "catalog_url": "redis://:hunter2@127.0.0.1:6379/0"})
    assert "hunter2" not in str(ei.value)


def test_posix_volumes_load_within_the_step_unless_the_config_names_others() -> None:
    vols = [VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 20, root="/v/fast"),
            VolumeDescriptor("archive", VolumeKind.S3, MediaClass.OBJECT, 1 << 20, endpoint="http://127.0.0.1:9", bucket="b")]
    assert sync_load_volumes(vols, None) == ["fast"]
    assert sync_load_volumes(vols, []) == []
    assert sync_load_volumes(vols, ["archive"]) == ["archive"]
    with pytest.raises(ConnectorError, match=r"\['cold'\] are not declared"):
        sync_load_volumes(vols, ["cold"])
    s, _ = ConnectorSettings.parse({"storage_config": "a.json", "sync_load_volumes": ["fast"]})
    assert s.sync_load_volumes == ["fast"]
    with pytest.raises(ConnectorError, match="need \"storage_config\""):
        ConnectorSettings.parse({"sync_load_volumes": ["fast"]})
