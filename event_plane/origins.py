"""Each source bound to the origin that first delivered it.

An *origin* names where a batch came from, as far as the transport can tell:

* ZMQ: ``zmq:<pub endpoint>`` the subscriber connected to (the same for its replay
  socket), plus ``#curve=<publisher public key, Z85>`` when CURVE is on, so a publisher
  that takes over the endpoint with another key is another origin;
* NATS / JetStream: ``nats:<subject>`` the message came on
  (``kvadvisor.events.<namespace>.<source>``). NATS messages do not carry the publishing
  user, so the subject is the origin: an operator binds users to subjects with per-user
  publish permissions in nats-server (``docs/operations.md``, "Authentication and origins").

The first batch of a source binds the source to its origin; a later batch of that source
from another origin (a new epoch or anything else) is refused before it reaches the
ordering tracker, changes nothing and is counted. With ``deferred=True`` (the advisor) the
first batch only *claims* the source for its origin; the claim becomes a binding when the
application admits the batch (:meth:`OriginGuard.commit`, after its quotas) and is dropped
when it refuses it (:meth:`OriginGuard.discard`), so a batch refused by a quota binds
nothing. Claims are few and short-lived (a batch between the transport and the
application); at most ``max_claims`` are held, the oldest forgotten beyond. Bindings are kept by whoever owns the
guard (the advisor persists them next to its journal) and are released by an operator
when a source is retired or moves (:meth:`OriginGuard.release`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

BindCallback = Callable[[str, str], None]
"""``on_bind(source, origin)``: persist a new binding; raising refuses the batch."""
RefuseCallback = Callable[[str, str], None]
"""``on_refuse(transport, origin)``: a batch was refused (``transport``: a
:data:`TRANSPORTS` value, a bounded label)."""

TRANSPORTS = ("zmq", "nats", "other")
"""Values of the ``transport`` of a refusal (a bounded metric label)."""

_LOG_EVERY = 1000  # after the first refusal, log one in this many (a forger can send many)


def zmq_origin(endpoint: str, server_key: bytes | None = None) -> str:
    """Origin of batches read from the ZMQ publisher at ``endpoint`` (its PUB address as the
    subscriber connects to it), with its CURVE public key (Z85) when CURVE is on."""
    return f"zmq:{endpoint}" + (f"#curve={server_key.decode()}" if server_key else "")


def nats_origin(subject: str) -> str:
    """Origin of batches that came on NATS / JetStream ``subject``."""
    return f"nats:{subject}"


def transport_of(origin: str) -> str:
    """The :data:`TRANSPORTS` value of ``origin`` (``other`` for an unknown prefix)."""
    head = origin.partition(":")[0]
    return head if head in TRANSPORTS else "other"


class OriginGuard:
    """Thread-safe map source → origin; first origin wins (trust on first use).

    Args:
        bindings: bindings restored from a previous run (source → origin).
        on_bind: called under the guard's lock for each new binding, before the batch is
            admitted (to persist it); if it raises, the batch is refused (counted in
            ``store_errors``) and the source stays unbound.
        on_refuse: called for each refused batch (outside the lock); exceptions are logged.
        deferred: claim instead of binding at :meth:`admit`; :meth:`commit` binds (module
            docstring).
        max_claims: claims held at once with ``deferred`` (the oldest is forgotten beyond).

    Attributes:
        refused: batches refused because their source is bound to another origin.
        store_errors: batches refused because ``on_bind`` failed.
    """

    def __init__(
        self,
        bindings: Mapping[str, str] | None = None,
        *,
        on_bind: BindCallback | None = None,
        on_refuse: RefuseCallback | None = None,
        deferred: bool = False,
        max_claims: int = 4096,
    ) -> None:
        self._bound: dict[str, str] = dict(bindings or {})
        self._deferred = deferred
        self._max_claims = max_claims
        self._claims: OrderedDict[str, list[Any]] = OrderedDict()  # source -> [origin, batches in flight]
        self._lock = threading.Lock()
        self._on_bind = on_bind
        self._on_refuse = on_refuse
        self.refused = 0
        self.store_errors = 0

    def admit(self, source: str, origin: str) -> bool:
        """Whether a batch of ``source`` from ``origin`` may go on; binds an unbound source
        to ``origin``. Changes nothing else and never raises for a refusal."""
        with self._lock:
            bound = self._bound.get(source)
            if bound == origin:
                return True
            if bound is None and self._deferred:
                claim = self._claims.get(source)
                if claim is None:
                    self._claims[source] = [origin, 1]
                    if len(self._claims) > self._max_claims:
                        self._claims.popitem(last=False)
                    return True
                if claim[0] == origin:
                    claim[1] += 1
                    return True
                bound = claim[0]
            elif bound is None:
                if self._on_bind is not None:
                    try:
                        self._on_bind(source, origin)
                    except Exception as exc:  # noqa: BLE001 - refuse rather than bind unpersisted
                        self.store_errors += 1
                        logger.warning("origin of %r not recorded (%s: %s): batch refused", source,
                                       type(exc).__name__, exc)
                        return False
                self._bound[source] = origin
                return True
        return self.refuse(source, origin, bound)

    def refuse(self, source: str, origin: str, bound: str | None = None) -> bool:
        """Count and report a refused batch of ``source`` from ``origin`` (``bound``: the
        origin it is bound to, if that is why). Returns ``False``."""
        with self._lock:
            self.refused += 1
            n = self.refused
        if n == 1 or n % _LOG_EVERY == 0:
            logger.warning("refused a batch of %r from %s: the source is bound to %s (%d refused so far; "
                           "an operator releases a retired or moved source)", source[:64], origin[:200],
                           bound or "its own subject", n)
        if self._on_refuse is not None:
            try:
                self._on_refuse(transport_of(origin), origin)
            except Exception:  # noqa: BLE001 - a counter must not stop delivery
                logger.exception("on_refuse callback failed")
        return False

    def commit(self, source: str) -> bool:
        """Bind ``source`` to the origin that claimed it (``deferred``; the application
        admitted a batch of it). ``True`` when bound (already, or now); ``False`` when the
        binding could not be persisted (``on_bind`` raised: the batch must be refused)."""
        with self._lock:
            if source in self._bound:
                return True
            claim = self._claims.pop(source, None)
            if claim is None:
                return True  # forgotten claim (beyond max_claims): the next batch claims again
            if self._on_bind is not None:
                try:
                    self._on_bind(source, claim[0])
                except Exception as exc:  # noqa: BLE001 - refuse rather than bind unpersisted
                    self.store_errors += 1
                    logger.warning("origin of %r not recorded (%s: %s): batch refused", source,
                                   type(exc).__name__, exc)
                    return False
            self._bound[source] = claim[0]
            return True

    def discard(self, source: str) -> None:
        """The application refused a batch of ``source``: drop its claim once no batch of
        it is in flight (``deferred``). Does nothing to a binding."""
        with self._lock:
            claim = self._claims.get(source)
            if claim is not None:
                claim[1] -= 1
                if claim[1] <= 0:
                    del self._claims[source]

    def count(self) -> int:
        """Bindings held."""
        with self._lock:
            return len(self._bound)

    def origin_of(self, source: str) -> str | None:
        """The origin ``source`` is bound to, or ``None``."""
        with self._lock:
            return self._bound.get(source)

    def bindings(self) -> dict[str, str]:
        """A copy of all bindings (source → origin)."""
        with self._lock:
            return dict(self._bound)

    def release(self, source: str) -> bool:
        """Forget ``source``'s binding (the next origin to deliver it binds it again).

        Returns:
            Whether it was bound.
        """
        with self._lock:
            return self._bound.pop(source, None) is not None


__all__ = ["OriginGuard", "TRANSPORTS", "nats_origin", "transport_of", "zmq_origin"]
