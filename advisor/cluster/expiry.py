"""Dead sources in scaled mode: a source silent everywhere has its g1/g2 dropped from each partition.

The embedded advisor expires a source silent for ``source_ttl_s`` by journaling an expiry
batch (:mod:`advisor.ingest.source_expiry`).  In scaled mode a partition's owner cannot judge
silence alone: a live worker may not touch one partition for a long time while it keeps
publishing to the others.  So the owner of partition ``k`` expires source ``S`` when

1. ``S`` still has blocks in its ``g1``/``g2`` in ``k``'s index, and ``k``'s fold has seen
   nothing from ``S`` for ``source_ttl_s`` (the owner's monotonic clock), and
2. **globally**: the newest message of ``S`` on any partition subject
   (``kvadvisor.events.<NS>-p<j>.<S>``, JetStream's last message per subject; an expiry
   batch another owner appended there does not count) is older than ``source_ttl_s``,
   measured against the newest message of the whole stream (both times are the NATS
   server's, so advisor clock skew does not matter; an idle cluster expires nothing).

It then appends the expiry batch (:func:`advisor.ingest.source_expiry.expiry_batch`: Cleared of
``g1`` and ``g2`` under ``S``'s name and epoch, a sequence number from the reserved range) to
``k``'s subject of ``S``, so every fold of the partition (this owner's, a later owner's, a
rebuild from a snapshot) applies it at the same place.  The append carries
``Nats-Expected-Last-Subject-Sequence`` = the last message of ``S`` the owner saw on that
subject: if ``S`` published there meanwhile, JetStream refuses the append and nothing is
expired (the race with a source coming back cannot drop its fresh blocks).  Blocks of ``S``
on shared volumes stay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from advisor.ingest.source_expiry import EXPIRY_SEQ_BASE, SourceSeen, expiry_batch, private_blocks
from event_plane.codec import decode_head, encode_batch
from event_plane.nats_transport import MSG_ID_HEADER, STREAM_NAME, msg_id, subject_for
from event_plane.partitioned import partition_namespace

if TYPE_CHECKING:
    from advisor.cluster.parts import NodeParts, Replica

__all__ = ["ClusterExpiry"]

logger = logging.getLogger(__name__)

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"


def _ts(t: Any) -> float:
    """A JetStream message time (RFC 3339 string or datetime) in Unix seconds."""
    if isinstance(t, datetime):
        return t.timestamp()
    s = str(t)
    if "." in s:  # nanoseconds: Python's fromisoformat takes at most microseconds
        head, frac = s.split(".", 1)
        digits = "".join(ch for ch in frac if ch.isdigit())
        zone = frac[len(digits):]
        s = f"{head}.{digits[:6]}{zone}"
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


class ClusterExpiry:
    """Expires dead sources in the partitions one cluster advisor serves (module docstring).

    Args:
        node: the advisor.
        ttl_s: silence after which a source is dead (> 0).
        call: runs a coroutine on the node's event loop and returns its result
            (``ClusterNode._call``).
    """

    def __init__(self, node: NodeParts, ttl_s: float, call: Callable[[Any, float], Any]) -> None:
        if ttl_s <= 0:
            raise ValueError(f"source_ttl_s must be > 0, got {ttl_s}")
        self.node = node
        self.ttl_s = ttl_s
        self._call = call
        self.counters = {"expired": 0, "alive_elsewhere": 0, "raced": 0, "errors": 0}

    def candidates(self, rep: Replica, now: float | None = None) -> list[str]:
        """Sources of ``rep``'s partition still holding g1/g2 blocks there and silent in its
        fold for ``ttl_s`` (check 1 of the module docstring), sorted."""
        t = time.monotonic() if now is None else now
        with rep.lock:
            names = [n for n in rep.index.sources() if private_blocks(rep.index, n)]
            heard = dict(rep.heard)
        start = rep.started_mono
        return sorted(n for n in names if t - heard.get(n, start) > self.ttl_s)

    def run_once(self) -> list[tuple[int, str]]:
        """One pass over every served partition; returns the ``(partition, source)`` expired."""
        done: list[tuple[int, str]] = []
        for p, rep in sorted(self.node.serving().items()):
            for name in self.candidates(rep):
                try:
                    if self._expire(rep, name):
                        done.append((p, name))
                except Exception as exc:  # noqa: BLE001 - retried next pass
                    self.counters["errors"] += 1
                    logger.warning("partition %d: expiring source %r failed: %s: %s", p, name,
                                   type(exc).__name__, exc)
        return done

    def _expire(self, rep: Replica, name: str) -> bool:
        s = self.node.settings
        subjects = [subject_for(partition_namespace(s.namespace, k), name) for k in range(s.scheme.partitions)]
        mine = subject_for(partition_namespace(s.namespace, rep.partition), name)

        async def look() -> tuple[float | None, float, int]:
            js = self.node.nats.jetstream()
            info = await js.stream_info(STREAM_NAME)
            try:  # the server time of the stream's newest message (nats-py's StreamState drops last_ts)
                newest = _ts((await js.get_msg(STREAM_NAME, seq=int(info.state.last_seq))).time)
            except Exception:  # noqa: BLE001 - no message (or it was just deleted): judge nothing now
                newest = 0.0
            last_seen: float | None = None
            last_seq_here = 0
            for subj in subjects:
                try:
                    m = await js.get_last_msg(STREAM_NAME, subj)
                except Exception:  # noqa: BLE001 - no message on that subject (NotFoundError)
                    continue
                if subj == mine:
                    last_seq_here = int(m.seq)
                head = decode_head(m.data or b"")
                if head is not None and head.seq >= EXPIRY_SEQ_BASE:
                    # an expiry appended there (after S was silent everywhere for the TTL) is
                    # no sign of life, and S has published nothing there since
                    continue
                at = _ts(m.time)
                last_seen = at if last_seen is None else max(last_seen, at)
            return last_seen, newest, last_seq_here

        last_seen, newest, last_seq_here = self._call(look(), 15.0)
        if not newest:
            return False
        if last_seen is not None and newest - last_seen <= self.ttl_s:
            self.counters["alive_elsewhere"] += 1
            rep.heard[name] = time.monotonic() - max(0.0, newest - last_seen)  # ask again when due
            return False
        with rep.lock:
            st = rep.index.sources().get(name)
            if st is None:
                return False
            batch = expiry_batch(name, SourceSeen(st.epoch, st.batches, st.last_ts_ns))
        ns = partition_namespace(s.namespace, rep.partition)
        headers = {MSG_ID_HEADER: msg_id(ns, batch), EXPECTED_LAST_SUBJECT_SEQ: str(last_seq_here)}

        async def append() -> bool:
            from nats.js.errors import APIError

            try:
                await self.node.nats.jetstream().publish(mine, encode_batch(batch), stream=STREAM_NAME,
                                                        headers=headers, timeout=5.0)
            except APIError as exc:
                if "wrong last sequence" in str(exc).lower() or getattr(exc, "err_code", 0) == 10071:
                    return False
                raise
            return True

        if not self._call(append(), 15.0):
            self.counters["raced"] += 1
            logger.info("partition %d: source %r published meanwhile; not expired", rep.partition, name)
            return False
        rep.heard[name] = time.monotonic()  # the expiry itself is not a sign of life, but do not repeat it
        self.counters["expired"] += 1
        logger.warning("partition %d: source %r sent nothing for %.0f s on any partition: its g1/g2 blocks are "
                       "dropped (expiry appended to the partition's log)", rep.partition, name, self.ttl_s)
        return True
