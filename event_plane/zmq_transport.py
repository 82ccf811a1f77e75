"""ZMQ transport: PUB + ROUTER replay on the publisher, SUB + DEALER on the subscriber.

Frames are described in :mod:`event_plane.frames`. pyzmq sockets are not thread-safe:
the PUB socket is only used under the publisher's lock, the ROUTER only by its replay
thread, and every subscriber socket only by the subscriber's receiver thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from functools import partial

import zmq
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed

from event_plane.codec import CodecError, decode_batch
from event_plane.config import PublisherConfig
from event_plane.errors import ConfigError, TransportError
from event_plane.frames import END_SEQ, SEQ_BYTES, seq_from_bytes, seq_to_bytes
from event_plane.ordering import GapCallback
from event_plane.publisher import EventPublisher, FlushCallback, forwards_to_send_payload
from event_plane.schema import EventBatch
from event_plane.subscriber import ResyncCallback, Subscriber

logger = logging.getLogger(__name__)

_POLL_MS = 50
_END = object()  # end-of-replay marker returned by ZmqSubscriber._parse_reply
_PUB_HWM = 100_000  # messages queued per subscriber before ZMQ drops (ZMQ's own policy)


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

    Attributes:
        endpoint / replay_endpoint: the addresses actually bound (resolved wildcards).

    Raises:
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
    ) -> None:
        super().__init__(source, epoch=epoch, config=config, on_flush=on_flush)
        self.topic: bytes = topic.encode()
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self.endpoint: str = _bind(self._pub, endpoint, "PUB", bind_retry_s)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.replay_buffer)
        self._buffer_lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._replay_thread: threading.Thread | None = None
        self.replay_requests = 0
        if replay_endpoint is not None:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)  # a reply of the whole buffer must not be cut
            try:
                self.replay_endpoint = _bind(router, replay_endpoint, "ROUTER", bind_retry_s)
            except TransportError:
                self._pub.close(linger=0)
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

    def buffered_seqs(self) -> list[int]:
        """Seqs currently held for replay, oldest first."""
        with self._buffer_lock:
            return [seq for seq, _ in self._buffer]

    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(_POLL_MS):
                    continue
                frames = router.recv_multipart()
                self.replay_requests += 1
                self._answer(router, frames)
        except Exception:  # noqa: BLE001 - keep the publisher alive; replay is best effort
            logger.exception("replay server of %s stopped", self.source)
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket, frames: list[bytes]) -> None:
        # [identity, b"", start] from a DEALER that adds the delimiter (our subscriber, vLLM's
        # documented client); [identity, start] from one that does not.
        identity, rest = frames[0], frames[1:]
        envelope = [identity]
        if rest and rest[0] == b"":
            envelope.append(b"")
            rest = rest[1:]
        if len(rest) == 1 and len(rest[0]) == SEQ_BYTES:
            start = seq_from_bytes(rest[0])
            with self._buffer_lock:
                hits = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in hits:
                router.send_multipart([*envelope, self.topic, seq_to_bytes(seq), payload], copy=False)
        else:
            logger.warning("replay server of %s: malformed request of %d frames", self.source, len(rest))
        router.send_multipart([*envelope, self.topic, END_SEQ, b""])


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

    Raises:
        ConfigError: no endpoints.
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
    ) -> None:
        super().__init__(on_gap=on_gap, queue_capacity=queue_capacity, on_resync=on_resync)
        for name, value in (("replay_timeout_s", replay_timeout_s), ("catch_up_timeout_s", catch_up_timeout_s)):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")
        self._catch_up = catch_up
        self._catch_up_timeout_s = catch_up_timeout_s
        self._idle_probe_s = idle_probe_s
        self._sources_at: dict[int, set[str]] = {}
        if not endpoints:
            raise ConfigError("ZmqSubscriber needs at least one (pub_endpoint, replay_endpoint) pair")
        self._endpoints = [(str(p), None if r is None else str(r)) for p, r in endpoints]
        self._topic = bytes(topic)
        self._replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._dealers: dict[int, zmq.Socket] = {}

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

    def _run(self) -> None:
        subs: list[zmq.Socket] = []
        try:
            poller = zmq.Poller()
            for pub_ep, _ in self._endpoints:
                sock = self._ctx.socket(zmq.SUB)
                subs.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, _PUB_HWM)
                sock.setsockopt(zmq.SUBSCRIBE, self._topic)
                sock.connect(pub_ep)
                poller.register(sock, zmq.POLLIN)
        except Exception as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            for sock in subs:
                sock.close(linger=0)
            self._ready.set()
            return
        index = {sock: i for i, sock in enumerate(subs)}
        try:
            if self._catch_up:
                self._catch_up_all()
        finally:
            self._ready.set()
        try:
            last_seen = time.monotonic()
            while not self._closed.is_set():
                ready = poller.poll(_POLL_MS)
                for sock, _ in ready:
                    for _ in range(1000):  # drain, but keep polling the others fairly
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(index[sock], frames)
                now = time.monotonic()
                if ready:
                    last_seen = now
                elif self._idle_probe_s and now - last_seen >= self._idle_probe_s:
                    # Quiet line: a lost *last* batch is revealed by no later one, so ask
                    # the replay sockets for anything past what was delivered.
                    self._catch_up_all(self._probe_starts())
                    last_seen = time.monotonic()
        finally:
            for sock in subs:
                sock.close(linger=0)
            for dealer in self._dealers.values():
                dealer.close(linger=0)
            self._dealers.clear()

    def _decode(self, seq: int, payload: bytes, *, live: bool) -> EventBatch:
        """Turn one message payload (seq from its seq frame) into a batch.

        ``live`` is ``True`` for PUB messages and ``False`` for replay answers. Adapters of
        other wire formats override this (``event_plane.adapters``).

        Raises:
            CodecError: the payload is malformed, or its seq differs from the seq frame
                (a frame that lies about its batch must not move the source's position).
        """
        batch = decode_batch(payload)
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
        self._sources_at.setdefault(i, set()).add(batch.source)
        recover = partial(self._replay, i) if self._endpoints[i][1] is not None else None
        self._tracker.accept(batch, recover)

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
        with live ones (those already delivered are dropped as duplicates).
        """
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
            dealer.connect(rep)
            dealer.send_multipart([b"", seq_to_bytes(start)])
            pending[dealer] = (i, [])
            poller.register(dealer, zmq.POLLIN)
        deadline = time.monotonic() + self._catch_up_timeout_s
        try:
            while pending:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
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
                        recover = partial(self._replay, i)
                        st = self._stats
                        for batch in sorted(got, key=lambda b: (b.source, b.epoch, b.seq)):
                            self._sources_at.setdefault(i, set()).add(batch.source)
                            dup = st.duplicates
                            self._tracker.accept(batch, recover)
                            st.replayed += st.duplicates == dup  # delivered from the replay buffer
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

    def _replay(self, i: int, source: str, epoch: int, first: int, last: int) -> list[EventBatch]:
        """Ask endpoint ``i``'s ROUTER for seqs ``first..last``; runs on the receiver thread."""
        dealer = self._dealers.get(i)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.connect(self._endpoints[i][1])  # type: ignore[arg-type]
            self._dealers[i] = dealer
        dealer.send_multipart([b"", seq_to_bytes(first)])
        deadline = time.monotonic() + self._replay_timeout_s
        out: list[EventBatch] = []
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                # No end marker: drop the socket so a late answer cannot pollute the next one.
                logger.warning("replay from %s timed out after %d batches (nothing for %.3g s)",
                               self._endpoints[i][1], len(out), self._replay_timeout_s)
                dealer.close(linger=0)
                del self._dealers[i]
                return out
            deadline = time.monotonic() + self._replay_timeout_s  # inactivity, not a total
            reply = self._parse_reply(dealer.recv_multipart())
            if reply is None:
                continue
            if reply is _END:
                return out
            seq, payload = reply
            if not first <= seq <= last:
                continue
            try:
                out.append(self._decode(seq, payload, live=False))
            except CodecError:
                self._stats.decode_errors += 1
