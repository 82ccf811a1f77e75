"""NATS transports: core NATS subjects and a JetStream stream as the durable log.

Subject of a batch: ``kvadvisor.events.<namespace>.<source>``; header
``Nats-Msg-Id: <namespace>.<source>:<epoch>:<seq>:<key>`` (JetStream de-duplicates on it;
``key`` is a random secret of the publisher, so no other publisher can send an id first). nats-py is
asyncio: each publisher / subscriber runs a private event loop in a daemon thread and the
thread-safe methods hand work to it. Extra keyword arguments (``user``, ``password``,
``token``, ``user_credentials``, ``nkeys_seed``, ``tls``, ...) go to ``nats.connect``
(:class:`~event_plane.nats_auth.NatsAuth` builds them); URLs in messages are redacted
(:func:`~event_plane.nats_auth.redact_url`).

The JetStream stream is bounded (:class:`~event_plane.config.StreamLimits`: 1 GiB and 24 h
by default, the oldest batches deleted first); whoever starts first creates it with its
limits and the others check theirs against it (:func:`ensure_stream`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import secrets
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.js import api as js_api
from nats.js.errors import APIError, NotFoundError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from event_plane.codec import CodecError, decode_batch
from event_plane.config import PublisherConfig, StreamLimits
from event_plane.errors import ConfigError, StreamMismatchError, TransportError
from event_plane.nats_auth import auth_from_url, redact_url
from event_plane.ordering import GapCallback
from event_plane.publisher import EventPublisher, FlushCallback, forwards_to_send_payload
from event_plane.schema import EventBatch
from event_plane.origins import nats_origin
from event_plane.subscriber import ResyncCallback, Subscriber

logger = logging.getLogger(__name__)

T = TypeVar("T")

SUBJECT_PREFIX = "kvadvisor.events"
STREAM_NAME = "KVADVISOR_EVENTS"
MSG_ID_HEADER = "Nats-Msg-Id"
_TOKEN = re.compile(r"^[A-Za-z0-9_\-@:+=~]+$")
_TIMEOUT_S = 30.0
_DUPLICATE_WINDOW_S = 120.0
_ERR_STREAM_NAME_IN_USE = 10058  # JetStream: stream name already in use with another configuration
STORE_FULL_ERR_CODES = frozenset({
    10077,  # store failed: "maximum bytes exceeded" / "maximum messages exceeded" (discard new)
    10023,  # "insufficient resources": the server's JetStream storage is exhausted
    10047,  # insufficient storage resources available
    10028,  # insufficient memory resources available
    10002,  # resource limits exceeded for account
})
"""JetStream API error codes (``err_code``) of a publish refused because the stream or the
server's storage is full: not retried (:func:`is_store_full`)."""
_UNSET: Any = object()


def subject_for(namespace: str, source: str) -> str:
    """NATS subject of ``source``'s batches in ``namespace``.

    Raises:
        ConfigError: ``namespace`` or ``source`` is not a single subject token
            (letters, digits and ``_-@:+=~``; no dots, spaces or wildcards).
    """
    for what, token in (("namespace", namespace), ("source", source)):
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise ConfigError(f"{what} {token!r} cannot be a NATS subject token")
    return f"{SUBJECT_PREFIX}.{namespace}.{source}"


def msg_id(namespace: str, batch: EventBatch) -> str:
    """``Nats-Msg-Id`` of a batch published in ``namespace``: ``<namespace>.<source>:<epoch>:<seq>``.

    The namespace is part of it because JetStream de-duplicates across the whole stream:
    without it, batches of one source and epoch in two namespaces (the partitions of a
    scaled index, docs/design.md §8) would drop each other, and anyone who may publish in
    any namespace could suppress another namespace's batch by sending its id first."""
    return f"{namespace}.{batch.source}:{batch.epoch}:{batch.seq}"


def _limits(stream: StreamLimits | None, max_age_s: Any = _UNSET, max_bytes: Any = _UNSET) -> StreamLimits:
    """``stream`` (or the default :class:`StreamLimits`) with the shorthand overrides.

    Raises:
        ConfigError: ``stream`` is not a StreamLimits, or an override is out of range.
    """
    if stream is None:
        stream = StreamLimits()
    elif not isinstance(stream, StreamLimits):
        raise ConfigError(f"stream must be a StreamLimits, got {type(stream).__name__}")
    if max_age_s is not _UNSET:
        stream = replace(stream, max_age_s=max_age_s)
    if max_bytes is not _UNSET:
        stream = replace(stream, max_bytes=max_bytes)
    return stream


