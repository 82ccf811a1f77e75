"""Configuration: every KVBM environment name is accepted; shrinking capacities are refused
with the numbers; the metrics endpoint serves on the configured port; the vLLM adapter's
import guard."""

from __future__ import annotations

import importlib
import importlib.util

import httpx
import pytest

from event_plane import NullPublisher
from kvbm_runtime import BlockManager, CapacityConfigError, RuntimeConfig, fill_synthetic_kv
from storage_backends import free_port

KVBM_ENV = {
    "DYN_KVBM_CPU_CACHE_GB": "0.0001",
    "DYN_KVBM_DISK_CACHE_GB": "0.001",
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
    "DYN_KVBM_DISK_ZEROFILL_FALLBACK": "true",
    "DYN_KVBM_DISK_ALLOCATOR_TYPE": "posix_fallocate",
    "DYN_KVBM_DISK_DISABLE_O_DIRECT": "1",
    "DYN_KVBM_METRICS": "true",
    "DYN_KVBM_METRICS_PORT": "7001",
    "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "45",
}


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith(("DYN_KVBM_", "KVADVISOR_RUNTIME_")):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_kvbm_name_is_accepted(clean_env: pytest.MonkeyPatch) -> None:
    for k, v in KVBM_ENV.items():
        clean_env.setenv(k, v)
    cfg = RuntimeConfig(g1_blocks=1)
    bb = cfg.layout_config().block_bytes  # 2 layers x 2 x 16 tokens x 64 x 2 bytes
    assert bb == 8192
    assert cfg.g2_blocks == 100_000 // bb and cfg.g3_blocks == 1_000_000 // bb
    assert cfg.disable_disk_offload_filter and not cfg.offload_filter_enabled
    assert cfg.disk_zerofill_fallback and cfg.disk_allocator_type == "posix_fallocate"
    assert cfg.disk_disable_o_direct and cfg.volume_options() == {
        "o_direct": False,
        "zerofill_fallback": True,
        "allocator_type": "posix_fallocate",
    }
    assert cfg.metrics and cfg.metrics_port == 7001
    assert cfg.leader_worker_init_timeout_secs == 45.0
    # block-count overrides win over GB sizes
    clean_env.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "40")
    clean_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "400")
    cfg = RuntimeConfig(g1_blocks=1)
    assert (cfg.g2_blocks, cfg.g3_blocks) == (40, 400)


def test_defaults_and_own_prefix(clean_env: pytest.MonkeyPatch) -> None:
    cfg = RuntimeConfig()
    assert cfg.offload_filter_enabled and not cfg.metrics and cfg.metrics_port == 6880
    assert cfg.volume_options()["o_direct"] is True and cfg.namespace_suffix() == ""
    clean_env.setenv("KVADVISOR_RUNTIME_DISK_OFFLOAD_FILTER", "false")
    clean_env.setenv("KVADVISOR_RUNTIME_METRICS_PORT", "0")
    cfg = RuntimeConfig()
    assert not cfg.offload_filter_enabled and cfg.metrics_port == 0
    clean_env.setenv("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "-1")
    with pytest.raises(ValueError, match="leader_worker_init_timeout_secs"):
        RuntimeConfig()


def test_shrinking_capacities_from_kvbm_sizes_are_refused_with_numbers(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DYN_KVBM_CPU_CACHE_GB", "0.0001")  # 100 kB / 8192 B = 12 blocks
    with pytest.raises(CapacityConfigError, match="G1 has 64 blocks but G2 only 12"):
        BlockManager(RuntimeConfig(g1_blocks=64), NullPublisher("cfg"))
    clean_env.setenv("DYN_KVBM_CPU_CACHE_GB", "1")
    clean_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "100")
    with pytest.raises(CapacityConfigError, match="G2 has 122070 blocks but G3 only 100"):
        BlockManager(RuntimeConfig(g1_blocks=64), NullPublisher("cfg"))


def test_metrics_endpoint_on_the_configured_port(clean_env: pytest.MonkeyPatch) -> None:
    port = free_port()
    clean_env.setenv("DYN_KVBM_METRICS", "1")
    clean_env.setenv("DYN_KVBM_METRICS_PORT", str(port))
    mgr = BlockManager(RuntimeConfig(page_size=4, inner_dim=8, g1_blocks=8), NullPublisher("metrics-worker"))
    assert mgr.metrics_url == f"http://127.0.0.1:{port}/metrics"
    mgr.serve(list(range(12)), fill_synthetic_kv)
    text = httpx.get(mgr.metrics_url, timeout=5).text
    assert 'kvbm_offload_blocks_d2h_total{worker="metrics-worker"} 3.0' in text
    for name in ("kvbm_matched_tokens", "kvbm_onboard_blocks_h2d", "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate"):
        assert name in text
    mgr.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # off by default: no endpoint
    assert BlockManager(RuntimeConfig(metrics=False), NullPublisher("quiet")).metrics_url is None


def test_vllm_adapter_import_guard() -> None:
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="needs vLLM"):
            importlib.import_module("kvbm_runtime.vllm_adapter")
    else:  # with vLLM installed the adapter class is importable
        mod = importlib.import_module("kvbm_runtime.vllm_adapter")
        assert hasattr(mod, "KvbmVllmConnector")
