"""The run-time state a scaled cluster's REST API accepts, kept in a JetStream KV bucket.

``python -m api.cluster_api`` takes one kind of state at run time: the worker registrations
of its indexer-compatible routes (``POST /register``, ``/unregister``; volume administration
and drains belong to one advisor's storage and are refused there, HTTP 501).  The cluster
keeps its coordination state in JetStream KV already (the partition leases,
:mod:`advisor.cluster.leases`), so the registrations go to a KV bucket on the same servers
(``KVADVISOR_API`` by default, file storage, no TTL, replicated like the leases): one key per
namespace, ``registrations.<namespace>``, holding the whole list as JSON
(``{"version": 1, "registrations": [...]}``), replaced in one put when a registration is
accepted or removed, so a reader never sees half of a change.  At start the API restores
them (:meth:`api.indexer_registry.IndexerRegistry.restore`).  API processes of one
namespace share the key: run one per namespace (docs/operations.md, "Indexer API").
"""

from __future__ import annotations

import json
import re
from typing import Any

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError

from advisor.cluster.node import ClusterClient

__all__ = ["ApiStateError", "RegistrationBucket", "state_key"]

FORMAT_VERSION = 1
"""Version of the stored value."""

_KEY_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")
_BUCKET_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ApiStateError(RuntimeError):
    """The stored state cannot be read (not this format) or the bucket cannot be used."""


def state_key(namespace: str) -> str:
    """The KV key of ``namespace``'s registrations: ``registrations.<namespace>``, the
    namespace as hex UTF-8 (prefixed ``x``) when it has characters a key cannot hold."""
    part = namespace if _KEY_SAFE.match(namespace) else "x" + namespace.encode().hex()
    return f"registrations.{part}"


class RegistrationBucket:
    """The cluster API's worker registrations in a JetStream KV bucket
    (``api.indexer_registry.RegistrationStore``; module docstring).

    Args:
        client: the API's connected :class:`ClusterClient` (its NATS connection is used).
        namespace: the cluster's event namespace (one key per namespace).
        bucket: KV bucket name (letters, digits, ``_``, ``-``).
        replicas: bucket replicas when this creates it (1, or 3 on a 3-node cluster).
        timeout_s: seconds one read or write may take.

    Raises:
        ApiStateError: a bad bucket name.
    """

    def __init__(self, client: ClusterClient, namespace: str, bucket: str = "KVADVISOR_API", replicas: int = 1,
                 timeout_s: float = 10.0) -> None:
        if not _BUCKET_SAFE.match(bucket):
            raise ApiStateError(f"api state bucket {bucket!r}: letters, digits, '_' or '-' only (at most 64)")
        self._client, self.bucket, self.key = client, bucket, state_key(namespace)
        self._replicas, self._timeout = replicas, timeout_s
        self._kv: Any = None  # bound on the client's loop at the first use

    async def _bound(self, nc: Any) -> Any:
        if self._kv is not None:
            return self._kv
        js = nc.jetstream()
        try:
            kv = await js.key_value(self.bucket)
        except BucketNotFoundError:
            try:
                kv = await js.create_key_value(KeyValueConfig(
                    bucket=self.bucket, history=1, replicas=self._replicas, storage=StorageType.FILE,
                    description="kvadvisor cluster API state (worker registrations)"))
            except APIError:
                kv = await js.key_value(self.bucket)  # another API created it meanwhile
        self._kv = kv
        return kv

    def load_registrations(self) -> list[dict[str, Any]]:
        """The stored registrations (``api.indexer_registry.Registration`` fields by name),
        oldest first; ``[]`` when none were stored.

        Raises:
            ApiStateError: the servers do not answer in time, or the stored value is not
                this format (it is left as it is).
        """
        async def get(nc: Any) -> bytes | None:
            kv = await self._bound(nc)
            try:
                entry = await kv.get(self.key)
            except KeyNotFoundError:
                return None
            return entry.value

        try:
            raw = self._client.call(get, self._timeout)
        except Exception as exc:  # noqa: BLE001 - nats' errors vary; the API must not start without its state
            raise ApiStateError(f"stored registrations (bucket {self.bucket!r}, key {self.key!r}) not read: "
                                f"{type(exc).__name__}: {exc}") from None
        if not raw:
            return []
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"version {doc.get('version') if isinstance(doc, dict) else None!r}, "
                                 f"expected {FORMAT_VERSION}")
            regs = doc["registrations"]
            if not isinstance(regs, list) or not all(isinstance(r, dict) for r in regs):
                raise ValueError("'registrations' is not a list of objects")
        except (ValueError, KeyError) as exc:
            raise ApiStateError(f"stored registrations (bucket {self.bucket!r}, key {self.key!r}) not readable: "
                                f"{exc}") from None
        return regs

    def save_registrations(self, registrations: list[dict[str, Any]]) -> None:
        """Replace the stored registrations (durable on the servers when it returns).

        Raises:
            TimeoutError / nats errors: not stored (the caller undoes its change).
        """
        value = json.dumps({"version": FORMAT_VERSION, "registrations": registrations},
                           separators=(",", ":")).encode()

        async def put(nc: Any) -> None:
            kv = await self._bound(nc)
            await kv.put(self.key, value)

        self._client.call(put, self._timeout)
