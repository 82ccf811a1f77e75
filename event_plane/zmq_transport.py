"""ZMQ transport: PUB + ROUTER replay on the publisher, SUB + DEALER on the subscriber.

Frames are described in :mod:`event_plane.frames`. pyzmq sockets are not thread-safe:
the PUB socket is only used under the publisher's lock, the ROUTER only by its replay
thread, and every subscriber socket only by the subscriber's receiver thread.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed
from zmq.auth.thread import ThreadAuthenticator

from event_plane.codec import CodecError, decode_batch
from event_plane.config import PublisherConfig
from event_plane.curve import CurveClient, CurveKeys, configure_client, configure_server
from event_plane.errors import ConfigError, TransportError
from event_plane.frames import END_SEQ, SEQ_BYTES, seq_from_bytes, seq_to_bytes
from event_plane.ordering import GapCallback
from event_plane.origins import zmq_origin
from event_plane.publisher import EventPublisher, FlushCallback, forwards_to_send_payload
from event_plane.schema import EventBatch
from event_plane.subscriber import ResyncCallback, Subscriber

logger = logging.getLogger(__name__)

_POLL_MS = 50
_END = object()  # end-of-replay marker returned by ZmqSubscriber._parse_reply
_PUB_HWM = 100_000  # messages queued per subscriber before ZMQ drops (ZMQ's own policy)
_RETRY_S = 0.5  # pause of the receive loop after an unexpected error
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""``MAXMSGSIZE`` of a subscriber's sockets without :meth:`Subscriber.limit_batches` (the
advisor sets one derived from its quotas, :func:`event_plane.codec.max_batch_bytes`)."""

MAX_RECOVERING = 16
"""Default of ``ZmqSubscriber(max_recovering=)``: sources per endpoint whose gap is fetched at once."""
MAX_PARKED = 10_000
"""Default of ``ZmqSubscriber(max_parked=)``: batches of one source held during its recovery."""
MAX_PROBE_SOURCES = 4096
"""Source names remembered per endpoint for the idle probe's start (:meth:`ZmqSubscriber.
_probe_starts`), the most recently seen kept: one endpoint that sends batches under ever new
names cannot grow the subscriber without bound. A source past the limit is still ordered and
delivered; only the probe no longer starts at its position."""
PROBE_MAX_S = 1.0
"""An idle probe of the replay sockets (``ZmqSubscriber(idle_probe_s=)``) holds the receiver
thread at most this long, however long the answers keep coming."""
RECOVERY_MAX_S = 60.0
"""A gap recovery ends after this long in all, even while the publisher keeps answering
(its inactivity timeout is ``replay_timeout_s``): a peer that trickles an endless answer
cannot keep a recovery slot, nor its source's batches parked, for ever."""


