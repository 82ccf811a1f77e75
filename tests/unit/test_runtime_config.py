"""Configuration: every KVBM environment name is accepted and takes effect or is refused
with a clear error; shrinking capacities and host pools above the available memory are
refused with the numbers; the metrics endpoint serves on the configured port; the vLLM
adapter's import guard."""

from __future__ import annotations

import importlib
import importlib.util
import resource
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError

from event_plane import NullPublisher
from kvbm_runtime import BlockManager, CapacityConfigError, RuntimeConfig, fill_synthetic_kv
from kvbm_runtime.config import available_memory_bytes
from storage_backends import BlockKey, MediaClass, SqliteCatalog, StorageAgent, VolumeKind, free_port

KVBM_ENV = {
    "DYN_KVBM_CPU_CACHE_GB": "0.0001",
    "DYN_KVBM_DISK_CACHE_GB": "0.001",
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
    "DYN_KVBM_DISK_ZEROFILL_FALLBACK": "true",
    "DYN_KVBM_DISK_ALLOCATOR_TYPE": "default",
    "DYN_KVBM_DISK_DISABLE_O_DIRECT": "1",
    "DYN_KVBM_METRICS": "true",
    "DYN_KVBM_METRICS_PORT": "7001",
    "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS": "45",
    "DYN_KVBM_NCCL_MLA_MODE": "false",
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
    assert cfg.disk_zerofill_fallback and cfg.disk_allocator_type == "default"
    assert cfg.disk_disable_o_direct and cfg.volume_options() == {
        "o_direct": False,
        "require_o_direct": False,
        "zerofill_fallback": True,
    }
    assert not cfg.nccl_mla_mode and not cfg.disk_only
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


def test_leader_worker_init_timeout_defaults_to_kvbm_1800_s(clean_env: pytest.MonkeyPatch) -> None:
    assert RuntimeConfig().leader_worker_init_timeout_secs == 1800.0
    clean_env.setenv("DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS", "30")
    assert RuntimeConfig().leader_worker_init_timeout_secs == 30.0


def test_nccl_mla_mode_true_is_refused_naming_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DYN_KVBM_NCCL_MLA_MODE", "false")
    assert RuntimeConfig().nccl_mla_mode is False
    clean_env.setenv("DYN_KVBM_NCCL_MLA_MODE", "true")
    with pytest.raises(ValidationError, match="DYN_KVBM_NCCL_MLA_MODE=true .* does not replicate MLA caches"):
        RuntimeConfig()


def test_disk_allocator_type_default_or_open_direct_only(clean_env: pytest.MonkeyPatch) -> None:
    assert RuntimeConfig().volume_options() == {"o_direct": True, "require_o_direct": False, "zerofill_fallback": False}
    clean_env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", "default")
    assert RuntimeConfig().volume_options()["require_o_direct"] is False
    clean_env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", "open-direct")
    assert RuntimeConfig().volume_options() == {"o_direct": True, "require_o_direct": True, "zerofill_fallback": False}
    for bad in ("posix_fallocate", "Open-Direct", ""):
        clean_env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", bad)
        with pytest.raises(ValidationError, match="DYN_KVBM_DISK_ALLOCATOR_TYPE .*must be one of default, open-direct"):
            RuntimeConfig()
    clean_env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", "open-direct")
    clean_env.setenv("DYN_KVBM_DISK_DISABLE_O_DIRECT", "true")
    with pytest.raises(ValidationError, match="open-direct requires O_DIRECT but DYN_KVBM_DISK_DISABLE_O_DIRECT"):
        RuntimeConfig()


def test_g3_volume_descriptor_carries_the_disk_options_to_a_real_volume(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("DYN_KVBM_DISK_CACHE_GB", "0.001")
    clean_env.setenv("DYN_KVBM_DISK_ZEROFILL_FALLBACK", "true")
    clean_env.setenv("DYN_KVBM_DISK_ALLOCATOR_TYPE", "open-direct")
    cfg = RuntimeConfig(g1_blocks=1, g2_blocks=2)
    desc = cfg.g3_volume_descriptor("g3", tmp_path / "g3")
    assert (desc.id, desc.kind, desc.media, desc.capacity_bytes, desc.root) == (
        "g3", VolumeKind.POSIX, MediaClass.SSD, 1_000_000, str(tmp_path / "g3"))
    assert (desc.o_direct, desc.require_o_direct, desc.zerofill_fallback) == (True, True, True)
    clean_env.delenv("DYN_KVBM_DISK_CACHE_GB")
    clean_env.delenv("DYN_KVBM_DISK_ALLOCATOR_TYPE")
    clean_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "10")
    clean_env.setenv("DYN_KVBM_DISK_DISABLE_O_DIRECT", "1")
    clean_env.setenv("DYN_KVBM_DISK_ZEROFILL_FALLBACK", "false")
    cfg = RuntimeConfig(g1_blocks=1, g2_blocks=2)
    desc = cfg.g3_volume_descriptor("g3", tmp_path / "g3")
    assert desc.capacity_bytes == 10 * 8192
    assert (desc.o_direct, desc.require_o_direct, desc.zerofill_fallback) == (False, False, False)
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="g3-from-config") as agent:
        agent.register_volume(desc)
        block = torch.arange(8192, dtype=torch.int64).to(torch.uint8)
        agent.put([(BlockKey("cfgcfgcfgcfgcfgc", 1), block)], "g3")
        assert torch.equal(agent.get([BlockKey("cfgcfgcfgcfgcfgc", 1)])[0], block)
    cat.close()
    clean_env.delenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS")
    with pytest.raises(CapacityConfigError, match="no G3 disk cache configured"):
        RuntimeConfig().g3_volume_descriptor("g3", tmp_path)


