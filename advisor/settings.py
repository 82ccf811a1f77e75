"""Advisor settings (pydantic-settings; env prefix ``KVADVISOR_ADVISOR_``, or a JSON file).

Nested fields use ``__`` in environment variables, e.g.
``KVADVISOR_ADVISOR_POLICY__DEMOTION__HIGH_WATERMARK=0.9``.  Values passed to the
constructor (or read from the JSON file by :meth:`AdvisorSettings.from_json_file`) win
over the environment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from advisor.policy.policies import PolicySettings
from advisor.moves.prefetch import PrefetchSettings
from storage_backends.deployment import SettingsError, VolumeSettings, check_secret_file_mode

__all__ = ["AdvisorSettings", "SettingsError", "VolumeSettings", "format_validation_error"]


_API_FACTORY = re.compile(r"api(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")

#: fields whose value is a secret: a JSON config holding one must not be readable by others
_SECRET_FIELDS = ("nats_password", "nats_token")


def format_validation_error(exc: ValidationError) -> str:
    """One ``field.path: message`` per problem, joined with ``; ``."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "; ".join(parts)


class AdvisorSettings(BaseSettings):
    """Everything an advisor process needs.

    Attributes:
        source: the advisor's own event source name (its moves are published under it).
        subscribe_urls: event streams to ingest (``zmq://H:P?replay=R``, ``nats://H:P``...).
        publish_url: where the advisor publishes its moves (``null://`` = journal only).
        journal_path: SQLite journal file.
        journal_synchronous: ``NORMAL`` (survives a process crash) or ``FULL`` (power loss).
        catalog_path: SQLite placement catalog shared with the workers; ``None`` runs the
            advisor as an index only (no volumes, no policies).
        namespace: key namespace (model fingerprint) of the blocks it manages.
        extra_namespaces: further namespaces it manages.
        follow_catalog_namespaces: also manage every key namespace the placement catalog
            holds blocks in (a vLLM connector's model fingerprint among them), so that an
            advisor left on ``"default"`` moves and drains what its workers stored; the
            catalog's namespaces are looked at each policy round, drain and reconcile.
        max_namespaces: quota on the namespaces managed in all (``namespace``,
            ``extra_namespaces`` and the followed ones, the configured ones first; then the
            followed ones with most blocks); a namespace beyond it is left alone, logged and
            named by a drain and by ``GET /v1/stats`` ``namespaces``.
        volumes: the volumes to register.
        fast_volume / slow_volumes / archive_volume: roles of the volume ids.
        policy: policy and planner settings.
        prefetch: lookups as prefetch hints, their bandwidth budget and quotas
            (:class:`advisor.moves.prefetch.PrefetchSettings`).
        policy_interval_s: seconds between policy rounds (default 30); ``0`` disables the
            timer (rounds then run only on request).
        source_ttl_s: a source that has sent nothing for this many seconds has its
            ``g1``/``g2`` blocks dropped from the index by a journaled expiry batch
            (:mod:`advisor.ingest.source_expiry`; its blocks on shared volumes stay); ``0`` = never.
            Embedded mode (``log = sqlite``) only.
        reconcile_on_start: compare the catalog with the index at start and publish the
            Store/Remove events a crash between commit and publish left out.
        get_timeout_s: subscriber poll timeout of the ingest loop.
        api_enabled / api_host / api_port: the REST API (port 0 = a free port).
        api_factory: ``module:function`` that serves the API for an ``AdvisorQuery``
            (loaded by name so ``advisor`` does not import ``api``); the module must be
            ``api`` or one of its submodules.
        log: the event log folded into the index: ``sqlite`` (embedded: ``journal_path``,
            batches from ``subscribe_urls`` are appended before they are applied) or
            ``jetstream`` (scaled: the ``KVADVISOR_EVENTS`` stream at ``jetstream_url``,
            namespace ``jetstream_namespace``, is the log and the position is the stream
            sequence; ``subscribe_urls`` must be empty and the advisor's moves must be
            published to the stream, ``publish_url = jetstream://...``).
        jetstream_max_bytes / jetstream_max_age_s / jetstream_discard /
            jetstream_strict_stream: the ``KVADVISOR_EVENTS`` stream's limits wherever the
            advisor creates or checks the stream (``log=jetstream``, ``jetstream://`` in
            ``publish_url`` and ``subscribe_urls``; a URL's own ``max_bytes`` /
            ``max_age`` / ``discard`` / ``strict_stream`` win): bytes (> 0, default
            1 GiB) and seconds (> 0, default 24 h), ``null`` or ``"unlimited"`` = unlimited; ``old``
            (default: the oldest batches are deleted) or ``new`` (new batches refused);
            ``true`` refuses to start when the existing stream differs (default: a warning
            naming the fields). See :class:`event_plane.StreamLimits`.
        jetstream_replicas: copies of that stream on a NATS cluster (1, or 3 on a
            3-node cluster, as the cluster advisors' ``--replicas``); a URL's own
            ``replicas`` wins.
        snapshot_store: where index snapshots go: ``sqlite`` (``snapshot_path``, default
            ``<journal_path>.snapshots``), ``redis`` (``redis_url``, keys under
            ``snapshot_key_prefix``) or ``none``.
        snapshot_every_batches / snapshot_every_s: take a snapshot after this many
            applied batches / seconds with new batches (``0`` disables that trigger).
        snapshot_keep: snapshots kept in the store.
        snapshot_on_stop: take a snapshot on a clean stop.
        nats_user / nats_password / nats_token / nats_token_file / nats_creds_file /
            nats_nkey_seed_file: NATS authentication (one way at most) for every
            ``nats://``, ``tls://`` and ``jetstream://`` URL of the advisor
            (``subscribe_urls``, ``publish_url``, ``jetstream_url``) that sets none itself;
            a URL's own authentication wins as a whole. Password and token are
            ``SecretStr`` (never shown); prefer the file fields.
        nats_tls / nats_tls_ca_file / nats_tls_cert_file / nats_tls_key_file /
            nats_tls_hostname: TLS for those URLs (any file turns it on; cert + key =
            mutual TLS); a URL's own ``tls_*`` values win field by field.
        zmq_allowed_publishers: the allowed-publisher list for ``zmq://`` subscribe URLs:
            a directory of CURVE public key files (``*.key``) or one such file. When set,
            every ``zmq://`` URL in ``subscribe_urls`` must use CURVE
            (``curve_server_key=``) with a publisher key on the list (else the advisor
            refuses to start), and ``vllm+zmq://`` / ``sglang+zmq://`` URLs are refused.
            Default ``None``: no list (URLs may still set CURVE and their own
            ``allowed_publishers``).
        zmq_curve_secret_file: the advisor's CURVE secret key file (``NAME.key_secret``,
            mode 0600) for ``zmq://`` URLs with CURVE that name no ``curve_secret``;
            ``None``: a fresh key each start (enough unless the publishers check their
            clients, ``curve_clients=``).
        origin_binding: bind each source to the origin that first delivered it and refuse
            its batches from any other (counted ``origin_refused``;
            :mod:`event_plane.origins`). Default on.
        origins_path: the SQLite file of those bindings (default
            ``<journal_path>.origins``); they survive restarts until
            :meth:`AdvisorService.release_origin`.
        quota_max_sources / quota_max_locations / quota_max_batch_events /
            quota_max_event_metadata_bytes / quota_max_batch_metadata_bytes /
            quota_source_rate / quota_source_burst: admission quotas of subscribed
            batches (``advisor/ingest/quotas.py``): distinct sources (default 10,000), distinct
            volume names (256), events per batch (65,536), encoded ``extra_metadata``
            bytes per event (4 KiB) and per batch (1 MiB), and each source's token bucket:
            events/s (200,000) and size in events (1,048,576, at least
            ``quota_max_batch_events``). What goes over is refused alone and counted.
        quota_max_source_blocks / quota_max_blocks / quota_max_bindings: state quotas
            (``advisor/ingest/quotas.py``): blocks one source may hold in its ``g1``/``g2``
            (default 2^20, twice what a worker with 1 TiB of G2 + G3 at 2 MiB blocks
            holds), blocks the index may hold (2^24, about 1.5 GiB of index), and source →
            origin bindings (20,000). A Store over a block quota is refused alone; a batch
            of a source not yet bound is refused whole while that many bindings are held.
        reported_hits_sources / reported_hits_cap: sources whose ``extra_metadata["hits"]``
            counts (default none: the key is removed from every subscribed event), and
            the most hits one Store of theirs may report (default 8).
        volume_roots: directories the posix volumes must lie under (``None``: the
            directory of ``catalog_path``); see :meth:`allowed_volume_roots`.
        gc_interval_s / gc_min_age_s: garbage collection of crash leftovers at start and
            every ``gc_interval_s`` seconds (0: at start only); unsealed segments without
            live blocks are removed once older than ``gc_min_age_s`` seconds.
        full_backoff_s / full_backoff_max_s: after a move failed on a full destination,
            moves into it are held back this long, doubling up to the maximum
            (:mod:`advisor.embedded.volume_backoff`).
        volume_probe_timeout_s: registering an S3 volume at run time first probes its
            endpoint with this long to connect and as much to read; a silent endpoint is
            refused after that (504 ``volume_unreachable``).
        metrics_max_locations: ``location`` label values of the ``kvadvisor_index_blocks``
            metric: the configured volumes, then the locations holding the most blocks;
            the rest are summed under ``location="_other"`` (locations come from events,
            so a forging publisher must not create one series per name).
    """

    model_config = SettingsConfigDict(env_prefix="KVADVISOR_ADVISOR_", env_nested_delimiter="__", extra="forbid")

    source: str = Field("advisor", min_length=1, max_length=255)
    subscribe_urls: list[str] = Field(default_factory=list)
    publish_url: str = "null://"
    journal_path: str = "kvadvisor-journal.sqlite"
    journal_synchronous: Literal["NORMAL", "FULL"] = "NORMAL"
    catalog_path: str | None = None
    namespace: str = Field("default", min_length=1)
    extra_namespaces: list[str] = Field(default_factory=list)
    follow_catalog_namespaces: bool = True
    max_namespaces: int = Field(64, ge=1, le=4096)
    volumes: list[VolumeSettings] = Field(default_factory=list)
    fast_volume: str | None = None
    slow_volumes: list[str] = Field(default_factory=list)
    archive_volume: str | None = None
    policy: PolicySettings = Field(default_factory=PolicySettings)
    prefetch: PrefetchSettings = Field(default_factory=PrefetchSettings)
    policy_interval_s: float = Field(30.0, ge=0.0)
    source_ttl_s: float = Field(600.0, ge=0.0)
    reconcile_on_start: bool = True
    get_timeout_s: float = Field(0.2, gt=0.0)
    api_enabled: bool = True
    api_host: str = "127.0.0.1"
    api_port: int = Field(8080, ge=0, le=65535)
    api_factory: str = "api.server:serve_query"
    volume_roots: list[str] | None = None
    gc_interval_s: float = Field(300.0, ge=0.0)
    gc_min_age_s: float = Field(600.0, ge=0.0)
    full_backoff_s: float = Field(30.0, ge=0.0)
    full_backoff_max_s: float = Field(600.0, ge=0.0)
    volume_probe_timeout_s: float = Field(3.0, gt=0.0, le=60.0)
    log: Literal["sqlite", "jetstream"] = "sqlite"
    jetstream_url: str | None = None
    jetstream_namespace: str = Field("default", min_length=1)
    jetstream_max_bytes: int | None = Field(1 << 30, gt=0)
    jetstream_max_age_s: float | None = Field(24 * 3600.0, gt=0.0, allow_inf_nan=False)
    jetstream_discard: Literal["old", "new"] = "old"
    jetstream_strict_stream: bool = False
    jetstream_replicas: int = 1
    snapshot_store: Literal["sqlite", "redis", "none"] = "sqlite"
    snapshot_path: str | None = None
    redis_url: str = "redis://127.0.0.1:6379/0"
    snapshot_key_prefix: str = Field("kvadvisor:advisor", min_length=1)
    snapshot_every_batches: int = Field(10_000, ge=0)
    snapshot_every_s: float = Field(300.0, ge=0.0)
    snapshot_keep: int = Field(2, ge=1)
    snapshot_on_stop: bool = True
    metrics_max_locations: int = Field(64, ge=1)
    quota_max_sources: int = Field(10_000, ge=1)
    quota_max_locations: int = Field(256, ge=1)
    quota_max_batch_events: int = Field(65_536, ge=1)
    quota_max_event_metadata_bytes: int = Field(4096, ge=1)
    quota_max_batch_metadata_bytes: int = Field(1 << 20, ge=1)
    quota_source_rate: float = Field(200_000.0, gt=0.0, allow_inf_nan=False)
    quota_source_burst: int = Field(1 << 20, ge=1)
    quota_max_source_blocks: int = Field(1 << 20, ge=1)
    quota_max_blocks: int = Field(1 << 24, ge=1)
    quota_max_bindings: int = Field(20_000, ge=1)
    reported_hits_sources: list[str] = Field(default_factory=list)
    reported_hits_cap: int = Field(8, ge=0)
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_token: SecretStr | None = None
    nats_token_file: str | None = None
    nats_creds_file: str | None = None
    nats_nkey_seed_file: str | None = None
    nats_tls: bool = False
    nats_tls_ca_file: str | None = None
    nats_tls_cert_file: str | None = None
    nats_tls_key_file: str | None = None
    nats_tls_hostname: str | None = None
    zmq_allowed_publishers: str | None = None
    zmq_curve_secret_file: str | None = None
    origin_binding: bool = True
    origins_path: str | None = None

    @field_validator("api_factory")
    @classmethod
    def _api_module(cls, value: str) -> str:
        """Only a function of the project's own ``api`` package may serve the API: the
        factory is imported by name, and importing a module runs its code."""
        if not _API_FACTORY.fullmatch(value):
            raise ValueError(f"api_factory must be 'api[.module]:function' (a module of the 'api' package), got {value!r}")
        return value

    def allowed_volume_roots(self) -> list[str] | None:
        """Directories the posix volumes must lie under: ``volume_roots``, else the
        directory of ``catalog_path`` (``None`` without a catalog)."""
        if self.volume_roots is not None:
            return [str(Path(r).resolve()) for r in self.volume_roots]
        if self.catalog_path is None:
            return None
        return [str(Path(self.catalog_path).resolve().parent)]

    @field_validator("jetstream_max_bytes", "jetstream_max_age_s", mode="before")
    @classmethod
    def _unlimited(cls, value: Any) -> Any:
        """``"unlimited"`` (any case; e.g. from the environment) means ``None``."""
        return None if isinstance(value, str) and value.strip().lower() == "unlimited" else value

    @field_validator("jetstream_replicas")
    @classmethod
    def _replicas(cls, value: int) -> int:
        """JetStream keeps 1, 3 or 5 copies of a stream."""
        if value not in (1, 3, 5):
            raise ValueError(f"must be 1, 3 or 5, got {value}")
        return value

    @model_validator(mode="after")
    def _roles(self) -> AdvisorSettings:
        ids = [v.id for v in self.volumes]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"volume ids must be unique, repeated: {dup}")
        known = set(ids)
        roles = ([self.fast_volume] if self.fast_volume else []) + list(self.slow_volumes) + (
            [self.archive_volume] if self.archive_volume else []
        )
        unknown = [r for r in roles if r not in known]
        if unknown:
            raise ValueError(f"volume roles name unknown volume ids {unknown} (configured: {sorted(known)})")
        if len(set(roles)) != len(roles):
            raise ValueError(f"a volume can play one role only: fast={self.fast_volume} slow={self.slow_volumes} "
                             f"archive={self.archive_volume}")
        if self.log == "jetstream":
            if not self.jetstream_url:
                raise ValueError("log=jetstream needs jetstream_url (nats://HOST:PORT)")
            if self.subscribe_urls:
                raise ValueError("log=jetstream reads the stream itself: leave subscribe_urls empty")
            if self.volumes and not self.publish_url.startswith("jetstream://"):
                raise ValueError("log=jetstream with volumes needs publish_url=jetstream://... so that the "
                                 "advisor's moves enter the log")
        self.nats_auth()  # raises on contradicting NATS credentials / TLS fields
        if self.zmq_curve_secret_file is not None:
            from event_plane.curve import check_secret_mode
            from event_plane.errors import ConfigError

            try:
                check_secret_mode(self.zmq_curve_secret_file)
            except ConfigError as exc:
                raise ValueError(f"zmq_curve_secret_file: {exc}") from exc
        if self.quota_source_burst < self.quota_max_batch_events:
            raise ValueError(f"quota_source_burst ({self.quota_source_burst}) must be at least quota_max_batch_events "
                             f"({self.quota_max_batch_events}): a bucket smaller than a batch refuses it forever")
        if self.volumes and self.catalog_path is None:
            raise ValueError("volumes are configured but catalog_path is not set")
        if len(self.namespaces) > self.max_namespaces:
            raise ValueError(f"namespace and extra_namespaces name {len(self.namespaces)} namespaces, more than "
                             f"max_namespaces ({self.max_namespaces}): raise max_namespaces")
        return self

    @property
    def namespaces(self) -> list[str]:
        """``namespace`` followed by ``extra_namespaces`` (duplicates removed)."""
        out = [self.namespace]
        for ns in self.extra_namespaces:
            if ns not in out:
                out.append(ns)
        return out

    def managed_namespaces(self, seen: dict[str, int] | None = None) -> tuple[list[str], dict[str, int]]:
        """The key namespaces to manage, given those the catalog holds blocks in.

        Args:
            seen: namespace → blocks the catalog places (any volume); ``None``: not looked at.

        Returns:
            ``(managed, left)``: :attr:`namespaces` first, then (with
            ``follow_catalog_namespaces``) the seen ones by most blocks, then name, up to
            ``max_namespaces`` in all; ``left``: the seen ones not managed (namespace → blocks),
            beyond the quota or not followed.
        """
        managed = self.namespaces
        left: dict[str, int] = {}
        taken = set(managed)
        for ns, n in sorted((seen or {}).items(), key=lambda kv: (-kv[1], kv[0])):
            if ns in taken:
                continue
            if self.follow_catalog_namespaces and len(managed) < self.max_namespaces:
                managed.append(ns)
                taken.add(ns)
            else:
                left[ns] = int(n)
        return managed, left

    def stream_limits(self) -> Any:
        """The ``jetstream_*`` stream fields as an :class:`event_plane.StreamLimits`."""
        from event_plane import StreamLimits

        return StreamLimits(
            max_bytes=self.jetstream_max_bytes,
            max_age_s=self.jetstream_max_age_s,
            discard=self.jetstream_discard,
            strict=self.jetstream_strict_stream,
            replicas=self.jetstream_replicas,
        )

    def nats_auth(self) -> Any:
        """The ``nats_*`` fields as an :class:`event_plane.nats_auth.NatsAuth` (the
        defaults under every NATS URL's own credentials / TLS).

        Raises:
            ValueError: a password without a user, several ways of authentication, or a
                TLS certificate without its key (or the reverse).
        """
        from event_plane.nats_auth import NatsAuth

        return NatsAuth(
            user=self.nats_user,
            password=self.nats_password.get_secret_value() if self.nats_password is not None else None,
            token=self.nats_token.get_secret_value() if self.nats_token is not None else None,
            token_file=self.nats_token_file,
            creds_file=self.nats_creds_file,
            nkey_seed_file=self.nats_nkey_seed_file,
            tls=self.nats_tls,
            tls_ca_file=self.nats_tls_ca_file,
            tls_cert_file=self.nats_tls_cert_file,
            tls_key_file=self.nats_tls_key_file,
            tls_hostname=self.nats_tls_hostname,
        )

    def quota_limits(self) -> Any:
        """The ``quota_*`` and ``reported_hits_*`` fields as an :class:`advisor.ingest.quotas.QuotaLimits`."""
        from advisor.ingest.quotas import QuotaLimits

        return QuotaLimits(
            max_sources=self.quota_max_sources,
            max_locations=self.quota_max_locations,
            max_batch_events=self.quota_max_batch_events,
            max_event_metadata_bytes=self.quota_max_event_metadata_bytes,
            max_batch_metadata_bytes=self.quota_max_batch_metadata_bytes,
            source_rate=self.quota_source_rate,
            source_burst=self.quota_source_burst,
            reported_hits_cap=self.reported_hits_cap,
            reported_hits_sources=frozenset(self.reported_hits_sources),
            max_source_blocks=self.quota_max_source_blocks,
            max_blocks=self.quota_max_blocks,
            max_bindings=self.quota_max_bindings,
        )

    def max_message_bytes(self) -> int:
        """The most bytes a batch that passes the batch quotas takes on the wire
        (:func:`event_plane.codec.max_batch_bytes` of ``quota_max_batch_events`` and
        ``quota_max_batch_metadata_bytes``): the size limit of every subscribed socket."""
        from event_plane.codec import max_batch_bytes

        return max_batch_bytes(self.quota_max_batch_events, self.quota_max_batch_metadata_bytes)

    @property
    def origins_file(self) -> str:
        """SQLite file of the source → origin bindings: ``origins_path`` or ``<journal_path>.origins``."""
        return self.origins_path or f"{self.journal_path}.origins"

    def zmq_auth(self) -> dict[str, Any]:
        """``subscribe()`` keywords of the ``zmq_*`` fields (``zmq_allowed_publishers``,
        ``zmq_curve_secret``), only those set."""
        out: dict[str, Any] = {}
        if self.zmq_allowed_publishers is not None:
            out["zmq_allowed_publishers"] = self.zmq_allowed_publishers
        if self.zmq_curve_secret_file is not None:
            out["zmq_curve_secret"] = self.zmq_curve_secret_file
        return out

    @property
    def snapshot_file(self) -> str:
        """SQLite snapshot file: ``snapshot_path`` or ``<journal_path>.snapshots``."""
        return self.snapshot_path or f"{self.journal_path}.snapshots"

    @classmethod
    def from_json_file(cls, path: str | Path) -> AdvisorSettings:
        """Load settings from a JSON object file (environment fills what it leaves out).

        Raises:
            SettingsError: unreadable file, bad JSON, invalid values (message names them), or a
                file readable by group or others that holds a secret.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cannot read advisor config {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise SettingsError(f"advisor config {path} must hold a JSON object, not {type(data).__name__}")
        try:
            settings = cls(**data)
        except ValidationError as exc:
            raise SettingsError(f"invalid advisor config {path}: {format_validation_error(exc)}") from exc
        _refuse_exposed_secrets(Path(path), data)
        return settings


def _url_password(url: str) -> bool:
    """Whether ``url`` carries a password or token: ``user:pass@`` (or ``:pass@``), or a
    ``token=`` / ``password=`` query parameter (every host of a comma-separated list)."""
    from urllib.parse import parse_qs, urlsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    netloc = parts.netloc
    if any(":" in host.rpartition("@")[0] for host in netloc.split(",") if "@" in host):
        return True
    query = parse_qs(parts.query)
    return any(query.get(k) for k in ("token", "password"))


def _refuse_exposed_secrets(path: Path, data: dict[str, Any]) -> None:
    """Refuse a config file that holds a secret (a volume's ``secret_key``, the NATS
    password or token) and is readable by group or others: the secret is already exposed,
    so the advisor does not start on it (use ``secret_key_file`` / ``nats_token_file``, or
    ``chmod 600`` the file).

    Raises:
        SettingsError: naming the file, its mode and the fields (never their values).
    """
    found = [f for f in _SECRET_FIELDS if data.get(f)]
    urls = [("subscribe_urls", u) for u in data.get("subscribe_urls") or [] if isinstance(u, str)]
    urls += [(f, data[f]) for f in ("publish_url", "jetstream_url", "redis_url") if isinstance(data.get(f), str)]
    found += sorted({f for f, u in urls if _url_password(u)})
    vols = data.get("volumes")
    if isinstance(vols, list):
        found += [f"volumes[{i}].secret_key" for i, v in enumerate(vols) if isinstance(v, dict) and v.get("secret_key")]
    check_secret_file_mode(path, found, "advisor config")