class _LoopThread:
    """An asyncio event loop running in its own daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = _TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _abandon(io: _LoopThread, nc: Any) -> None:
    """After a failed set-up: close ``nc`` (when it connected) and stop ``io``."""
    if nc is not None:
        try:
            io.run(nc.close(), timeout=5)
        except Exception:  # noqa: BLE001 - already failing; the set-up error is what counts
            pass
    io.stop()


def describe(exc: BaseException) -> str:
    """One line naming an error, also for exceptions whose message is empty (timeouts)."""
    text = str(exc).strip()
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) and not text:
        text = "timed out (server unreachable or not answering)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def connect_nats(url: str, connect_timeout_s: float, options: dict[str, Any]) -> nats.NATS:
    """``nats.connect`` with bounded first connect, endless reconnects and one-line error logs.

    Raises:
        asyncio.TimeoutError / OSError / nats errors: the first connect failed (when it
            timed out after the server answered with an error, that error).
    """
    up = False
    errors: list[Exception] = []  # before the first connection: the last is raised on a timeout

    async def one_line_errors(exc: Exception) -> None:  # nats-py's default logs a traceback
        # Before the first connection the caller gets one TransportError; after it, say it.
        if not up:  # keep the server's own answer (e.g. an authorization error) over a reset after it
            if not isinstance(exc, OSError) or not errors or isinstance(errors[-1], OSError):
                errors[:] = [exc]
        logger.log(logging.WARNING if up else logging.DEBUG, "NATS %s: %s", redact_url(url), describe(exc))

    opts: dict[str, Any] = {
        "connect_timeout": connect_timeout_s,
        "max_reconnect_attempts": -1,
        "allow_reconnect": True,
        "error_cb": one_line_errors,
    }
    # "nats://a:4222,nats://b:4222": every node of a cluster, tried in turn and failed over to;
    # a user part in them ("nats://user:pw@a:4222") becomes connect options, so that nodes the
    # client learns from the cluster get the same credentials
    nodes, lifted = _lift_userinfo(url)
    opts.update(lifted)
    opts.update(options)
    # nats-py retries the initial connect forever with max_reconnect_attempts=-1 unless told
    # otherwise; bound it so a wrong URL fails fast.
    try:
        servers: str | list[str] = nodes if len(nodes) > 1 else nodes[0]
        nc = await asyncio.wait_for(nats.connect(servers, **opts), connect_timeout_s + 1.0)
    except asyncio.TimeoutError:
        if errors:  # e.g. "Authorization Violation" or a TLS failure, retried until the timeout
            raise errors[-1] from None
        raise
    up = True
    return nc


def _lift_userinfo(url: str) -> tuple[list[str], dict[str, Any]]:
    """``url``'s nodes without their user parts, and the ``nats.connect`` options of the
    first user part found (:func:`event_plane.nats_auth.auth_from_url`; ``{}`` when none)."""
    nodes, lifted = [], {}
    for node in (u.strip() for u in url.split(",")):
        parts = urlsplit(node)
        if "@" in parts.netloc:
            if not lifted:
                lifted = auth_from_url(node, {}).connect_options()
            node = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
        nodes.append(node)
    return nodes, lifted


async def fetch_forever(psub: Any, batch_size: int, closed: threading.Event, what: str,
                        wait_s: float = 0.2) -> AsyncIterator[Any]:
    """Yield the messages of a JetStream pull subscription until ``closed`` is set.

    Each pull request waits up to ``wait_s`` seconds on the server (its ``expires``); one that
    times out is an idle poll; any other fetch error is logged on one line and retried after
    0.1 s (reconnecting is nats-py's job). ``what`` names the reader in logs.
    """
    while not closed.is_set():
        try:
            msgs = await psub.fetch(batch_size, timeout=wait_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nothing new yet
            continue
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - reconnects are nats-py's job; keep pulling
            if closed.is_set():
                return  # the reader is closing (its subscription may be gone already)
            logger.warning("%s: fetch failed: %s", what, describe(exc))
            await asyncio.sleep(0.1)
            continue
        for msg in msgs:
            yield msg


def stream_config(limits: StreamLimits) -> js_api.StreamConfig:
    """The ``KVADVISOR_EVENTS`` stream configuration for ``limits``: subjects
    ``kvadvisor.events.>``, file storage, a 120 s duplicate window (``max_age`` when that
    is shorter: JetStream refuses a longer one), and ``limits``'s ``max_bytes`` /
    ``max_age`` / ``discard`` (JetStream's ``-1`` / ``0`` for unlimited) and ``replicas``."""
    age = limits.max_age_s
    return js_api.StreamConfig(
        name=STREAM_NAME,
        subjects=[f"{SUBJECT_PREFIX}.>"],
        max_age=age if age is not None else 0.0,
        max_bytes=limits.max_bytes if limits.max_bytes is not None else -1,
        discard=js_api.DiscardPolicy(limits.discard),
        duplicate_window=min(_DUPLICATE_WINDOW_S, age) if age is not None else _DUPLICATE_WINDOW_S,
        num_replicas=limits.replicas,
    )


def stream_differences(actual: js_api.StreamConfig, limits: StreamLimits) -> list[str]:
    """``"field: stream has X, configured Y"`` for each field of ``actual`` (an existing
    stream's configuration) that differs from :func:`stream_config` of ``limits``
    (subjects, max_bytes, max_age (seconds), discard, replicas, duplicate_window (seconds), the
    window only when max_age, which bounds it, does not differ already)."""

    def unlimited(value: Any, none: Any) -> Any:
        return "unlimited" if value in (None, none) else value

    def enum_value(value: Any) -> Any:
        return getattr(value, "value", value)

    wanted = stream_config(limits)
    out = []
    pairs = [
        ("subjects", sorted(actual.subjects or []), sorted(wanted.subjects or [])),
        ("max_bytes", unlimited(actual.max_bytes, -1), unlimited(wanted.max_bytes, -1)),
        ("max_age", unlimited(actual.max_age, 0), unlimited(wanted.max_age, 0)),
        ("discard", enum_value(actual.discard) or "old", enum_value(wanted.discard)),
        ("duplicate_window", actual.duplicate_window, wanted.duplicate_window),
        ("replicas", actual.num_replicas or 1, wanted.num_replicas),
    ]
    for name, have, want in pairs:
        same = have == want
        if not same and isinstance(have, float | int) and isinstance(want, float | int):
            same = abs(float(have) - float(want)) < 1e-6  # durations travel as nanoseconds
        if name == "duplicate_window" and any(line.startswith("max_age:") for line in out):
            same = True  # follows from max_age (never longer), already named
        if not same:
            out.append(f"{name}: stream has {have}, configured {want}")
    return out


async def ensure_stream(js: Any, limits: StreamLimits | None = None, *, who: str = "kvadvisor") -> js_api.StreamInfo:
    """Create the ``KVADVISOR_EVENTS`` stream with ``limits`` (default
    :class:`StreamLimits`) unless it exists; an existing stream is checked against them.

    An existing stream whose configuration differs (:func:`stream_differences`) is used as
    it is (its own limits stay in force) and a warning naming ``who`` and each differing
    field is logged; with ``limits.strict`` it is refused instead.

    Returns:
        The stream's info (state included) as found or created.

    Raises:
        StreamMismatchError: ``limits.strict`` and the existing stream differs.
        TransportError: JetStream refused to create the stream (e.g. ``max_bytes`` larger
            than the server's free JetStream storage); the message has the server's reason.
        nats errors: the server cannot be reached, JetStream is not enabled.
    """
    limits = limits or StreamLimits()
    try:
        info = await js.stream_info(STREAM_NAME)
    except NotFoundError:
        try:
            return await js.add_stream(stream_config(limits))
        except APIError as exc:
            if exc.err_code != _ERR_STREAM_NAME_IN_USE:
                raise TransportError(
                    f"JetStream refused to create stream {STREAM_NAME} (max_bytes={limits.max_bytes}, "
                    f"max_age_s={limits.max_age_s}, discard={limits.discard}): {describe(exc)}"
                ) from exc
            info = await js.stream_info(STREAM_NAME)  # another process created it meanwhile
    diffs = stream_differences(info.config, limits)
    if diffs:
        text = (f"{who}: JetStream stream {STREAM_NAME} exists with another configuration than "
                f"configured: {'; '.join(diffs)}")
        if limits.strict:
            raise StreamMismatchError(f"{text} (strict: refused; edit or recreate the stream, or fix the settings)")
        logger.warning("%s (the stream's own settings stay in force)", text)
    return info


def is_store_full(exc: BaseException) -> bool:
    """Whether ``exc`` (from a JetStream publish) says the stream or the server's
    JetStream storage is full: an API error with one of the codes of
    :data:`STORE_FULL_ERR_CODES`.  Such a publish fails again at once when retried, unlike
    a lost connection or a timeout."""
    return isinstance(exc, APIError) and exc.err_code in STORE_FULL_ERR_CODES


class NatsPublisher(EventPublisher):
    """Publishes batches to core NATS (``kvadvisor.events.<namespace>.<source>``).

    Args:
        source: worker id; must be a single NATS subject token.
        url: NATS server URL.
        namespace: subject namespace (single token).
        epoch, config, on_flush: see :class:`EventPublisher`.
        connect_timeout_s: seconds allowed for the initial connection.
        stream: JetStream only: the ``KVADVISOR_EVENTS`` stream's limits, used with
            ``manage_stream`` (:class:`StreamLimits`; ``None`` = its defaults: 1 GiB,
            24 h, discard old).
        manage_stream: JetStream only: at start, create the stream with ``stream``'s
            limits when it is missing and check an existing one against them (the
            JetStream API: stream info / create).  Off by default: a publisher then only
            publishes to its subject (a worker user needs no JetStream API right,
            docs/security.md); the advisors create the stream, and batches sent before it
            exists are re-sent until it does (``retry_for_s``).
        stream_max_age_s / stream_max_bytes: shorthands that override ``stream``'s
            ``max_age_s`` (seconds) / ``max_bytes`` (bytes); ``None`` = unlimited.
        **connect_options: passed to ``nats.connect`` (credentials, token, nkey, TLS, ...).

    ``flush`` returns once the server has the batches (a NATS PING/PONG round trip).
    Batches beyond ``config.queue_capacity`` events not yet written are dropped and
    counted (``stats().dropped``), or wait for room when ``config.overflow == "block"``.

    Raises:
        ConfigError: bad source / namespace token, bad stream limits.
        StreamMismatchError: JetStream, ``stream.strict`` and the existing stream's
            configuration differs.
        TransportError: the server cannot be reached, or refused to create the stream.
    """

    _use_jetstream = False

    def __init__(
        self,
        source: str,
        url: str = "nats://127.0.0.1:4222",
        namespace: str = "default",
        *,
        epoch: int | None = None,
        config: PublisherConfig | None = None,
        on_flush: FlushCallback | None = None,
        connect_timeout_s: float = 5.0,
        stream: StreamLimits | None = None,
        stream_max_age_s: float | None = _UNSET,
        stream_max_bytes: int | None = _UNSET,
        manage_stream: bool = False,
        **connect_options: Any,
    ) -> None:
        super().__init__(source, epoch=epoch, config=config, on_flush=on_flush)
        self.subject = subject_for(namespace, source)
        # a secret of this publisher in every Nats-Msg-Id: JetStream de-duplicates across the
        # whole stream, so ids another publisher could predict (namespace, source, epoch and
        # seq are all readable to some) would let it send them first and have this
        # publisher's batches dropped as duplicates
        self._msg_id_prefix = f"{namespace}.{source}"
        self._msg_id_key = secrets.token_hex(8)
        self.url = url
        self.stream_limits = _limits(stream, stream_max_age_s, stream_max_bytes)
        self._inflight = 0
        self._dropped = 0
        self._refused = 0  # batches refused for a full store (in a row: _refused_run)
        self._refused_run = 0
        self._count_lock = threading.Lock()
        self._room = threading.Condition(self._count_lock)
        self._io = _LoopThread(f"kvevents-nats-pub-{source}")
        try:
            self._nc = self._io.run(connect_nats(url, connect_timeout_s, connect_options))
            self._js = self._nc.jetstream() if self._use_jetstream else None
            if self._js is not None and manage_stream:
                self._io.run(ensure_stream(self._js, self.stream_limits, who=f"JetStream publisher {source}"))
        except StreamMismatchError:
            _abandon(self._io, getattr(self, "_nc", None))
            raise
        except Exception as exc:
            _abandon(self._io, getattr(self, "_nc", None))
            raise TransportError(f"cannot set up the NATS publisher at {redact_url(url)}: {describe(exc)}") from exc
        self._aq: asyncio.Queue[tuple[bytes, dict[str, str], int] | None] = self._io.run(self._make_queue())
        self._sender = asyncio.run_coroutine_threadsafe(self._send_loop(), self._io.loop)

    async def _make_queue(self) -> asyncio.Queue[tuple[bytes, dict[str, str], int] | None]:
        return asyncio.Queue()

    @forwards_to_send_payload
    def _send(self, batch: EventBatch, payload: bytes) -> None:
        self._send_payload(batch.seq, len(batch.events), payload)

    def _send_payload(self, seq: int, n: int, payload: bytes) -> None:
        """Queue one batch (``seq``, ``n`` events) for the I/O thread, within
        ``config.queue_capacity`` events in flight (drop and count, or wait for room)."""
        cap = self.config.queue_capacity
        with self._room:
            if self.config.overflow == "block":
                # A batch larger than the whole capacity goes once the queue is empty.
                self._room.wait_for(lambda: self._inflight == 0 or self._inflight + n <= cap)
            elif self._inflight + n > cap:
                self._dropped += n
                logger.warning("NATS publisher %s: queue full, dropped batch seq=%d", self.source, seq)
                return
            self._inflight += n
        item = (payload, {MSG_ID_HEADER: f"{self._msg_id_prefix}:{self.epoch}:{seq}:{self._msg_id_key}"}, n)
        self._io.loop.call_soon_threadsafe(self._aq.put_nowait, item)

    async def _send_loop(self) -> None:
        while True:
            item = await self._aq.get()
            if item is None:
                self._aq.task_done()
                return
            payload, headers, n = item
            try:
                if self._js is not None:
                    # Re-sending is safe: the stream drops a repeated Nats-Msg-Id. A full
                    # store is not retried: it refuses the batch again at once.
                    async for attempt in AsyncRetrying(
                        stop=stop_after_delay(self.retry_for_s),
                        wait=wait_exponential(multiplier=0.05, max=1.0),
                        retry=retry_if_exception(lambda exc: not is_store_full(exc)),
                        reraise=True,
                    ):
                        with attempt:
                            await self._js.publish(self.subject, payload, headers=headers, timeout=2.0)
                    self._store_accepts()
                else:
                    await self._nc.publish(self.subject, payload, headers=headers)
            except Exception as exc:  # noqa: BLE001 - counted; the stream shows the gap
                if is_store_full(exc):
                    self._store_refused(headers[MSG_ID_HEADER], n, exc)
                else:
                    logger.exception("NATS publisher %s: publish failed", self.source)
                    with self._count_lock:
                        self._dropped += n
            finally:
                with self._room:
                    self._inflight -= n
                    self._room.notify_all()
                self._aq.task_done()

    def _store_refused(self, batch_id: str, n: int, exc: BaseException) -> None:
        """A batch (``n`` events) refused for a full store: dropped and counted; the first
        of a run of refusals is logged as an error, the others at debug level."""
        with self._count_lock:
            self._dropped += n
            self._refused += 1
            self._refused_run += 1
            first = self._refused_run == 1
        logger.log(
            logging.ERROR if first else logging.DEBUG,
            "JetStream publisher %s: stream %s is full, batch %s dropped (%s); later batches are "
            "dropped the same way until it has room (stats().refused)",
            self.source, STREAM_NAME, batch_id, describe(exc),
        )

    def _store_accepts(self) -> None:
        with self._count_lock:
            run, self._refused_run = self._refused_run, 0
        if run:
            logger.warning("JetStream publisher %s: stream %s accepts batches again after %d refused",
                           self.source, STREAM_NAME, run)

    def _transport_refused(self) -> int:
        with self._count_lock:
            return self._refused

    async def _drain_queue(self) -> None:
        await self._aq.join()
        await self._nc.flush(timeout=10)

    def _wait_sent(self) -> None:
        self._io.run(self._drain_queue())

    def _transport_dropped(self) -> int:
        with self._count_lock:
            return self._dropped

    def _close_transport(self) -> None:
        async def _shutdown() -> None:
            await self._aq.join()
            self._aq.put_nowait(None)
            await asyncio.wrap_future(self._sender)
            await self._nc.drain()

        try:
            self._io.run(_shutdown())
        except Exception:  # noqa: BLE001 - closing must not raise on a dead server
            logger.exception("NATS publisher %s: close failed", self.source)
        finally:
            self._io.stop()


class JetStreamPublisher(NatsPublisher):
    """Like :class:`NatsPublisher`, but each batch is stored in the ``KVADVISOR_EVENTS``
    JetStream stream (a plain publish to the stream's subject with a ``Nats-Msg-Id``
    header; with ``manage_stream`` the stream is also created with ``stream``'s limits if
    missing, else checked against them) and acknowledged by the server. A batch whose ack does not come is re-sent
    (exponential back-off, for up to ``retry_for_s`` seconds, e.g. across a server
    restart); the stream de-duplicates re-sent batches by ``Nats-Msg-Id``, so nothing is
    doubled. ``flush`` returns once every batch is acked or given up.

    A batch the server refuses because the stream or its JetStream storage is full
    (:func:`is_store_full`: ``discard="new"`` at ``max_bytes``, or no storage left) is not
    retried: it is dropped at once, counted in ``stats().dropped`` (events) and
    ``stats().refused`` (batches), and logged as an error (the first of a run)."""

    _use_jetstream = True
    retry_for_s: float = 30.0


class NatsSubscriber(Subscriber):
    """Subscribes to core NATS subject ``kvadvisor.events.<namespace>.>``.

    Core NATS keeps no history: a gap is reported and counted as unrecovered.

    Args:
        url: NATS server URL.
        namespace: subject namespace.
        on_gap, queue_capacity, on_resync: see :class:`Subscriber`.
        connect_timeout_s: seconds allowed for the initial connection.
        **connect_options: passed to ``nats.connect``.

    Raises:
        ConfigError: bad namespace.
    """

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        namespace: str = "default",
        *,
        on_gap: GapCallback | None = None,
        queue_capacity: int = 100_000,
        connect_timeout_s: float = 5.0,
        on_resync: ResyncCallback | None = None,
        **connect_options: Any,
    ) -> None:
        super().__init__(on_gap=on_gap, queue_capacity=queue_capacity, on_resync=on_resync)
        subject_for(namespace, "x")
        self.url = url
        self.subject = f"{SUBJECT_PREFIX}.{namespace}.>"
        self._connect_timeout_s = connect_timeout_s
        self._options = connect_options
        self._io: _LoopThread | None = None
        self._nc: Any = None

    def start(self) -> None:
        if self._io is not None:
            return
        self._io = _LoopThread("kvevents-nats-sub")
        try:
            self._nc = self._io.run(connect_nats(self.url, self._connect_timeout_s, self._options))
            self._io.run(self._subscribe())
            self._answered.set()  # the server answered
        except Exception as exc:
            _abandon(self._io, self._nc)
            raise TransportError(f"cannot subscribe at {redact_url(self.url)}: {describe(exc)}") from exc

    async def _subscribe(self) -> None:
        await self._nc.subscribe(self.subject, cb=self._on_msg)
        await self._nc.flush()

    async def _on_msg(self, msg: Any) -> None:
        self._on_payload(msg.data, msg.subject)

    def _on_payload(self, data: bytes, subject: str) -> EventBatch | None:
        """Decode one message that came on ``subject`` (its origin,
        :func:`event_plane.origins.nats_origin`) and hand it to ordering; ``None`` if it
        does not decode, is over the size limits (:meth:`Subscriber.limit_batches`; the
        server's ``max_payload`` bounds what reaches us at all) or its source is bound to
        another subject."""
        if self._max_bytes is not None and len(data) > self._max_bytes:
            self._stats.decode_errors += 1
            return None
        try:
            batch = decode_batch(data, self._max_events)
        except CodecError:
            self._stats.decode_errors += 1
            return None
        if subject.rpartition(".")[2] != batch.source:
            # the subject is the origin (users are bound to subjects by the server's
            # permissions): a batch naming another source than its subject's last token
            # would squat that source's name, whoever binds it first
            if self._origins is not None:
                self._origins.refuse(batch.source, nats_origin(subject))
            else:
                self._stats.decode_errors += 1
            return None
        if not self._origin_admits(batch, nats_origin(subject)):
            return None
        self._tracker.accept(batch, None)
        return batch

    def close(self) -> None:
        if self._io is not None and not self._io.loop.is_closed() and not self._closed.is_set():
            if self._nc is not None:  # None when start() failed to connect
                try:
                    self._io.run(self._nc.drain())
                except Exception as exc:  # noqa: BLE001
                    logger.warning("NATS subscriber: drain failed: %s", describe(exc))
            self._io.stop()
        self._closed.set()


_STOP_PULL_S = 2.0
"""Seconds ``JetStreamSubscriber.close`` waits for its pull loop to end by itself."""


async def _settle(msg: Any, hand_back: bool = False) -> None:
    """Acknowledge a fetched JetStream message whose batch was handed out, or with
    ``hand_back`` negatively acknowledge it (``-NAK``: the consumer delivers it again at
    once).  Errors are logged: the message then comes again after the ack wait (a live
    subscriber drops it as a duplicate)."""
    try:
        await (msg.nak() if hand_back else msg.ack())
    except Exception as exc:  # noqa: BLE001 - the ack wait still settles it
        logger.warning("JetStream subscriber: %s a message failed: %s",
                       "handing back" if hand_back else "acknowledging", describe(exc))


class JetStreamSubscriber(NatsSubscriber):
    """Reads the ``KVADVISOR_EVENTS`` stream through a durable pull consumer with explicit ack.

    Each batch is acknowledged when :meth:`get` hands it out (a duplicate or a batch that
    is refused, at once); when the queue is full the consumer waits instead of dropping, so
    a restarted subscriber with the same ``durable`` name resumes after the last batch its
    previous run handed out: batches queued and not read (or read after ``close``) come
    again (at least once).  ``close`` unsubscribes the pull inbox, then hands back
    (``-NAK``), in stream order, the batches queued and not read and the messages fetched
    and not queued, so the next run reads them at once and in order, not after the ack wait. ``deliver`` chooses where a *new* durable starts: ``"all"``
    (whole stream), ``"new"``, ``("seq", n)`` (stream sequence) or ``("time", iso8601)``.

    Messages the consumer was to read but the stream had already deleted (its limits)
    when it started are reported, not skipped in silence: when the consumer's start (a new
    durable: stream sequence 1 for ``"all"``, ``n`` for ``("seq", n)``, the resolved
    position for ``("time", t)`` when the oldest message kept is newer than ``t``; a durable
    that resumes: its ack floor + 1) is below the stream's first sequence, their number is
    counted in ``stats().discarded`` and logged, and the first batch of each (source, epoch)
    seen afterwards with seq > 0 is a gap from 0 (``on_gap``, ``gaps``, ``unrecovered``,
    ``resync_needed``), as on live transports.

    Args:
        durable: consumer name (one per logical subscriber; shared names split the stream).
        batch_size: messages fetched per pull.
        stream: the stream's limits, used when this subscriber creates the stream and
            checked against an existing one (:class:`StreamLimits`; ``None`` = defaults).
        pull_wait_s: how long each pull request waits on the server for messages (its
            ``expires``, seconds; > 0). ``close`` does not depend on it: the last request's
            inbox is unsubscribed first, so a request still waiting gets nothing.

    Raises:
        ConfigError: bad namespace, durable name, ``deliver``, stream limits or ``pull_wait_s``.
        StreamMismatchError (from ``start``): ``stream.strict`` and the existing stream's
            configuration differs.
    """

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        namespace: str = "default",
        *,
        durable: str = "kvadvisor",
        deliver: str | tuple[str, Any] = "all",
        batch_size: int = 256,
        on_gap: GapCallback | None = None,
        queue_capacity: int = 100_000,
        connect_timeout_s: float = 5.0,
        on_resync: ResyncCallback | None = None,
        stream: StreamLimits | None = None,
        pull_wait_s: float = 0.2,
        **connect_options: Any,
    ) -> None:
        super().__init__(
            url,
            namespace,
            on_gap=on_gap,
            queue_capacity=queue_capacity,
            connect_timeout_s=connect_timeout_s,
            on_resync=on_resync,
            **connect_options,
        )
        if not pull_wait_s > 0:
            raise ConfigError(f"pull_wait_s must be > 0 seconds, got {pull_wait_s!r}")
        self._pull_wait_s = float(pull_wait_s)
        if not isinstance(durable, str) or not re.match(r"^[A-Za-z0-9_\-]+$", durable):
            raise ConfigError(f"durable name {durable!r} is not a valid consumer name")
        self._durable = durable
        self._start_at = deliver
        self._consumer_config()  # raises ConfigError on a bad ``deliver`` now, not at start()
        self._batch_size = batch_size
        self.stream_limits = _limits(stream)
        # A durable resumes mid-stream: earlier seqs were consumed by its previous run
        # (unless the stream deleted what it was to read: _check_discarded).
        self._tracker = self._make_tracker(first_seq_gap=False)
        self._task: Any = None
        self._psub: Any = None  # the pull subscription (unsubscribed before the connection closes)
        self._just_queued: list[EventBatch] = []  # batches the payload being handled queued
        self._unacked: dict[int, Any] = {}  # id(queued batch) -> its message, until handed out
        self._left: list[Any] = []  # messages fetched and not queued when close() began

    def start(self) -> None:
        """Connect, create or check the stream, create or resume the durable, start pulling.

        Raises:
            StreamMismatchError: ``stream.strict`` and the existing stream differs.
            TransportError: the server cannot be reached or refuses the stream / consumer.
        """
        try:
            super().start()
        except TransportError as exc:
            if isinstance(exc.__cause__, StreamMismatchError):
                raise exc.__cause__ from None
            raise

    def _consumer_config(self) -> js_api.ConsumerConfig:
        kw: dict[str, Any] = {"durable_name": self._durable, "ack_policy": js_api.AckPolicy.EXPLICIT}
        if self._start_at == "all":
            kw["deliver_policy"] = js_api.DeliverPolicy.ALL
        elif self._start_at == "new":
            kw["deliver_policy"] = js_api.DeliverPolicy.NEW
        elif isinstance(self._start_at, tuple) and self._start_at[0] == "seq":
            kw["deliver_policy"] = js_api.DeliverPolicy.BY_START_SEQUENCE
            kw["opt_start_seq"] = int(self._start_at[1])
        elif isinstance(self._start_at, tuple) and self._start_at[0] == "time":
            kw["deliver_policy"] = js_api.DeliverPolicy.BY_START_TIME
            kw["opt_start_time"] = str(self._start_at[1])
        else:
            raise ConfigError(f"unsupported deliver option {self._start_at!r}")
        return js_api.ConsumerConfig(**kw)

    async def _subscribe(self) -> None:
        js = self._nc.jetstream()
        await ensure_stream(js, self.stream_limits, who=f"JetStream subscriber {self._durable}")
        try:
            before = await js.consumer_info(STREAM_NAME, self._durable)
        except NotFoundError:
            before = None
        psub = await js.pull_subscribe(
            self.subject, durable=self._durable, stream=STREAM_NAME, config=self._consumer_config()
        )
        await self._check_discarded(js, before)
        self._psub = psub
        self._task = asyncio.get_running_loop().create_task(self._pull_loop(psub))

    async def _check_discarded(self, js: Any, before: Any) -> None:
        """Count and report what the stream deleted before this consumer could read it
        (see the class doc); ``before`` is the durable's info before this start, ``None``
        when it is new. Switches the tracker to gap-from-0 when anything was."""
        state = (await js.stream_info(STREAM_NAME)).state
        first = int(state.first_seq or 0)
        if first <= 1:
            return  # nothing ever deleted (an empty new stream has first_seq 0)
        if before is not None:
            acked = int(before.ack_floor.stream_seq) if before.ack_floor is not None else 0
            delivered = before.delivered
            if not acked and delivered is not None and not delivered.consumer_seq:
                acked = int(delivered.stream_seq)  # nothing delivered yet: its start - 1
            start = acked + 1
            what = f"durable {self._durable!r} resumes at stream sequence {start}"
        elif self._start_at == "all":
            start, what = 1, f"new durable {self._durable!r} reads the whole stream"
        elif isinstance(self._start_at, tuple) and self._start_at[0] == "seq":
            start = int(self._start_at[1])
            what = f"new durable {self._durable!r} starts at stream sequence {start}"
        elif isinstance(self._start_at, tuple) and self._start_at[0] == "time":
            info = await js.consumer_info(STREAM_NAME, self._durable)
            resolved = int(info.delivered.stream_seq) + 1 if info.delivered is not None else first
            if resolved > first:
                return  # older messages kept: the start time falls inside the stream
            # The oldest message kept is newer than the start time: deleted ones may not
            # have been older; count them all (an upper bound).
            start = 1
            what = f"new durable {self._durable!r} starts at {self._start_at[1]}, before the oldest message kept"
        else:
            return  # "new": nothing before was asked for
        lost = first - start
        if lost <= 0:
            return
        self._stats.discarded += lost
        self._tracker = self._make_tracker(first_seq_gap=True)
        logger.warning(
            "JetStream subscriber: %s, but the stream (limits max_bytes / max_age) already deleted "
            "sequences %d..%d (%d messages, all namespaces): sources whose batches were among them "
            "are reported as gaps", what, start, first - 1, lost,
        )

    async def _pull_loop(self, psub: Any) -> None:
        async for msg in fetch_forever(psub, self._batch_size, self._closed, "JetStream subscriber", self._pull_wait_s):
            # The stream is durable: wait for room instead of dropping (back-pressure).
            while self._queue.full() and not self._closed.is_set():
                await asyncio.sleep(0.005)
            self._just_queued = []
            queued = False
            with self._on_taken.lock:  # get() finds the batch's hook once it can take the batch
                if self._closed.is_set():
                    # left for close() to hand back (nak), with the rest of the fetched
                    # batch, after the batches queued before them: the next run of this
                    # durable reads them first and in order, not after the ack wait (30 s)
                    self._left.append(msg)
                    continue
                try:
                    batch = self._on_payload(msg.data, msg.subject)
                except Exception:  # noqa: BLE001 - one bad batch must not stop the consumer
                    logger.exception("JetStream subscriber: batch could not be applied")
                    batch = None
                if batch is not None and any(b is batch for b in self._just_queued):
                    self._unacked[id(batch)] = msg
                    self._on_taken.add(batch, functools.partial(self._taken, batch))
                    queued = True
            if not queued:  # nothing of it to hand out (a duplicate, refused, or parked)
                await msg.ack()

    def _deliver(self, batch: EventBatch) -> None:
        self._just_queued.append(batch)
        super()._deliver(batch)

    def _taken(self, batch: EventBatch) -> None:
        """``get`` handed ``batch`` out: acknowledge its message from the I/O loop (``get``
        runs on the caller's thread); after ``close`` it was handed back instead, and the
        durable's next run gets the batch again."""
        msg = self._unacked.pop(id(batch), None)
        io = self._io
        if msg is None or io is None or io.loop.is_closed():
            return
        try:
            io.loop.call_soon_threadsafe(lambda: io.loop.create_task(_settle(msg)))
        except RuntimeError:  # the loop closed meanwhile
            pass

    def close(self) -> None:
        if self._io is not None and not self._io.loop.is_closed() and not self._closed.is_set():
            self._closed.set()

            async def _stop() -> None:
                # 1. The server keeps this run's last pull request waiting until it expires
                # (pull_wait_s) and hands it any message that becomes available meanwhile, a new one
                # or one handed back below, unless the request's inbox has no interest any
                # more; the durable's next run would then get that batch only after the ack
                # wait (30 s), behind later ones.  So the inbox is unsubscribed first, and the
                # flush's round trip returns once the server has removed it.
                # (drain() would wait on the pull subscription's inbox forever.)
                if self._psub is not None:
                    try:
                        await self._psub.unsubscribe()
                        await self._nc.flush(timeout=5)
                    except Exception as exc:  # noqa: BLE001 - closing anyway
                        logger.warning("JetStream subscriber: unsubscribe failed: %s", describe(exc))
                # 2. The pull loop sees _closed and leaves what it fetched and did not queue
                # in _left; cancelled only if it does not end
                if self._task is not None:
                    try:
                        await asyncio.wait_for(asyncio.shield(self._task), _STOP_PULL_S)
                    except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                        self._task.cancel()
                        try:
                            await self._task
                        except (asyncio.CancelledError, Exception):  # noqa: BLE001
                            pass
                # 3. Hand back, in stream order, the batches queued and not handed out (they
                # stay readable here, and come again: at least once), then what the pull loop
                # fetched and did not queue; the server redelivers them in that order
                with self._on_taken.lock:
                    back = [*self._unacked.values(), *self._left]
                    self._unacked.clear()
                    self._left.clear()
                for msg in back:
                    await _settle(msg, hand_back=True)
                await self._nc.flush(timeout=5)
                await self._nc.close()

            try:
                self._io.run(_stop(), timeout=10)
            except Exception:  # noqa: BLE001
                logger.exception("JetStream subscriber: close failed")
            self._io.stop()
        self._closed.set()
