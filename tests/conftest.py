"""Shared fixtures: real services only (NATS, Redis, an HTTP S3 endpoint).

The machine's NATS (127.0.0.1:4222) and Redis (127.0.0.1:6379) are used when they
answer; otherwise a private server is started on a free port for the session.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from s3_proxy import S3FaultProxy

from storage_backends.local_s3 import LocalS3, free_port, start_local_s3

logging.getLogger("nixl").setLevel(logging.WARNING)
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def test_device_name() -> str:
    """Where the runtime tests put G1: ``KVADVISOR_TEST_DEVICE`` (``cpu``, ``cuda``,
    ``cuda:1``), else ``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch  # noqa: PLC0415 - only the runtime tests pay for it

    return os.environ.get("KVADVISOR_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


test_device_name.__test__ = False  # type: ignore[attr-defined]  # (not a test)


@pytest.fixture(scope="session")
def device() -> Any:
    """The ``torch.device`` of G1 for the runtime tests (see :func:`test_device_name`);
    ``KVADVISOR_TEST_DEVICE=cuda`` on a machine without CUDA is an error, not a CPU run."""
    import torch  # noqa: PLC0415

    dev = torch.device(test_device_name())
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"KVADVISOR_TEST_DEVICE asks for {dev}, but torch sees no CUDA device")
    return dev


@pytest.fixture
def young_heap() -> Iterator[None]:
    """Freeze every object that exists before the test (``gc.freeze``), so the test's own
    ``gc.collect()`` calls scan only what it made (its cycles are still collected).

    In a full-suite process the heap holds torch, hypothesis and a thousand tests' leftovers:
    a pool test that collects after each step took 4-5x longer there than alone (48 s
    against 9 s).  Objects made before the test are never collected while it runs.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if _answers("127.0.0.1", port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


def start_nats_server(port: int | None = None, store_dir: str | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start a private ``nats-server -js`` on a free port; returns (process, url, store dir)."""
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    port = port or free_port()
    store_dir = store_dir or tempfile.mkdtemp(prefix="kvadvisor-nats-")
    proc = subprocess.Popen(
        [exe, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store_dir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_port(port, proc, "nats-server")
    return proc, f"nats://127.0.0.1:{port}", store_dir


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """URL of a NATS server with JetStream: the machine's, else a private one."""
    if _answers("127.0.0.1", 4222):
        yield "nats://127.0.0.1:4222"
        return
    proc, url, _ = start_nats_server()
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis server: the machine's, else a private one."""
    if _answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    port = free_port()
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_port(port, proc, "redis-server")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    """A real HTTP S3 endpoint (moto_server) on loopback for the whole session."""
    s3 = start_local_s3()
    try:
        yield s3
    finally:
        s3.stop()


@pytest.fixture
def proxy(local_s3: LocalS3) -> Iterator[S3FaultProxy]:
    """A fault-injecting HTTP proxy (``tests/s3_proxy.py``) in front of the session's S3
    endpoint; volumes pointed at ``proxy.endpoint`` see the faults it is told to make."""
    p = S3FaultProxy(int(urlparse(local_s3.endpoint).port or 0))
    yield p
    p.close()


def deployment_agent(dep: Any, name: str) -> "StorageAgent":
    """A StorageAgent on a storage declaration's catalog with every volume it declares
    registered (``dep``: a ``storage_backends.deployment.DeploymentStorage``); the caller
    closes it."""
    from storage_backends import StorageAgent

    agent = StorageAgent(dep.open_catalog(), name=name, allowed_roots=dep.volume_roots)
    for d in dep.descriptors():
        agent.register_volume(d)
    return agent


def engine_worker(agent: "StorageAgent", source: str, *, layers: int, page: int, inner: int, blocks: int,
                  landing: str = "fast") -> tuple[Any, Any, list[Any]]:
    """The connector's worker side as vLLM runs it: a G1-less ``BlockManager`` (G2 of 2
    blocks, no disk-offload filter) over ``agent`` landing on ``landing``, a
    ``KvbmConnectorWorker`` reporting residency, and the engine's KV cache it adopted
    (``layers`` float32 tensors ``[blocks, 2, page, inner]``, named ``l0``, ``l1``, ...).
    Returns ``(manager, worker, kv)``; the caller closes the worker and the manager."""
    import torch

    from event_plane import NullPublisher
    from kvbm_runtime import BlockManager, RuntimeConfig
    from kvbm_runtime.connector import KvbmConnectorWorker
    from kvbm_runtime.residency import ReportingSink

    cfg = RuntimeConfig(num_layers=layers, outer_dim=2, page_size=page, inner_dim=inner, kv_dtype="float32",
                        g1_blocks=blocks, g2_blocks=2, disable_disk_offload_filter=True)
    sink = ReportingSink(NullPublisher(source))
    manager = BlockManager(cfg, sink, agent, landing, engine_g1=True)
    worker = KvbmConnectorWorker(manager, sink)
    kv = [torch.zeros(blocks, 2, page, inner) for _ in range(layers)]
    worker.register_kv_caches({f"l{i}": t for i, t in enumerate(kv)})
    return manager, worker, kv


def posix_agent(tmp_path: "os.PathLike[str] | str", name: str, volume_id: str = "fast") -> "StorageAgent":
    """A StorageAgent on a fresh SQLite catalog with one 64 MiB NVMe-class POSIX volume
    (1 MiB segments) under ``tmp_path/volume_id``; the caller closes it."""
    from storage_backends import MediaClass, SqliteCatalog, StorageAgent, VolumeDescriptor, VolumeKind

    root = os.path.join(str(tmp_path), volume_id)
    agent = StorageAgent(SqliteCatalog(os.path.join(str(tmp_path), "catalog.sqlite")), name)
    agent.register_volume(
        VolumeDescriptor(volume_id, VolumeKind.POSIX, MediaClass.NVME, 64 << 20, root=root, segment_bytes=1 << 20)
    )
    return agent


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (2 layers, hidden 128, vocab 1024) in HF format (vLLM tests)."""
    from kvbm_runtime.testing.llama_model import build_llama

    return build_llama(tmp_path_factory.mktemp("llama") / "tiny")


@pytest.fixture(scope="session")
def vllm_reference(llama_dir: Path) -> dict[str, Any]:
    """Greedy outputs of every test prompt from vLLM without a connector, each computed
    from scratch (vLLM's prefix cache reset before each), by prompt name of
    ``tests/vllm/vllm_cases.py``."""
    from kvbm_runtime.testing.vllm_engine import generate, llm_engine
    from vllm_cases import MAX_TOKENS, PROMPTS

    out: dict[str, Any] = {}
    with llm_engine(llama_dir, use_connector=False) as llm:
        for name, tokens in PROMPTS.items():
            llm.reset_prefix_cache()
            (out[name],) = generate(llm, [tokens], MAX_TOKENS)
    return out


@pytest.fixture()
def js_url(tmp_path: Path) -> Iterator[str]:
    """URL of a private ``nats-server -js`` on a free port, with its own store under
    ``tmp_path`` (tests that set stream limits or fill the store)."""
    proc, url, _ = start_nats_server(store_dir=str(tmp_path / "js"))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
