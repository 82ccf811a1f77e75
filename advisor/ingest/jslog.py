"""The JetStream stream as the advisor's log (scaled mode, docs/design.md §7-§8).

In scaled mode the ``KVADVISOR_EVENTS`` stream *is* the journal: the log position is the
stream sequence of a batch.  :class:`JetStreamLog` reads a namespace's batches from a
given stream sequence through an ephemeral pull consumer (explicit acks, removed by the
server after ``inactive_threshold_s`` without a reader) and hands out
``(stream sequence, wire bytes)`` pairs in stream order.  Nothing is consumed for
others: each advisor start reads from its snapshot's position + 1.

``event_plane.JetStreamSubscriber`` hands out decoded batches without their stream
sequence, so the advisor reads the stream itself (same stream, subjects and wire
format as ``event_plane.nats_transport``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from nats.js import api as js_api
from nats.js.errors import NotFoundError

from event_plane.config import StreamLimits
from event_plane.errors import ConfigError, StreamMismatchError
from event_plane.nats_auth import redact_url
from event_plane.nats_transport import STREAM_NAME, SUBJECT_PREFIX, connect_nats, ensure_stream, fetch_forever, subject_for

logger = logging.getLogger(__name__)


class JetStreamLogError(RuntimeError):
    """The stream cannot be reached or read."""


class JetStreamLog:
    """Reads ``kvadvisor.events.<namespace>.>`` from the stream, from ``start_seq`` on.

    Args:
        url: NATS server URL.
        namespace: subject namespace (one token).
        start_seq: first stream sequence to deliver (>= 1).
        batch_size: messages per pull.
        queue_capacity: entries buffered before the reader waits (back-pressure).
        connect_timeout_s: seconds allowed to connect.
        inactive_threshold_s: the server removes the consumer after this long unread.
        stream: the stream's limits, used when this log creates the stream and checked
            against an existing one (``event_plane.StreamLimits``; ``None`` = defaults).
        keep_subjects: remember each entry's subject until :meth:`subject_of` takes it
            (the origin of a batch: ``kvadvisor.events.<namespace>.<source>``).
        ack_wait_s: seconds the server waits for an entry's acknowledgement before it
            delivers the entry again (JetStream ``ack_wait``).
        placement_wait_s: seconds to spend making the consumer again until its server
            holds a current copy of the stream (``_consumer``).
        durable: read through a durable consumer of this name (scaled mode: one per
            partition, so the server tracks what the owner acknowledged) instead of an
            ephemeral one.  The fold state lives in the snapshot, so a start always
            reads from ``start_seq``: an existing consumer of that name (a previous
            owner's) is deleted and created again from there.
        **connect_options: ``nats.connect`` keywords (credentials, TLS: see
            ``event_plane.urls.nats_connection``).

    When the stream already deleted entries from ``start_seq`` on (its limits), the log
    starts at the stream's first sequence: :attr:`discarded` says how many entries were
    lost (also logged as a warning).

    Entries come out once each, in stream order, none skipped.  JetStream delivers an entry
    again when its acknowledgement is lost (a server failing over, a slow network) after
    ``ack_wait_s``, by then behind newer entries; such a redelivery is acknowledged and
    dropped (:attr:`redelivered`), since folding an old Store after its Remove would bring
    a removed block back.  Deliveries lost in transit (a fetch answer lost in a fail-over)
    show as a jump in the consumer's delivery sequence: the log then reads again from the
    first entry it has not handed out (:attr:`resets`), the way JetStream's ordered
    consumers recover, instead of going on with the newer entries and getting the lost
    ones after ``ack_wait_s``, out of order.  The first delivery of each consumer the log
    makes must be delivery 1, so a lost first one counts too.  Every jump counts, a jump onto a redelivery
    included (a lost acknowledgement and a lost delivery in one fail-over): only the
    delivery sequence shows that something was missed.

    Raises:
        ConfigError: bad namespace or stream limits.
    """

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        start_seq: int = 1,
        batch_size: int = 256,
        queue_capacity: int = 10_000,
        connect_timeout_s: float = 5.0,
        inactive_threshold_s: float = 60.0,
        ack_wait_s: float = 30.0,
        placement_wait_s: float = 10.0,
        stream: StreamLimits | None = None,
        durable: str | None = None,
        keep_subjects: bool = False,
        **connect_options: Any,
    ) -> None:
        subject_for(namespace, "x")  # validates the namespace token
        if stream is not None and not isinstance(stream, StreamLimits):
            raise ConfigError(f"stream must be a StreamLimits, got {type(stream).__name__}")
        self.stream_limits = stream if stream is not None else StreamLimits()
        self.discarded = 0
        if start_seq < 1:
            raise JetStreamLogError(f"start_seq must be >= 1, got {start_seq}")
        self.url = url
        self.subject = f"{SUBJECT_PREFIX}.{namespace}.>"
        self.start_seq = start_seq
        self._batch_size = batch_size
        self._connect_timeout_s = connect_timeout_s
        self._connect_options = connect_options
        self._inactive_s = inactive_threshold_s
        self._ack_wait_s = ack_wait_s
        self._last_seq = 0  # highest stream sequence handed out
        self.redelivered = 0  # entries delivered again by the server and dropped
        self.resets = 0  # times deliveries were lost in transit and the log read again from there
        self._placement_wait_s = placement_wait_s
        self.replaced = 0  # consumers made again because their leader was not the stream's
        self.misplaced = 0  # consumers kept on another server (placement_wait_s ran out)
        self._queue: queue.Queue[tuple[int, bytes]] = queue.Queue(maxsize=queue_capacity)
        self.subjects: dict[int, str] = {}  # stream seq -> subject, kept only with keep_subjects
        self._closed = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: Any = None
        self._js: Any = None
        self._task: Any = None
        self._psub: Any = None  # the pull subscription reading now (made again after a gap)
        self._durable = durable
        self._keep_subjects = keep_subjects
        self.pending_at_start = 0  # entries of this namespace the stream held past start_seq at start()

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> None:
        """Connect, make sure the stream exists and start reading.

        Raises:
            StreamMismatchError: ``stream.strict`` and the existing stream differs.
            JetStreamLogError: the server cannot be reached or refuses the consumer.
        """
        if self._loop is not None:
            return
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvadvisor-jslog", daemon=True)
        self._thread.start()
        try:
            self._run(self._open(), timeout=self._connect_timeout_s + 30)
        except Exception as exc:
            self._abandon()
            if isinstance(exc, StreamMismatchError):
                raise
            raise JetStreamLogError(f"cannot read stream {STREAM_NAME} at {redact_url(self.url)}: {exc}") from exc

    async def _open(self) -> None:
        self._nc = await connect_nats(self.url, self._connect_timeout_s, self._connect_options)
        self._js = self._nc.jetstream()
        await ensure_stream(self._js, self.stream_limits, who="advisor JetStream log")
        psub = await self._consumer(self.start_seq)
        self._psub = psub
        self.pending_at_start = int((await psub.consumer_info()).num_pending or 0)
        first = int((await self._js.stream_info(STREAM_NAME)).state.first_seq or 0)
        if first > self.start_seq:
            self.discarded = first - self.start_seq
            logger.warning(
                "JetStream log: reading from stream sequence %d, but the stream (limits max_bytes / max_age) "
                "already deleted sequences %d..%d (%d entries, all namespaces): the fold misses them",
                self.start_seq, self.start_seq, first - 1, self.discarded,
            )
        self._task = asyncio.get_running_loop().create_task(self._pull(psub))

    async def _consumer(self, start_seq: int) -> Any:
        """A pull subscription delivering this namespace from stream sequence ``start_seq``
        (the durable one is deleted and created again there), served by a server whose copy
        of the stream is current.

        A consumer is served from its leader's own copy of the stream.  On a replicated
        stream that copy may still be catching up (a node just restarted), and nats-server
        2.9 then hands out what that copy holds and nothing more, without an error: seen
        here as a reader getting 300 of 3,300 events, every few reads, for seconds after a
        node restart (``tests/integration/test_jslog_placement.py``).  So the consumer is
        made again until its leader is the stream's leader (or, durable, a current replica:
        :meth:`_served_current`), for up to ``placement_wait_s``;
        after that the log goes on with a warning (counted in :attr:`misplaced`) rather than
        not at all.  (A stream leader that changes later is a fail-over: the new leader was
        current when elected.)
        """
        deadline = asyncio.get_running_loop().time() + self._placement_wait_s
        while True:
            psub = await self._new_consumer(start_seq)
            if await self._served_current(psub):
                return psub
            if asyncio.get_running_loop().time() >= deadline:
                self.misplaced += 1
                logger.warning("JetStream log: no consumer on the stream leader within %.1f s; "
                               "reading from a copy of the stream that may lag", self._placement_wait_s)
                return psub
            self.replaced += 1
            await self._drop_consumer(psub)
            await asyncio.sleep(0.1)

    async def _served_current(self, psub: Any) -> bool:
        """Whether ``psub``'s consumer leader is the stream's leader (always true on a single
        server), or, for a durable consumer, a replica the leader reports current with no
        lag.  Such a replica may still miss the newest entries (seen here: the last batch),
        so a reader that must see everything the stream holds now (``pending_at_start``, an
        ephemeral consumer) takes the leader only."""
        try:
            ci = await psub.consumer_info()
            si = await self._js.stream_info(STREAM_NAME)
        except Exception:  # noqa: BLE001 - a server failing over: not known to be current
            return False
        cluster = si.cluster
        if cluster is None or not cluster.replicas:
            return True
        leader = ci.cluster.leader if ci.cluster is not None else None
        if leader is None:
            return False
        if leader == cluster.leader:
            return True
        # a durable consumer (an owner's fold) is made again slowly (a replicated consumer
        # elects its leader): there a replica reported current with no lag will do, since an
        # entry it has not applied yet comes later, still in stream order
        return self._durable is not None and any(
            r.name == leader and bool(r.current) and not (r.lag or 0) for r in cluster.replicas)

    async def _drop_consumer(self, psub: Any) -> None:
        """Unsubscribe ``psub`` and delete its consumer (errors ignored: it may be gone)."""
        try:
            name = (await psub.consumer_info()).name
        except Exception:  # noqa: BLE001
            name = self._durable
        try:
            await psub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass
        if name:
            try:
                await self._js.delete_consumer(STREAM_NAME, name)
            except Exception:  # noqa: BLE001
                pass

    async def _new_consumer(self, start_seq: int) -> Any:
        """A pull subscription from ``start_seq`` (the durable one deleted and made again)."""
        config = js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=self._ack_wait_s,
            inactive_threshold=self._inactive_s,
        )
        if self._durable is not None:
            try:
                await self._js.delete_consumer(STREAM_NAME, self._durable)
            except NotFoundError:
                pass
            config.durable_name = self._durable
        return await self._js.pull_subscribe(self.subject, durable=self._durable, stream=STREAM_NAME, config=config)

    async def _pull(self, psub: Any) -> None:
        last_dseq = 0  # the consumer's delivery sequence of the last message taken
        while not self._closed.is_set():
            gap = False
            async for msg in fetch_forever(psub, self._batch_size, self._closed, "JetStream log"):
                seq, dseq = int(msg.metadata.sequence.stream), int(msg.metadata.sequence.consumer)
                if dseq != last_dseq + 1:
                    # A consumer made for this read (at start, or again after a gap) delivers
                    # from consumer sequence 1: its first delivery is checked too.  A first
                    # delivery lost in transit (most likely right after a fail-over, when the
                    # consumer was just made again) would otherwise let the second one through
                    # and skip the first for good (its redelivery comes behind, handed out
                    # already).  Likewise nats-py's pull_subscribe binds to a consumer of this
                    # durable name that exists already (found by its consumer info) instead of
                    # making one from ``start_seq``: a first delivery other than 1 shows it.
                    # deliveries were lost in transit (a fetch answer lost in a fail-over): the
                    # server counts them as delivered and would send them again only after
                    # their own ack_wait, behind newer entries.  Read again from the first
                    # entry not handed out, so entries come out in order and none is skipped.
                    # Any jump counts, also one onto a redelivery of an entry handed out
                    # already: the deliveries missed before it may hold new entries, and the
                    # next delivery after it would follow on without a jump.
                    gap = True
                    self.resets += 1
                    if seq <= self._last_seq:
                        self.redelivered += 1
                    logger.warning("JetStream log: deliveries %d..%d lost in transit; reading again from stream "
                                   "sequence %d", last_dseq + 1, dseq - 1, self._last_seq + 1)
                    break
                last_dseq = dseq
                if seq <= self._last_seq:  # a redelivery (its ack was lost): handed out already
                    self.redelivered += 1
                    if self.redelivered == 1 or self.redelivered % 1000 == 0:
                        logger.warning("JetStream log: entry %d delivered again after %d; dropped (%d so far)",
                                       seq, self._last_seq, self.redelivered)
                    await self._ack(msg)
                    continue
                self._last_seq = seq
                item = (seq, bytes(msg.data))
                if self._keep_subjects:
                    self.subjects[item[0]] = msg.subject
                while not self._closed.is_set():
                    try:
                        self._queue.put_nowait(item)
                        break
                    except queue.Full:
                        await asyncio.sleep(0.005)
                await self._ack(msg)
            if not gap:
                return
            while not self._closed.is_set():
                try:
                    try:
                        await psub.unsubscribe()
                    except Exception:  # noqa: BLE001 - the old subscription may be gone already
                        pass
                    psub = await self._consumer(max(self._last_seq + 1, self.start_seq))
                    self._psub = psub
                    last_dseq = 0
                    break
                except Exception as exc:  # noqa: BLE001 - a server failing over: try again shortly
                    logger.warning("JetStream log: cannot read again from %d yet: %s", self._last_seq + 1, exc)
                    await asyncio.sleep(0.2)

    async def _ack(self, msg: Any) -> None:
        """Acknowledge one entry (a separate method so a test can lose an acknowledgement)."""
        await msg.ack()

    def last_sequence(self) -> int:
        """The stream's last sequence now (0 when empty)."""
        if self._loop is None:
            raise JetStreamLogError("log not started")

        async def _info() -> int:
            info = await self._js.stream_info(STREAM_NAME)
            return int(info.state.last_seq or 0)

        try:
            return int(self._run(_info()))
        except Exception as exc:
            raise JetStreamLogError(f"stream info failed: {exc}") from exc

    @property
    def handed_out(self) -> int:
        """The highest stream sequence handed out by :meth:`get` so far (0: none)."""
        return self._last_seq

    def backlog(self, timeout: float = 5.0) -> int | None:
        """Entries of this namespace not handed out yet, as far as the server and this log
        know: what the server still holds for the consumer (``num_pending``), what it sent
        and has no acknowledgement for (``num_ack_pending``: on its way, or lost in transit
        and not noticed yet) and what waits in the local queue; ``None`` when the server
        does not answer within ``timeout`` s (a fail-over) or the log is closed."""
        psub = self._psub
        if self._loop is None or psub is None or self._closed.is_set():
            return None
        try:
            info = self._run(psub.consumer_info(), timeout=timeout)
        except Exception:  # noqa: BLE001 - not known: the caller waits or gives up
            return None
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0) + self._queue.qsize()

    def subject_of(self, seq: int) -> str | None:
        """The subject of the entry at stream sequence ``seq`` (once; ``keep_subjects`` only)."""
        return self.subjects.pop(seq, None)

    def get(self, timeout: float | None = None) -> tuple[int, bytes] | None:
        """Next ``(stream sequence, payload)`` in stream order, or ``None`` after ``timeout`` s."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _abandon(self) -> None:
        """After a failed start: close the connection (if made), stop the loop, and mark
        the log closed (``close`` has nothing left to do)."""
        if self._nc is not None:
            try:
                self._run(self._nc.close(), timeout=5)
            except Exception:  # noqa: BLE001 - the start error is what counts
                pass
        self._stop_loop()
        self._closed.set()

    def _stop_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)

    def close(self) -> None:
        """Stop reading and disconnect (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._loop is None:
            return

        async def _stop() -> None:
            if self._task is not None:
                self._task.cancel()
                try:
                    await self._task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
            if self._nc is not None:
                try:
                    await self._nc.flush(timeout=2)
                finally:
                    await self._nc.close()

        try:
            self._run(_stop(), timeout=10)
        except Exception:  # noqa: BLE001 - closing must not raise
            logger.exception("JetStream log: close failed")
        self._stop_loop()


__all__ = ["JetStreamLog", "JetStreamLogError"]
