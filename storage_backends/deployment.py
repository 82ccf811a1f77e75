"""One declaration of a deployment's storage, read by the advisors and the workers alike.

The advisor's JSON config (``kvadvisor advisor run --config advisor.json``: ``volumes``,
their roles, the SQLite ``catalog_path``) and the cluster advisors' storage file
(``python -m advisor.cluster --storage storage.json``: ``volumes``, their roles, the Redis
``catalog_prefix``) both declare the volumes of a deployment and the placement catalog
that says where each block is.  :class:`DeploymentStorage` reads either file, so a worker
(the vLLM connector, ``kvbm_runtime.vllm_adapter``) registers exactly the volumes the
advisors move blocks between and opens the same catalog: one place to declare them
(docs/operations.md, "vLLM connector").

:class:`VolumeSettings` (one volume, as the files spell it) and :class:`SettingsError`
live here so that ``advisor.settings`` and the workers share them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from .catalog import PlacementCatalog
from .types import MediaClass, VolumeDescriptor, VolumeKind

__all__ = [
    "REDIS_URL_ENV", "DeploymentStorage", "SettingsError", "VolumeSettings", "check_secret_file_mode",
    "check_volume_roles",
]

REDIS_URL_ENV = "KVADVISOR_CLUSTER_REDIS_URL"
"""Environment variable holding the Redis URL (with its password) of a cluster's catalog:
the cluster advisors' default for ``--redis`` and the workers' for a Redis catalog."""


class SettingsError(ValueError):
    """The advisor configuration is invalid or unreadable (message names the field)."""


class VolumeSettings(BaseModel):
    """One storage volume, as in ``storage_backends.VolumeDescriptor`` (bytes for sizes)."""

    id: str = Field(min_length=1, max_length=255)
    kind: Literal["posix", "s3"]
    media: Literal["nvme", "ssd", "hdd", "object"]
    capacity_bytes: int = Field(gt=0)
    root: str | None = None
    endpoint: str | None = None
    bucket: str | None = None
    prefix: str = ""
    region: str = "us-east-1"
    alignment: int = Field(4096, gt=0)
    o_direct: bool = False
    segment_bytes: int = Field(64 << 20, gt=0)
    access_key: str | None = None
    secret_key: SecretStr | None = None
    secret_key_file: str | None = None
    s3_sdk_max_attempts: int | None = Field(None, ge=1)
    s3_connect_timeout_s: float = Field(60.0, gt=0)
    s3_read_timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _one_secret(self) -> VolumeSettings:
        if self.secret_key is not None and self.secret_key_file is not None:
            raise ValueError(f"volume {self.id!r}: give secret_key or secret_key_file, not both")
        return self

    def secret(self) -> str | None:
        """The S3 secret key: ``secret_key``, else the first line of ``secret_key_file``.

        Raises:
            SettingsError: ``secret_key_file`` cannot be read, is empty, or is readable by
                group or others (mode & 0o077).
        """
        if self.secret_key is not None:
            return self.secret_key.get_secret_value()
        if self.secret_key_file is None:
            return None
        path = Path(self.secret_key_file)
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except OSError as exc:
            raise SettingsError(f"volume {self.id!r}: cannot read secret_key_file {path}: {exc}") from exc
        if mode & 0o077:
            raise SettingsError(f"volume {self.id!r}: secret_key_file {path} is readable by group or others "
                                f"(mode {mode & 0o777:o}); chmod 600 it")
        if not text:
            raise SettingsError(f"volume {self.id!r}: secret_key_file {path} is empty")
        return text.splitlines()[0]

    def to_descriptor(self) -> Any:
        """The ``storage_backends.VolumeDescriptor`` for this volume."""
        return VolumeDescriptor(
            id=self.id,
            kind=VolumeKind(self.kind),
            media=MediaClass(self.media),
            capacity_bytes=self.capacity_bytes,
            root=self.root,
            endpoint=self.endpoint,
            bucket=self.bucket,
            prefix=self.prefix,
            region=self.region,
            alignment=self.alignment,
            o_direct=self.o_direct,
            segment_bytes=self.segment_bytes,
            access_key=self.access_key,
            secret_key=self.secret(),
            s3_sdk_max_attempts=self.s3_sdk_max_attempts,
            s3_connect_timeout_s=self.s3_connect_timeout_s,
            s3_read_timeout_s=self.s3_read_timeout_s,
        )


def check_secret_file_mode(path: Path, found: list[str], what: str) -> None:
    """Refuse a file holding secrets (``found``: the field names) that group or others may
    read: the secret is already exposed.

    Raises:
        SettingsError: naming the file, its mode and the fields (never their values).
    """
    if not found:
        return
    try:
        mode = path.stat().st_mode & 0o777
    except OSError as exc:
        raise SettingsError(f"cannot stat {what} {path}: {exc}") from exc
    if mode & 0o077:
        raise SettingsError(f"{what} {path} holds secrets ({', '.join(found)}) and is readable by group or "
                            f"others (mode {mode:o}): chmod 600 it, or move them to secret_key_file / nats_token_file")


def check_volume_roles(ids: list[str], fast: str | None, slow: list[str], archive: str | None) -> None:
    """Volume ids are unique and every role names one of them.

    Raises:
        ValueError: naming the repeated ids or the role and the volume it names.
    """
    if len(set(ids)) != len(ids):
        raise ValueError(f"volume ids must be unique, got {ids}")
    for role, vol in (("fast_volume", fast), ("archive_volume", archive), *(("slow_volumes", v) for v in slow)):
        if vol is not None and vol not in ids:
            raise ValueError(f"{role} {vol!r} is not one of the volumes {ids}")


def _volume_secrets(data: dict[str, Any]) -> list[str]:
    vols = data.get("volumes")
    if not isinstance(vols, list):
        return []
    return [f"volumes[{i}].secret_key" for i, v in enumerate(vols) if isinstance(v, dict) and v.get("secret_key")]


class _StorageFields(BaseModel):
    """The storage fields of an advisor config or a cluster storage file (other keys of
    those files are the advisors' and ignored here)."""

    model_config = ConfigDict(extra="ignore")

    volumes: list[VolumeSettings] = Field(default_factory=list)
    fast_volume: str | None = None
    slow_volumes: list[str] = Field(default_factory=list)
    archive_volume: str | None = None
    volume_roots: list[str] | None = None
    catalog_path: str | None = None
    catalog_prefix: str = Field("kvadvisor:catalog", min_length=1)
    namespace: str = Field("default", min_length=1)
    extra_namespaces: list[str] = Field(default_factory=list)
    follow_catalog_namespaces: bool = True
    key_namespaces: list[str] = Field(default_factory=lambda: ["*"], min_length=1)

    @model_validator(mode="after")
    def _roles(self) -> _StorageFields:
        if not self.volumes:
            raise ValueError("no volumes declared")
        check_volume_roles([v.id for v in self.volumes], self.fast_volume, self.slow_volumes, self.archive_volume)
        return self


@dataclass(frozen=True)
class DeploymentStorage:
    """The volumes and the placement catalog of a deployment, from the advisors' file.

    Attributes:
        path: the file read.
        volumes: every declared volume.
        fast_volume, slow_volumes, archive_volume: the volumes' roles (the advisors' tiers).
        catalog: ``"sqlite"`` (an advisor config: ``catalog_path``) or ``"redis"`` (a
            cluster storage file: ``catalog_prefix``, the Redis URL from the environment).
        catalog_path: the SQLite catalog file (``"sqlite"``).
        catalog_prefix: the Redis catalog's key prefix (``"redis"``).
        volume_roots: directories the POSIX volumes must lie under; ``None``: anywhere.
        namespaces: key namespaces the advisors manage; ``None``: every one (an embedded
            advisor following its catalog's namespaces: up to its ``max_namespaces``).
    """

    path: Path
    volumes: tuple[VolumeSettings, ...]
    fast_volume: str | None
    slow_volumes: tuple[str, ...]
    archive_volume: str | None
    catalog: Literal["sqlite", "redis"]
    catalog_path: str | None
    catalog_prefix: str | None
    volume_roots: tuple[str, ...] | None
    namespaces: tuple[str, ...] | None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeploymentStorage:
        """Read an advisor config (``catalog_path`` set: SQLite) or a cluster storage file
        (no ``catalog_path``: the Redis catalog under ``catalog_prefix``).

        Raises:
            SettingsError: the file cannot be read, is not a JSON object, declares no
                volume, names a role that is no volume, or holds a volume's
                ``secret_key`` while readable by group or others (messages name the
                fields, never a secret).
        """
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cannot read storage settings {p}: {exc}") from exc
        if not isinstance(raw, dict):
            raise SettingsError(f"storage settings {p} must hold a JSON object, not {type(raw).__name__}")
        try:
            f = _StorageFields.model_validate(raw)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"storage settings {p}: {errs}") from None
        check_secret_file_mode(p, _volume_secrets(raw), "storage settings")
        embedded = f.catalog_path is not None
        roots: list[str] | None = f.volume_roots
        if roots is None and embedded:  # the embedded advisor's rule (AdvisorSettings.allowed_volume_roots)
            roots = [str(Path(f.catalog_path).parent)]  # type: ignore[arg-type]
        names: tuple[str, ...] | None
        if embedded and not f.follow_catalog_namespaces:
            names = tuple(dict.fromkeys([f.namespace, *f.extra_namespaces]))
        elif embedded:  # the advisor follows every namespace of its catalog (up to its max_namespaces)
            names = None
        else:
            names = None if "*" in f.key_namespaces else tuple(f.key_namespaces)
        return cls(
            path=p, volumes=tuple(f.volumes), fast_volume=f.fast_volume, slow_volumes=tuple(f.slow_volumes),
            archive_volume=f.archive_volume, catalog="sqlite" if embedded else "redis",
            catalog_path=f.catalog_path, catalog_prefix=None if embedded else f.catalog_prefix,
            volume_roots=None if roots is None else tuple(str(Path(r).resolve()) for r in roots),
            namespaces=names,
        )

    def descriptors(self) -> list[VolumeDescriptor]:
        """Every volume's descriptor (S3 secrets read from ``secret_key_file`` here).

        Raises:
            SettingsError: a ``secret_key_file`` that cannot be read or is exposed.
        """
        return [v.to_descriptor() for v in self.volumes]

    def manages(self, namespace: str) -> bool:
        """Whether the advisors of this file move blocks of key namespace ``namespace``."""
        return self.namespaces is None or namespace in self.namespaces

    def open_catalog(self, url: str | None = None) -> PlacementCatalog:
        """Open the placement catalog the advisors use.

        Args:
            url: ``"sqlite"``: a file path (or ``sqlite:///PATH``) instead of
                ``catalog_path``; ``"redis"``: ``redis://[:PASSWORD@]HOST:PORT/DB``
                instead of ``$KVADVISOR_CLUSTER_REDIS_URL``.

        Raises:
            SettingsError: a Redis catalog without a URL, or a URL of the other kind.
            StorageError: the catalog cannot be opened (``RedisCatalog`` pings the server).
        """
        if self.catalog == "sqlite":
            if url is not None and url.startswith("redis"):
                raise SettingsError(f"{self.path} declares a SQLite catalog (catalog_path); got a Redis URL")
            target = url.removeprefix("sqlite://") if url else self.catalog_path
            assert target is not None
            from .sqlite_catalog import SqliteCatalog

            Path(target).parent.mkdir(parents=True, exist_ok=True)
            return SqliteCatalog(target)
        url = url or os.environ.get(REDIS_URL_ENV)
        if not url:
            raise SettingsError(f"{self.path} is a cluster storage file (Redis catalog): set ${REDIS_URL_ENV} "
                                "(redis://[:PASSWORD@]HOST:PORT/DB) as for the cluster advisors")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"{self.path} declares a Redis catalog (catalog_prefix); got {url.split('://')[0]}://")
        from .redis_catalog import RedisCatalog

        return RedisCatalog(url, prefix=self.catalog_prefix or "kvadvisor:catalog")
