"""``kvadvisor worker-sim``: one real KVBM worker replaying the bundled trace into a scaled
cluster (the compose topology's worker, docs/operations.md "Scaled deployment (compose)").

The worker is the runtime's own :class:`~kvbm_runtime.BlockManager` (G1/G2 torch pools on
the CPU, G3 on a local POSIX volume through a :class:`~storage_backends.StorageAgent`), fed
the prompts of the Mooncake trace (``kvadvisor.trace``) one request at a time.  Its events
go to NATS JetStream twice, under one source name and epoch:

* through a :class:`~event_plane.partitioned.PartitionedPublisher` to the partitions
  ``<namespace>-p<k>`` that the cluster advisors (``python -m advisor.cluster``) own, and
* unpartitioned to ``<namespace>`` itself, the log of the advisor serving the REST API
  (``log = "jetstream"``).

Its ``kvbm_*`` metrics (:mod:`kvbm_runtime.metrics`) are served on ``metrics_port``.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, close_all, partition_url
from event_plane.nats_auth import NatsAuth
from event_plane.schema import KVEvent
from event_plane.urls import make_publisher
from kvadvisor.trace import bundled_trace, read_mooncake, request_tokens

__all__ = ["TeePublisher", "WorkerSimSettings", "run_worker_sim"]

G3_VOLUME = "sim-disk"
logger = logging.getLogger(__name__)


class WorkerSimSettings(BaseSettings):
    """Settings of the worker simulator; every field can come from ``KVADVISOR_WORKER_SIM_<NAME>``.

    The partition fields must equal the cluster advisors' ``--partitions``,
    ``--trunk-depth`` and ``--stretch``; ``replicas`` their ``--replicas``.
    """

    model_config = SettingsConfigDict(env_prefix="KVADVISOR_WORKER_SIM_", extra="forbid")

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server(s), comma-separated")
    password_file: Path | None = Field(None, description=(
        "NATS password file of this worker's user (mode 0600; `kvadvisor nats add-worker` writes one), "
        "unless nats_url carries credentials; default: $KVADVISOR_NATS_PASSWORD_FILE when set "
        "(event_plane.nats_auth.publisher_defaults)"))
    namespace: str = Field("default", min_length=1, description="event namespace of the cluster")
    source: str = Field("worker-sim", min_length=1, max_length=255)
    partitions: int = Field(8, ge=1)
    trunk_depth: int = Field(1, ge=0)
    stretch: int = Field(64, ge=1)
    replicas: int = Field(1, ge=1, le=5, description="JetStream replicas of the events stream")
    manage_stream: bool = Field(False, description=(
        "create the events stream if it is missing (a worker alone on a fresh NATS); off by default: the "
        "cluster advisors create it, and a worker user of an authorized NATS may not (docs/security.md)"))
    trace: Path | None = Field(None, description="Mooncake jsonl; default: the bundled slice")
    requests: int | None = Field(None, ge=1, description="requests to replay (None: the whole trace)")
    loop: bool = Field(False, description="start the trace again at its end (until stopped)")
    interval_s: float = Field(0.05, ge=0.0, description="pause between requests")
    workdir: Path = Field(Path("kvadvisor-worker-sim"), description="G3 volume and its catalog")
    storage: Path | None = Field(None, description=(
        "the cluster advisors' storage settings (advisor.cluster.mover.ClusterStorageSettings, their "
        "--storage): G3 is then the first slow volume of that file, in the shared Redis catalog, so the "
        "advisors' movers manage what this worker offloads; default: a private POSIX volume under workdir"))
    redis_url: str | None = Field(None, description=(
        "Redis of the shared catalog (with storage); default: $KVADVISOR_CLUSTER_REDIS_URL, which keeps "
        "a password off the command line"))
    g1_blocks: int = Field(256, ge=1, description="G1 blocks (a longer request is skipped, logged)")
    g2_blocks: int = Field(1024, ge=1)
    g3_capacity_blocks: int = Field(100_000, ge=1)
    page_size: int = Field(512, ge=1, description="tokens per block (the trace's block size)")
    metrics_port: int | None = Field(6880, ge=0, le=65535, description="kvbm_* /metrics port; None: off")
    metrics_host: str = Field("127.0.0.1", description="address of /metrics (no authentication)")


def _shared_storage(s: WorkerSimSettings) -> tuple[Any, str]:
    """``(StorageAgent on the shared Redis catalog with the cluster's volumes, G3 volume id)``.

    Raises:
        ValueError: no Redis URL, or a storage file without a slow volume.
        SettingsError: the storage file does not validate.
        StorageError: the catalog or a volume cannot be opened.
    """
    import os

    from advisor.cluster.mover import ClusterStorageSettings
    from storage_backends import RedisCatalog, StorageAgent

    assert s.storage is not None
    st = ClusterStorageSettings.load(s.storage)
    redis_url = s.redis_url or os.environ.get("KVADVISOR_CLUSTER_REDIS_URL")
    if not redis_url:
        raise ValueError("a shared storage file needs redis_url or $KVADVISOR_CLUSTER_REDIS_URL")
    if not st.slow_volumes:
        raise ValueError(f"{s.storage}: no slow volume to offload G3 blocks to")
    agent = StorageAgent(RedisCatalog(redis_url, prefix=st.catalog_prefix), name=s.source,
                         allowed_roots=[str(Path(r).resolve()) for r in st.volume_roots]
                         if st.volume_roots is not None else None)
    try:
        for v in st.volumes:
            if v.id in st.slow_volumes[:1]:
                agent.register_volume(v.to_descriptor())
    except BaseException:
        agent.close()
        raise
    return agent, st.slow_volumes[0]


class TeePublisher:
    """Sends every event to several publishers that share one source and epoch (the
    ``Publisher`` protocol of :class:`~kvbm_runtime.BlockManager`).

    Raises (from :meth:`publish` / :meth:`flush`): what the inner publishers raise.
    """

    def __init__(self, publishers: Sequence[Any]) -> None:
        self.publishers = list(publishers)
        self.source = self.publishers[0].source
        self.epoch = self.publishers[0].epoch

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Publish ``events`` on every inner publisher, in order."""
        for p in self.publishers:
            p.publish(events)

    def flush(self) -> None:
        """Flush every inner publisher."""
        for p in self.publishers:
            p.flush()

    def close(self) -> None:
        """Close every inner publisher (the first error is raised after all are closed)."""
        close_all(self.publishers)


def _jetstream_url(server: str, namespace: str, replicas: int, manage_stream: bool = False) -> str:
    """``jetstream://`` URL of ``namespace`` on the first of ``server``'s comma-separated
    ``nats://`` URLs (the client learns the other nodes of a cluster from it); with
    ``manage_stream`` the publisher creates the stream when it is missing."""
    first = server.split(",")[0].strip()
    if not first.startswith("nats://"):
        raise ValueError(f"nats_url must be nats://HOST:PORT[,nats://...], got {first.split('@')[-1]!r}")
    return ("jetstream://" + first[len("nats://"):].rstrip("/") + f"?namespace={namespace}&replicas={replicas}"
            + ("&manage_stream=1" if manage_stream else ""))


def run_worker_sim(s: WorkerSimSettings, stop: threading.Event | None = None,
                   on_request: Callable[[int, Any], None] | None = None,
                   on_ready: Callable[[str | None], None] | None = None) -> int:
    """Replay the trace through one worker until it ends (or ``stop`` is set, with ``loop``).

    Args:
        s: the settings.
        stop: set it to stop after the current request.
        on_request: ``on_request(n, ServeResult)`` after the n-th request (1-based).
        on_ready: ``on_ready(metrics_url or None)`` once the worker is up.

    Returns:
        The number of requests served.

    Raises:
        TraceFormatError: a malformed trace.  EventURLError / JetStream errors: NATS unusable.
        StorageError: the G3 volume cannot be created.
    """
    import torch  # noqa: F401 - the runtime's pools; imported here to keep the CLI start fast

    from kvbm_runtime import BlockManager, RuntimeConfig, fill_synthetic_kv
    from kvbm_runtime.errors import PoolExhaustedError
    from storage_backends import MediaClass, SqliteCatalog, StorageAgent, VolumeDescriptor, VolumeKind

    stop = stop or threading.Event()
    reqs = list(read_mooncake(s.trace or bundled_trace(), limit=s.requests))
    if not reqs:
        raise ValueError(f"the trace {s.trace or bundled_trace()} has no requests")
    scheme = PartitionScheme(s.partitions, s.trunk_depth, s.stretch)
    url = _jetstream_url(s.nats_url, s.namespace, s.replicas, s.manage_stream)
    epoch = random.getrandbits(63)
    cfg = RuntimeConfig(model_name="compose/mooncake-conversation", num_layers=2, outer_dim=2,
                        page_size=s.page_size, inner_dim=4, kv_dtype="float16",
                        g1_blocks=s.g1_blocks, g2_blocks=s.g2_blocks)
    block_bytes = 2 * 2 * s.page_size * 4 * 2
    workdir = Path(s.workdir).resolve()
    (workdir / "volume").mkdir(parents=True, exist_ok=True)
    served = 0
    auth = NatsAuth(password_file=str(s.password_file)) if s.password_file is not None else None
    with ExitStack() as stack:
        whole = make_publisher(url, s.source, epoch=epoch, nats_auth=auth)
        stack.callback(whole.close)
        parts = PartitionedPublisher(scheme, lambda k: make_publisher(partition_url(url, k), s.source, epoch=epoch,
                                                                      nats_auth=auth))
        stack.callback(parts.close)
        tee = TeePublisher([parts, whole])
        if s.storage is not None:
            agent, g3 = _shared_storage(s)
        else:
            g3 = G3_VOLUME
            agent = StorageAgent(SqliteCatalog(str(workdir / "catalog.sqlite")), name=s.source)
            agent.register_volume(VolumeDescriptor(G3_VOLUME, VolumeKind.POSIX, MediaClass.NVME,
                                                   s.g3_capacity_blocks * block_bytes, root=str(workdir / "volume"),
                                                   segment_bytes=max(block_bytes * 32, 1 << 20)))
        stack.callback(agent.close)
        mgr = BlockManager(cfg, tee, store=agent, g3_volume=g3)
        stack.callback(mgr.close)
        metrics_url = mgr.metrics.serve_http(s.metrics_port, s.metrics_host) if s.metrics_port is not None else None
        if on_ready:
            on_ready(metrics_url)
        while not stop.is_set():
            for req in reqs:
                if stop.is_set():
                    break
                try:
                    res = mgr.serve(request_tokens(req, s.page_size), fill_synthetic_kv)
                except PoolExhaustedError as exc:
                    logger.warning("request skipped: %s", exc)
                    continue
                served += 1
                tee.flush()
                if on_request:
                    on_request(served, res)
                if s.interval_s:
                    stop.wait(s.interval_s)
            if not s.loop:
                break
        tee.flush()
    return served