def test_disk_only_mode_has_no_offload_filter(clean_env: pytest.MonkeyPatch) -> None:
    assert not RuntimeConfig().disk_only  # no disk cache at all
    clean_env.setenv("DYN_KVBM_DISK_CACHE_GB", "0.001")
    cfg = RuntimeConfig(g1_blocks=4)
    assert cfg.disk_only and not cfg.offload_filter_enabled
    assert cfg.g2_blocks == 16  # G2 keeps its default size (4 x G1)
    clean_env.delenv("DYN_KVBM_DISK_CACHE_GB")
    clean_env.setenv("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "100")
    assert RuntimeConfig(g1_blocks=4).disk_only
    for cpu in (("DYN_KVBM_CPU_CACHE_GB", "0.0001"), ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "8")):
        clean_env.setenv(*cpu)
        cfg = RuntimeConfig(g1_blocks=4)
        assert not cfg.disk_only and cfg.offload_filter_enabled
        clean_env.delenv(cpu[0])
    assert not RuntimeConfig(g1_blocks=4, g2_blocks=16).disk_only  # given in code, not the environment


def test_a_host_pool_above_the_available_memory_is_refused_before_allocating(clean_env: pytest.MonkeyPatch) -> None:
    avail = available_memory_bytes()
    assert avail is not None and avail > 0  # /proc/meminfo MemAvailable on Linux
    gb = 4 * avail / 1e9  # well above MemTotal too
    clean_env.setenv("DYN_KVBM_CPU_CACHE_GB", f"{gb:.3f}")
    cfg = RuntimeConfig(g1_blocks=4)
    assert cfg.g2_blocks is not None
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with pytest.raises(CapacityConfigError) as ei:
        BlockManager(cfg, NullPublisher("mem"))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 << 10  # < 64 MiB more
    msg = str(ei.value)
    assert msg.startswith(f"G2 host pool of {cfg.g2_blocks * 8192 / 2**30:.2f} GiB")
    # the setting as the config holds it (a float: "90.110" in the environment is 90.11)
    assert f"g2_blocks={cfg.g2_blocks}, from DYN_KVBM_CPU_CACHE_GB / cpu_cache_gb={cfg.cpu_cache_gb}" in msg
    assert cfg.cpu_cache_gb == float(f"{gb:.3f}")
    assert "exceeds the available memory" in msg
    # the check itself, against a given amount: G2 alone fits, G1 (on the CPU here) + G2 do not
    small = RuntimeConfig(g1_blocks=4, g2_blocks=8)
    small.check_memory(available=12 * 8192)
    if not torch.cuda.is_available():
        with pytest.raises(CapacityConfigError, match=r"G1 pool on the CPU .*g1_blocks=4\) plus G2 host pool"):
            small.check_memory(available=11 * 8192)
    with pytest.raises(CapacityConfigError, match="g2_blocks=8, from DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS / g2_blocks"):
        small.check_memory(available=7 * 8192)


def test_docs_table_lists_every_kvbm_variable_accepted() -> None:
    accepted = {
        name.removeprefix("DYN_KVBM_")
        for f in RuntimeConfig.model_fields.values()
        if f.validation_alias is not None
        for name in getattr(f.validation_alias, "choices", [])
        if isinstance(name, str) and name.startswith("DYN_KVBM_")
    }
    assert len(accepted) == 12
    docs = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    table = docs.split("## KVBM settings (DYN_KVBM_*)", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")}
    assert accepted <= rows, sorted(accepted - rows)