@dataclass
class _Recovery:
    """One source's gap being fetched from endpoint ``i`` (subscriber receiver thread only)."""

    i: int
    source: str
    epoch: int
    first: int
    last: int
    dealer: zmq.Socket
    deadline: float  # monotonic: no answer since replay_timeout_s
    hard_deadline: float  # monotonic: RECOVERY_MAX_S after the request
    got: list[EventBatch] = field(default_factory=list)
    parked: deque[tuple[int, EventBatch, bool]] = field(default_factory=deque)  # (endpoint, batch, replayed)


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether binding ``endpoint`` listens on this machine only: ``ipc://`` / ``inproc://``,
    or ``tcp://HOST:PORT`` whose HOST is ``localhost`` or a loopback address (127.0.0.0/8,
    ``::1``). ``*``, ``0.0.0.0``, ``::``, another address or an interface name is not."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme in ("ipc", "inproc"):
        return True
    if not sep or scheme != "tcp":
        return False
    host = rest.rpartition(":")[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(sock: zmq.Socket, endpoint: str, what: str, retry_s: float = 2.0) -> str:
    """Bind ``sock``; retry EADDRINUSE for ``retry_s`` seconds (a restarted publisher often
    rebinds a port whose previous socket ZMQ is still closing in its I/O thread)."""
    try:
        for attempt in Retrying(
            stop=stop_after_delay(retry_s),
            wait=wait_fixed(0.05),
            retry=retry_if_exception(lambda e: isinstance(e, zmq.ZMQError) and e.errno == zmq.EADDRINUSE),
            reraise=True,
        ):
            with attempt:
                sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise TransportError(f"cannot bind {what} to {endpoint}: {exc}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


REPLAY_COUNTERS = ("requests", "served", "malformed", "refused_busy", "refused_peer_rate", "refused_total_rate",
                   "refused_active", "refused_peer_active", "preempted", "truncated", "stalled", "unreachable",
                   "recycles")
"""Keys of :meth:`ZmqPublisher.replay_stats` (a fixed set, whatever the clients send)."""

_REPLAY_WAIT_MS = 5  # poll tick while every answer in progress waits for its client to read
_REPLAY_CHUNK = 256  # messages one answer sends per round (fairness between clients)
_REPLAY_PEERS = 4096  # clients whose request rate is remembered (least recent forgotten first)


class _Bucket:
    """Token bucket: ``rate`` tokens per second, at most ``max(1, rate)`` held."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.cap = max(1.0, rate)
        self.tokens = self.cap
        self.t = now

    def ready(self, now: float) -> bool:
        """Refill up to ``now``; whether a token is there (none is taken)."""
        self.tokens = min(self.cap, self.tokens + (now - self.t) * self.rate)
        self.t = now
        return self.tokens >= 1.0


@dataclass
class _ReplayPeer:
    """One replay peer (network address, plus CURVE key): its answers in progress and until
    when it counts as not reading (replay thread only)."""

    active: int = 0
    suspect_until: float = 0.0


@dataclass
class _ReplayJob:
    """One replay answer in progress (replay thread only)."""

    envelope: list[bytes]
    hits: list[tuple[int, bytes]]
    since: float  # monotonic time of the last message the client's queue accepted
    peer: _ReplayPeer = field(default_factory=_ReplayPeer)
    pos: int = 0
    sent_bytes: int = 0


class ZmqPublisher(EventPublisher):
    """Publishes batches on a ZMQ PUB socket and serves replays on a ROUTER socket.

    Args:
        source: worker / instance id.
        endpoint: PUB bind address (``tcp://HOST:PORT``; ``PORT`` may be ``*``).
        replay_endpoint: ROUTER bind address, or ``None`` for no replay.
        topic: topic frame of every message (UTF-8), e.g. ``"kv@podA@modelX"``.
        epoch, config, on_flush: see :class:`EventPublisher`.
        context: ZMQ context (the process-wide one by default).
        bind_retry_s: seconds to keep retrying a bind that fails with EADDRINUSE.
        allow_remote: allow endpoints other machines can reach (``*``, ``0.0.0.0``, a
            non-loopback address) without CURVE. The sockets then have no
            authentication: any peer that reaches them reads every event and can ask for
            replays. Off by default, so only loopback endpoints bind
            (:func:`is_loopback_endpoint`) unless ``curve`` is given.
        curve: our CURVE keypair (:func:`event_plane.curve.load_secret`): the PUB and
            replay ROUTER become CURVE servers (encrypted, and subscribers must know our
            public key), and any endpoint may be bound. URL ``curve_secret=FILE``.
        curve_clients: with ``curve``: a directory of the subscribers' public key files
            (``*.key``) allowed to connect; others are refused by a ZAP authenticator
            (on a ZMQ context of this publisher's own). ``None``: any client that knows
            our public key. URL ``curve_clients=DIR``.

    Replay answers are bounded against clients that ask and never read (``docs/events.md``
    §5.2): the ROUTER's send high-water mark is ``config.replay_hwm`` and answers are paced
    to it, one answer at a time per client, at most ``config.replay_max_active`` at once
    and ``config.replay_max_bytes`` each, requests limited per client and in all
    (``replay_peer_rate``, ``replay_total_rate``); :meth:`replay_stats` counts what was
    refused, cut or abandoned.

    Attributes:
        endpoint / replay_endpoint: the addresses actually bound (resolved wildcards).

    Raises:
        ConfigError: an endpoint is not loopback and ``allow_remote`` is not set.
        TransportError: an endpoint cannot be bound.
    """

    def __init__(
        self,
        source: str,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        epoch: int | None = None,
        config: PublisherConfig | None = None,
        on_flush: FlushCallback | None = None,
        context: zmq.Context | None = None,
        bind_retry_s: float = 2.0,
        allow_remote: bool = False,
        curve: CurveKeys | None = None,
        curve_clients: str | None = None,
    ) -> None:
        if curve_clients is not None and curve is None:
            raise ConfigError("curve_clients needs CURVE on (a curve secret key, URL curve_secret=FILE)")
        if not allow_remote and curve is None:
            for ep in (endpoint, replay_endpoint):
                if ep is not None and not is_loopback_endpoint(ep):
                    raise ConfigError(
                        f"ZMQ publisher endpoint {ep} is reachable from other machines and the event sockets have "
                        "no authentication (any peer could read the events and ask for replays): bind a loopback "
                        "address (127.0.0.1, localhost, ::1), turn CURVE on (URL: curve_secret=FILE), or opt in "
                        "with allow_remote=True (URL: allow_remote=1)"
                    )
        super().__init__(source, epoch=epoch, config=config, on_flush=on_flush)
        self.topic: bytes = topic.encode()
        self._curve = curve
        self._auth: ThreadAuthenticator | None = None
        self._own_ctx: zmq.Context | None = None
        if curve_clients is not None:
            # one ZAP handler per context: this publisher's own, so that several
            # publishers (and subscribers) in one process do not share or fight over it
            self._own_ctx = zmq.Context()
            self._auth = ThreadAuthenticator(self._own_ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.start()
            try:
                self._auth.configure_curve(domain="*", location=str(curve_clients))
            except Exception:
                self._release_own_context()
                raise
        ctx = self._own_ctx or context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        if curve is not None:
            configure_server(self._pub, curve)
        self._pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
        self._pub.setsockopt(zmq.LINGER, 1000)
        try:
            self.endpoint: str = _bind(self._pub, endpoint, "PUB", bind_retry_s)
        except TransportError:
            self._release_own_context()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.replay_buffer)
        self._buffer_lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._replay_thread: threading.Thread | None = None
        self.replay_requests = 0
        self._replay_counts = dict.fromkeys(REPLAY_COUNTERS, 0)
        self._stalled_since_recycle = 0
        self._ctx = ctx
        self._bind_retry_s = bind_retry_s
        if replay_endpoint is not None:
            try:
                router, self.replay_endpoint = self._make_router(replay_endpoint)
            except TransportError:
                self._pub.close(linger=0)
                self._release_own_context()
                raise
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(router,), name=f"kvevents-replay-{source}", daemon=True
            )
            self._replay_thread.start()

    @forwards_to_send_payload
    def _send(self, batch: EventBatch, payload: bytes) -> None:
        self._send_payload(batch.seq, len(batch.events), payload)

    def _send_payload(self, seq: int, count: int, payload: bytes) -> None:
        """Keep the batch for replay and publish ``[topic, seq, payload]`` (under the
        publisher's lock, in seq order)."""
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self.topic, seq_to_bytes(seq), payload), copy=False)

    def _close_transport(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
        self._pub.close()
        self._release_own_context()

    def _release_own_context(self) -> None:
        """Stop the ZAP authenticator and end the context of a ``curve_clients`` publisher."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx is not None:
            self._own_ctx.term()  # waits for the PUB's linger (its sockets are closed first)
            self._own_ctx = None

    @property
    def curve_public_key(self) -> bytes | None:
        """Our CURVE public key (Z85), or ``None`` with CURVE off."""
        return None if self._curve is None else self._curve.public

    def buffered_seqs(self) -> list[int]:
        """Seqs currently held for replay, oldest first."""
        with self._buffer_lock:
            return [seq for seq, _ in self._buffer]

    def replay_stats(self) -> dict[str, int]:
        """Counters of the replay server (keys :data:`REPLAY_COUNTERS`): ``requests``
        received, ``served`` (answers completed), ``malformed``, ``refused_busy`` (the client's
        previous answer was still in progress: dropped unanswered), ``refused_peer_rate`` /
        ``refused_total_rate`` / ``refused_active`` (answered with the end marker only),
        ``truncated`` (cut at ``replay_max_bytes``), ``stalled`` (abandoned: the client did
        not read for ``replay_stall_s``), ``unreachable`` (the client left mid-answer),
        ``recycles`` (the ROUTER was rebound after ``replay_max_stalled`` abandoned answers)."""
        return dict(self._replay_counts)

    def _make_router(self, endpoint: str) -> tuple[zmq.Socket, str]:
        """A bound replay ROUTER socket and the endpoint it is bound to.

        Raises:
            TransportError: the endpoint cannot be bound.
        """
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # Bounded queue per client; answers are paced to it (sent as the client reads).
        # MANDATORY: a full queue makes a non-blocking send fail (EAGAIN) instead of
        # ZMQ dropping the message silently, and a gone client fails (EHOSTUNREACH).
        router.setsockopt(zmq.SNDHWM, self.config.replay_hwm)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, 1024)  # requests are a few bytes; bigger ones disconnect
        if self._curve is not None:
            configure_server(router, self._curve)
        return router, _bind(router, endpoint, "ROUTER", self._bind_retry_s)

    def _serve_replay(self, router: zmq.Socket) -> None:
        jobs: dict[bytes, _ReplayJob] = {}  # client identity -> its answer in progress
        peers: dict[bytes, _Bucket] = {}  # insertion order = least recently seen first
        owners: dict[str, _ReplayPeer] = {}  # peer address (+ key) -> its state, least recent first
        total = _Bucket(self.config.replay_total_rate, time.monotonic())
        suspects = _Bucket(self.config.replay_suspect_rate, time.monotonic())
        busy = False
        try:
            while not self._stop.is_set():
                if self._stalled_since_recycle >= self.config.replay_max_stalled:
                    # ZMQ frees what it queued for a client only when its connection closes,
                    # and a ROUTER cannot close one connection: start a new socket instead.
                    logger.warning("replay server of %s: %d answers abandoned, rebinding %s to free what their "
                                   "clients left unread (%d answers in progress dropped)", self.source,
                                   self._stalled_since_recycle, self.replay_endpoint, len(jobs))
                    router.close(linger=0)
                    router = None  # type: ignore[assignment]
                    self._replay_counts["recycles"] += 1
                    self._stalled_since_recycle = 0
                    for job in jobs.values():
                        job.peer.active -= 1
                    jobs.clear()
                    router, _ = self._make_router(self.replay_endpoint)  # type: ignore[arg-type]
                timeout = _POLL_MS if not jobs else (0 if busy else _REPLAY_WAIT_MS)
                if router.poll(timeout):
                    for _ in range(1000):
                        try:
                            msg = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.replay_requests += 1
                        self._replay_counts["requests"] += 1
                        self._on_request(router, [f.bytes for f in msg], jobs, peers, total, _peer_key(msg[0]),
                                         owners, suspects)
                busy = self._pump(router, jobs)
        except Exception:  # noqa: BLE001 - keep the publisher alive; replay is best effort
            logger.exception("replay server of %s stopped", self.source)
        finally:
            if router is not None:
                router.close(linger=0)

    def _on_request(self, router: zmq.Socket, frames: list[bytes], jobs: dict[bytes, _ReplayJob],
                    peers: dict[bytes, _Bucket], total: _Bucket, peer_key: str | None = None,
                    owners: dict[str, _ReplayPeer] | None = None, suspects: _Bucket | None = None) -> None:
        # [identity, b"", start] from a DEALER that adds the delimiter (our subscriber, vLLM's
        # documented client); [identity, start] from one that does not.
        count = self._replay_counts
        identity, rest = frames[0], frames[1:]
        envelope = [identity]
        if rest and rest[0] == b"":
            envelope.append(b"")
            rest = rest[1:]
        if identity in jobs:
            count["refused_busy"] += 1  # an answer to it is in progress: a second one would double its queue
            return
        if len(rest) != 1 or len(rest[0]) != SEQ_BYTES:
            count["malformed"] += 1
            logger.warning("replay server of %s: malformed request of %d frames", self.source, len(rest))
            self._send_end(router, envelope)
            return
        now = time.monotonic()
        peer = peers.pop(identity, None) or _Bucket(self.config.replay_peer_rate, now)
        peers[identity] = peer
        if len(peers) > _REPLAY_PEERS:
            del peers[next(iter(peers))]
        cfg = self.config
        owners = {} if owners is None else owners
        owner = owners.pop(peer_key or identity.hex(), None) or _ReplayPeer()
        owners[peer_key or identity.hex()] = owner
        if len(owners) > _REPLAY_PEERS:
            del owners[next(iter(owners))]  # (its answers in progress keep their reference)
        suspect = owner.suspect_until > now
        pool = suspects if suspect and suspects is not None else total
        refused = ("refused_peer_rate" if not peer.ready(now) else "refused_total_rate" if not pool.ready(now)
                   else None)
        # a peer at its limit may replace one of its own answers it does not read (on
        # loopback every local client is one peer: a reading one must not be kept out by
        # the others'); slots kept for peers that read: a reading peer takes the slot of
        # the answer idle longest, a peer that does not read only a free slot outside the
        # kept ones, or one of another such peer that it does not read either
        if (refused is None and owner.active >= (1 if suspect else cfg.replay_peer_active)
                and not self._preempt(jobs, now, lambda job: job.peer is owner)):
            refused = "refused_peer_active"
        if (refused is None and len(jobs) >= cfg.replay_max_active - (cfg.replay_reserved_slots if suspect else 0)
                and not self._preempt(jobs, now, (lambda job: job.peer.suspect_until > now) if suspect else None)):
            refused = "refused_active"
        if refused is not None:
            count[refused] += 1
            self._send_end(router, envelope)
            return
        peer.tokens -= 1.0
        pool.tokens -= 1.0
        start = seq_from_bytes(rest[0])
        with self._buffer_lock:
            hits = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        owner.active += 1
        jobs[identity] = _ReplayJob(envelope, hits, now, owner)

    def _preempt(self, jobs: dict[bytes, _ReplayJob], now: float,
                 among: Callable[[_ReplayJob], bool] | None = None) -> bool:
        """Abandon the answer (of those ``among`` selects; all by default) whose client has
        read nothing for longest, if at least ``replay_idle_s`` (counted ``preempted``; its
        peer is then not reading). Returns whether a slot was freed."""
        idle = [(job.since, identity) for identity, job in jobs.items()
                if now - job.since >= self.config.replay_idle_s and (among is None or among(job))]
        if not idle:
            return False
        _, identity = min(idle)
        job = jobs.pop(identity)
        self._end_job(job, "preempted", now)
        return True

    def _end_job(self, job: _ReplayJob, how: str, now: float) -> None:
        """Account for an answer that ended ``how`` (already removed from the jobs): a peer
        that stopped reading (``stalled``, ``preempted``, or gone after ``replay_idle_s``
        without reading) is not reading for ``replay_penalty_s``; what ZMQ still holds for
        an abandoned one counts towards the next recycle."""
        cfg = self.config
        job.peer.active -= 1
        if how in ("stalled", "preempted") or (how == "unreachable" and now - job.since >= cfg.replay_idle_s):
            job.peer.suspect_until = now + cfg.replay_penalty_s
        if how in ("stalled", "preempted"):
            self._replay_counts[how] += 1
            self._stalled_since_recycle += 1

    def _send_end(self, router: zmq.Socket, envelope: list[bytes]) -> bool:
        """Send the end marker without waiting; ``False`` if the client's queue is full or it left."""
        try:
            router.send_multipart([*envelope, self.topic, END_SEQ, b""], zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN (queue full) or EHOSTUNREACH (gone): nothing to wait for
            return False
        return True

    def _pump(self, router: zmq.Socket, jobs: dict[bytes, _ReplayJob]) -> bool:
        """Send the next messages of every answer in progress, as far as each client's queue
        takes them; end, cut or abandon answers. Returns whether any answer moved on."""
        cfg = self.config
        count = self._replay_counts
        moved = False
        now = time.monotonic()
        for identity, job in list(jobs.items()):
            done = None
            for _ in range(_REPLAY_CHUNK):
                if job.pos == len(job.hits) or (job.sent_bytes and job.sent_bytes + len(job.hits[job.pos][1])
                                                > cfg.replay_max_bytes):
                    end = "served" if job.pos == len(job.hits) else "truncated"
                    # counted before the end marker leaves: a client that has read the marker
                    # then finds the answer in replay_stats(), never a count behind it
                    count[end] += 1
                    if self._send_end(router, job.envelope):
                        done = end
                    else:
                        count[end] -= 1
                    break
                seq, payload = job.hits[job.pos]
                try:
                    router.send_multipart([*job.envelope, self.topic, seq_to_bytes(seq), payload],
                                          zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break  # its queue is full: the client has not read yet
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EHOSTUNREACH:
                        raise
                    done = "unreachable"
                    break
                job.pos += 1
                job.sent_bytes += len(payload)
                job.since = now
                moved = True
            if done is None and now - job.since >= cfg.replay_stall_s:
                done = "stalled"
                logger.warning("replay server of %s: abandoned an answer after %d batches (client not reading "
                               "for %.3g s)", self.source, job.pos, cfg.replay_stall_s)
            if done is not None:
                if done == "unreachable":  # served / truncated are counted above, stalled by _end_job
                    count[done] += 1
                del jobs[identity]
                self._end_job(job, done, now)
        return moved


def _peer_key(frame: zmq.Frame) -> str | None:
    """Who sent ``frame`` across reconnections: its network address (``Peer-Address``), and
    its CURVE key (``User-Id``, set by a ZAP handler) when there is one; ``None`` when the
    transport reports no address (then each connection is a peer of its own)."""
    try:
        addr = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    try:
        return f"{addr} {frame.get('User-Id')}"
    except zmq.ZMQError:
        return str(addr)


class ZmqSubscriber(Subscriber):
    """Subscribes to one or more ZMQ publishers, with gap recovery through their replay sockets.

    Args:
        endpoints: ``(pub_endpoint, replay_endpoint | None)`` pairs; one SUB connects to each.
        topic: topic prefix to subscribe to (``b""`` = everything).
        on_gap, queue_capacity, on_resync: see :class:`Subscriber`.
        replay_timeout_s: inactivity timeout of a replay, seconds: a replay gives up when no
            reply frame came for this long (each reply moves the deadline forward, so a long
            answer from a publisher that keeps sending is never cut); the batches still
            missing then count as unrecovered. URL parameter ``replay_timeout``.
        catch_up: right after connecting, ask every replay socket for all it still buffers
            and deliver that first (a subscriber that joins after the last batch was sent
            would otherwise never see a later batch revealing the gap). Batches seen again
            live are dropped as duplicates.
        catch_up_timeout_s: inactivity timeout of that catch-up, seconds: it stops once no
            answer came for this long (a publisher that is not up yet simply has nothing to
            catch up on; one that keeps answering is waited for).
        idle_probe_s: after this many seconds without a message, ask every replay socket
            for anything past what was delivered (0 disables): a lost *last* batch, or a
            publisher that bound after this subscriber connected and then went quiet, is
            otherwise never revealed by a later batch.
        context: ZMQ context (the process-wide one by default).
        max_recovering: sources of one endpoint whose gap is being fetched at once
            (default :data:`MAX_RECOVERING`). Gap recovery is asynchronous: the receiver
            thread sends the replay request and keeps delivering the other sources while
            the answer comes; a gap found while this many sources of the same endpoint are
            already in recovery is not fetched (its seqs count as unrecovered,
            ``recoveries_refused`` + 1). Per endpoint, so that one publisher forging
            sources cannot take the recovery of the others.
        max_parked: batches of one source held back while its gap is being fetched
            (default :data:`MAX_PARKED`); further ones are dropped and counted in
            ``parked_dropped`` (the hole they leave is a new gap, recovered in turn).
        curve: per endpoint pair, a :class:`~event_plane.curve.CurveClient` (our keys and
            the publisher's public key: the SUB and replay DEALERs connect with CURVE) or
            ``None`` (plain); one value applies to every pair. URL parameters
            ``curve_server_key`` / ``curve_secret`` (:mod:`event_plane.urls`).

    Each pair is an origin (:func:`event_plane.origins.zmq_origin`: its PUB endpoint and,
    with CURVE, the publisher's key) for :meth:`Subscriber.guard_origins`.

    Raises:
        ConfigError: no endpoints, a non-positive limit, or ``curve`` of the wrong length.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, str | None]],
        topic: bytes = b"",
        *,
        on_gap: GapCallback | None = None,
        queue_capacity: int = 100_000,
        replay_timeout_s: float = 2.0,
        context: zmq.Context | None = None,
        on_resync: ResyncCallback | None = None,
        catch_up: bool = True,
        catch_up_timeout_s: float = 0.5,
        idle_probe_s: float = 1.0,
        max_recovering: int = MAX_RECOVERING,
        max_parked: int = MAX_PARKED,
        curve: CurveClient | Sequence[CurveClient | None] | None = None,
    ) -> None:
        super().__init__(on_gap=on_gap, queue_capacity=queue_capacity, on_resync=on_resync)
        for name, value in (("replay_timeout_s", replay_timeout_s), ("catch_up_timeout_s", catch_up_timeout_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")
        for name, limit in (("max_recovering", max_recovering), ("max_parked", max_parked)):
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ConfigError(f"{name} must be a positive int, got {limit!r}")
        self._max_recovering = max_recovering
        self._max_parked = max_parked
        self._recovering: dict[str, _Recovery] = {}  # source -> its gap being fetched
        self._poller: zmq.Poller | None = None
        self._catch_up = catch_up
        self._catch_up_timeout_s = catch_up_timeout_s
        self._idle_probe_s = idle_probe_s
        self._sources_at: dict[int, dict[str, None]] = {}  # per endpoint, least recently seen first
        if not endpoints:
            raise ConfigError("ZmqSubscriber needs at least one (pub_endpoint, replay_endpoint) pair")
        self._endpoints = [(str(p), None if r is None else str(r)) for p, r in endpoints]
        if curve is None or isinstance(curve, CurveClient):
            self._curve: list[CurveClient | None] = [curve] * len(self._endpoints)
        else:
            self._curve = list(curve)
            if len(self._curve) != len(self._endpoints):
                raise ConfigError(f"curve has {len(self._curve)} entries for {len(self._endpoints)} endpoint pairs")
        self._origin = [zmq_origin(p, None if c is None else c.server_key)
                        for (p, _), c in zip(self._endpoints, self._curve)]
        self._topic = bytes(topic)
        self._replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvevents-zmq-sub", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise TransportError(f"cannot connect ZMQ subscriber: {self._error}") from self._error

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def alive(self) -> bool:
        t = self._thread
        return super().alive and (t is None or t.is_alive())

    def _run(self) -> None:
        subs: list[zmq.Socket] = []
        try:
            poller = zmq.Poller()
            for pub_ep, _ in self._endpoints:
                sock = self._ctx.socket(zmq.SUB)
                subs.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, _PUB_HWM)
                self._limit_size(sock)
                sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                self._connect(sock, len(subs) - 1, pub_ep)
                poller.register(sock, zmq.POLLIN)
        except Exception as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            for sock in subs:
                sock.close(linger=0)
            self._ready.set()
            return
        index = {sock: i for i, sock in enumerate(subs)}
        # libzmq drops a connection whose peer sent a message over MAXMSGSIZE and does not
        # reconnect after such a protocol error: watch for disconnects and connect again
        monitors: dict[zmq.Socket, int] = {}
        for i, sock in enumerate(subs):
            mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            monitors[mon] = i
            poller.register(mon, zmq.POLLIN)
        self._poller = poller
        try:
            if self._catch_up:
                self._catch_up_all()
        finally:
            self._ready.set()
        try:
            last_seen = time.monotonic()
            while not self._closed.is_set():
                try:
                    ready = poller.poll(self._poll_ms())
                    for sock, _ in ready:
                        if sock in monitors:
                            self._reconnect(sock, subs[monitors[sock]], monitors[sock])
                            continue
                        rec = self._by_dealer(sock)
                        if rec is None and sock not in index:
                            continue  # a recovery socket closed earlier in this round
                        for _ in range(1000):  # drain, but keep polling the others fairly
                            if rec is not None and self._recovering.get(rec.source) is not rec:
                                break  # finished while draining (its dealer is closed)
                            try:
                                frames = sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            if rec is None:
                                self._on_message(index[sock], frames)
                            else:
                                self._on_recovery_reply(rec, frames)
                    self._expire_recoveries()
                    now = time.monotonic()
                    if ready:
                        last_seen = now
                    elif self._idle_probe_s and now - last_seen >= self._idle_probe_s:
                        # Quiet line: a lost *last* batch is revealed by no later one, so ask
                        # the replay sockets for anything past what was delivered.
                        self._catch_up_all(self._probe_starts())
                        last_seen = time.monotonic()
                    self.failing = None
                except Exception as exc:  # noqa: BLE001 - the receiver thread must outlive any one error
                    # (out of sockets or file descriptors, a broken recovery socket...): log,
                    # report it (health) and go on after a pause
                    self.failing = f"{type(exc).__name__}: {exc}"
                    self._stats.receive_errors += 1
                    logger.exception("ZMQ subscriber: receive loop failed; retrying in %.1f s", _RETRY_S)
                    self._closed.wait(_RETRY_S)
        finally:
            for mon, i in monitors.items():
                subs[i].disable_monitor()
                mon.close(linger=0)
            for sock in subs:
                sock.close(linger=0)
            for rec in self._recovering.values():
                rec.dealer.close(linger=0)
            self._recovering.clear()
            self._poller = None

    def _reconnect(self, monitor: zmq.Socket, sock: zmq.Socket, i: int) -> None:
        """Read the disconnect events of pair ``i``'s SUB and connect it again (libzmq
        reconnects by itself after a network error, but not after a protocol error such
        as a message over ``MAXMSGSIZE``)."""
        n = 0
        while True:
            try:
                monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
        if not n or self._closed.is_set():
            return
        self._stats.reconnects += 1
        endpoint = self._endpoints[i][0]
        try:
            sock.disconnect(endpoint)
        except zmq.ZMQError:
            pass  # already gone
        self._connect(sock, i, endpoint)

    def _limit_size(self, sock: zmq.Socket) -> None:
        """``MAXMSGSIZE`` of a receiving socket (:meth:`Subscriber.limit_batches`, else
        :data:`DEFAULT_MAX_MESSAGE_BYTES`): libzmq drops a bigger message unread and
        disconnects its sender."""
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_bytes or DEFAULT_MAX_MESSAGE_BYTES)

    def _connect(self, sock: zmq.Socket, i: int, endpoint: str) -> None:
        """Connect ``sock`` to ``endpoint`` of pair ``i``, as a CURVE client when pair ``i`` has CURVE."""
        curve = self._curve[i]
        if curve is not None:
            configure_client(sock, curve.keys, curve.server_key)
        sock.connect(endpoint)

    def _decode(self, seq: int, payload: bytes, *, live: bool) -> EventBatch:
        """Turn one message payload (seq from its seq frame) into a batch.

        ``live`` is ``True`` for PUB messages and ``False`` for replay answers. Adapters of
        other wire formats override this (``event_plane.adapters``).

        Raises:
            CodecError: the payload is malformed, or its seq differs from the seq frame
                (a frame that lies about its batch must not move the source's position).
        """
        batch = decode_batch(payload, self._max_events)
        if batch.seq != seq:
            raise CodecError(f"seq frame {seq} does not match the batch's seq {batch.seq}")
        return batch

    def _on_message(self, i: int, frames: list[bytes]) -> None:
        self._answered.set()
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self._stats.decode_errors += 1
            return
        try:
            batch = self._decode(seq_from_bytes(frames[1]), frames[2], live=True)
        except CodecError:
            self._stats.decode_errors += 1
            return
        self._admit(i, batch)

    # ------------------------------------------------------------ asynchronous gap recovery
    def _admit(self, i: int, batch: EventBatch, replayed: bool = False) -> None:
        """Take one decoded batch from endpoint ``i`` (``replayed``: from a catch-up answer):
        park it behind its source's recovery in progress, or hand it on (:meth:`_feed`)."""
        if not self._origin_admits(batch, self._origin[i]):
            return
        self._lane = self._origin[i]  # its lane in the fair delivery queue
        seen = self._sources_at.setdefault(i, {})
        seen.pop(batch.source, None)
        seen[batch.source] = None
        if len(seen) > MAX_PROBE_SOURCES:
            del seen[next(iter(seen))]
        rec = self._recovering.get(batch.source)
        if rec is None:
            self._feed(i, batch, replayed)
        elif len(rec.parked) < self._max_parked:
            rec.parked.append((i, batch, replayed))
        else:
            self._stats.parked_dropped += 1

    def _feed(self, i: int, batch: EventBatch, replayed: bool) -> None:
        """Deliver ``batch`` through the tracker, or, when it reveals a gap that endpoint
        ``i`` can replay, send the replay request and park the batch until the answer."""
        if self._endpoints[i][1] is not None and self._tracker.pending_gap(batch) is not None:
            busy = sum(rec.i == i for rec in self._recovering.values())
            if busy < self._max_recovering:
                self._start_recovery(i, batch, replayed)
                return
            self._stats.recoveries_refused += 1
            logger.warning("gap of %s not fetched: %d sources of %s already in recovery", batch.source, busy,
                           self._endpoints[i][1])
        self._accept(batch, replayed, None)

    def _accept(self, batch: EventBatch, replayed: bool, fetched: list[EventBatch] | None) -> None:
        st = self._stats
        dup = st.duplicates
        self._tracker.accept(batch, None if fetched is None else (lambda *_: fetched))
        if replayed:
            st.replayed += st.duplicates == dup  # delivered from the replay buffer

    def _start_recovery(self, i: int, batch: EventBatch, replayed: bool) -> None:
        gap = self._tracker.pending_gap(batch)
        assert gap is not None and self._poller is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        self._limit_size(dealer)
        self._connect(dealer, i, self._endpoints[i][1])  # type: ignore[arg-type]
        dealer.send_multipart([b"", seq_to_bytes(gap[0])])
        now = time.monotonic()
        rec = _Recovery(i, batch.source, batch.epoch, gap[0], gap[1], dealer, now + self._replay_timeout_s,
                        now + max(RECOVERY_MAX_S, self._replay_timeout_s))
        rec.parked.append((i, batch, replayed))
        self._recovering[batch.source] = rec
        self._poller.register(dealer, zmq.POLLIN)

    def _by_dealer(self, sock: zmq.Socket) -> _Recovery | None:
        for rec in self._recovering.values():
            if rec.dealer is sock:
                return rec
        return None

    def _poll_ms(self) -> int:
        """Poll timeout: the usual tick, shorter when a recovery's deadline comes first."""
        if not self._recovering:
            return _POLL_MS
        due = min(min(r.deadline, r.hard_deadline) for r in self._recovering.values())
        return max(1, min(_POLL_MS, int((due - time.monotonic()) * 1000) + 1))

    def _on_recovery_reply(self, rec: _Recovery, frames: list[bytes]) -> None:
        rec.deadline = time.monotonic() + self._replay_timeout_s  # inactivity, not a total
        reply = self._parse_reply(frames)
        if reply is None:
            return
        if reply is _END:
            self._finish_recovery(rec)
            return
        seq, payload = reply  # type: ignore[misc]
        if seq > rec.last:  # answers come oldest first: the range is complete
            self._finish_recovery(rec)
            return
        if seq < rec.first:
            return
        try:
            rec.got.append(self._decode(seq, payload, live=False))
        except CodecError:
            self._stats.decode_errors += 1

    def _expire_recoveries(self) -> None:
        now = time.monotonic()
        for rec in [r for r in self._recovering.values() if now >= min(r.deadline, r.hard_deadline)]:
            logger.warning("replay from %s for %s timed out after %d batches (%s)", self._endpoints[rec.i][1],
                           rec.source, len(rec.got), "no answer for %.3g s" % self._replay_timeout_s
                           if now >= rec.deadline else "longer than %.3g s in all" % RECOVERY_MAX_S)
            self._finish_recovery(rec)

    def _finish_recovery(self, rec: _Recovery) -> None:
        """Close the recovery's socket, deliver what it fetched, then the parked batches in
        arrival order (one of them may reveal a new gap and start a new recovery)."""
        assert self._poller is not None
        self._poller.unregister(rec.dealer)
        rec.dealer.close(linger=0)
        del self._recovering[rec.source]
        _, revealing, replayed = rec.parked.popleft()
        self._lane = self._origin[rec.i]
        self._accept(revealing, replayed, rec.got)
        for i, batch, replayed in rec.parked:
            self._admit(i, batch, replayed)

    def _parse_reply(self, frames: list[bytes]) -> tuple[int, bytes] | object | None:
        """One replay answer: ``(seq, payload)``, ``_END`` for the end marker, ``None`` if malformed.

        Accepts ``[topic, seq, payload]`` (vLLM >= 0.26, ours) and ``[seq, payload]`` (older
        peers), with or without the leading empty delimiter frame.
        """
        self._answered.set()
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:
            seq_frame, payload = frames[1], frames[2]
        elif len(frames) == 2:
            seq_frame, payload = frames
        else:
            self._stats.decode_errors += 1
            return None
        if seq_frame == END_SEQ:
            return _END
        if len(seq_frame) != SEQ_BYTES:
            self._stats.decode_errors += 1
            return None
        return seq_from_bytes(seq_frame), payload

    def _probe_starts(self) -> dict[int, int]:
        """Per endpoint, the lowest seq not yet delivered of the sources seen there (0 if none)."""
        starts: dict[int, int] = {}
        for i, (_, rep) in enumerate(self._endpoints):
            if rep is None:
                continue
            seqs = [pos[1] for src in self._sources_at.get(i, ()) if (pos := self._tracker.position(src)) is not None]
            starts[i] = min(seqs) if seqs else 0
        return starts

    def _catch_up_all(self, starts: dict[int, int] | None = None) -> None:
        """Fetch what the publishers still buffer and deliver it, oldest first.

        Sends one replay request to every replay socket at once (from seq 0 at start-up, or
        from ``starts[i]`` for endpoint ``i``) and waits for the answers until none came for
        ``catch_up_timeout_s``; runs on the receiver thread, so the tracker sees these batches in order
        with live ones (those already delivered are dropped as duplicates). It holds that
        thread, so it also stops after :data:`PROBE_MAX_S` in all for an idle probe
        (:data:`RECOVERY_MAX_S` at start-up) even while answers keep coming; what came of an
        unfinished answer is still delivered, and the next probe asks for the rest.
        """
        hard_deadline = time.monotonic() + (RECOVERY_MAX_S if starts is None else PROBE_MAX_S)
        if starts is None:
            time.sleep(0.05)  # let the SUB subscriptions reach the publishers first
            starts = {i: 0 for i, (_, rep) in enumerate(self._endpoints) if rep is not None}
        pending: dict[zmq.Socket, tuple[int, list[EventBatch]]] = {}
        poller = zmq.Poller()
        for i, start in starts.items():
            rep = self._endpoints[i][1]
            if rep is None:
                continue
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            self._limit_size(dealer)
            self._connect(dealer, i, rep)
            dealer.send_multipart([b"", seq_to_bytes(start)])
            pending[dealer] = (i, [])
            poller.register(dealer, zmq.POLLIN)
        deadline = time.monotonic() + self._catch_up_timeout_s
        try:
            while pending:
                remaining_ms = int((min(deadline, hard_deadline) - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    for dealer, (i, got) in pending.items():
                        for batch in sorted(got, key=lambda b: (b.source, b.epoch, b.seq)):
                            self._admit(i, batch, replayed=True)
                    break
                ready = poller.poll(remaining_ms)
                if ready:  # an inactivity timeout: each answer moves the deadline forward
                    deadline = time.monotonic() + self._catch_up_timeout_s
                for dealer, _ in ready:
                    i, got = pending[dealer]
                    reply = self._parse_reply(dealer.recv_multipart())
                    if reply is None:
                        continue
                    if reply is _END:
                        for batch in sorted(got, key=lambda b: (b.source, b.epoch, b.seq)):
                            self._admit(i, batch, replayed=True)
                        poller.unregister(dealer)
                        dealer.close(linger=0)
                        del pending[dealer]
                        continue
                    seq, payload = reply
                    try:
                        got.append(self._decode(seq, payload, live=False))
                    except CodecError:
                        self._stats.decode_errors += 1
        finally:
            for dealer in pending:
                dealer.close(linger=0)
