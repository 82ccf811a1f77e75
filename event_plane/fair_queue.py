"""A bounded queue of batches that is fair between origins and between sources.

A subscriber's transport thread puts batches in; the application's ingest thread takes
them out. With one FIFO, a source that sends a burst (200,000 empty batches, each a new
epoch) queues ahead of every other source's next batch, and the other sources wait for the
whole backlog; a publisher sending under 50,000 source names does the same with one batch
each. Here each source has its own FIFO (so the per-source order the ordering tracker
established is kept), sources are grouped in *lanes* (their origin: a ZMQ endpoint; by
default the source itself), and service takes turns at two levels: between lanes, then
between the sources of the lane whose turn it is. Each level is surplus round robin, the
deficit round robin of Shreedhar and Varghese ("Efficient Fair Queuing using Deficit Round
Robin", SIGCOMM 1995) charged after service (Adiseshu, Parulkar and Varghese, "A Reliable
and Scalable Striping Protocol", SIGCOMM 1996): at its turn a lane (a source) is credited
``quantum_s`` and served while its credit is positive; what it overdraws is paid back from
its next turns. A batch costs what it took the consumer: the time from the ``get`` that
returned it to the consumer's next ``get`` (one consumer thread: the advisor's ingest), at
least ``min_cost_s``. So many cheap batches and a few dear ones (a new source's first batch
persists its origin binding) get the same share of ingest time. A backlog therefore delays
another lane's next batch by at most one turn (``quantum_s`` plus one batch) of each lane
with queued batches, whatever its length and however many source names it uses.

Bounds: ``capacity`` batches in all, ``lane_capacity`` per lane and ``source_capacity``
per source; a put past any raises :class:`queue.Full` (the subscriber drops the batch and
counts it), so one origin cannot fill the room of the others.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from event_plane.errors import ConfigError
from event_plane.schema import EventBatch

QUANTUM_S = 0.002
"""Default credit of a lane or source at each turn: 2 ms of the consumer's time."""
MIN_COST_S = 20e-6
"""Default least cost of a batch (about one journal append), seconds."""


class _Turns:
    """Surplus round robin over keys with queued work (callers hold the queue's lock)."""

    def __init__(self, quantum: float) -> None:
        self.quantum = quantum
        self.order: deque[str] = deque()  # keys with queued work, in turn order
        self.deficit: dict[str, float] = {}
        self._credited = False  # whether the key at the head got its quantum this turn

    def add(self, key: str) -> None:
        """``key`` has work now (it takes its turn after the keys already waiting)."""
        self.order.append(key)
        self.deficit[key] = 0

    def next(self) -> str:
        """The key whose turn it is (credited once per turn; a key still in debt after its
        credit passes its turn)."""
        order = self.order
        while True:
            key = order[0]
            if not self._credited:
                self.deficit[key] += self.quantum
                self._credited = True
            if self.deficit[key] > 0 or len(order) == 1:
                return key
            order.rotate(-1)
            self._credited = False

    def charge(self, key: str, cost: float, emptied: bool) -> None:
        """Charge ``key`` (the head) ``cost`` for what it was served; ``emptied``: it has no
        work left (it leaves the turns and its credit or debt is forgotten)."""
        if emptied:
            del self.deficit[key]
            self.order.popleft()
            self._credited = False
            return
        left = self.deficit[key] - cost
        if len(self.order) == 1:
            left = max(left, 0)  # alone, it takes what nobody else wants: no debt
        self.deficit[key] = left
        if left <= 0:
            self.order.rotate(-1)
            self._credited = False


class _Lane:
    """One lane's sources: their FIFOs and their turns."""

    def __init__(self, quantum: float) -> None:
        self.queues: dict[str, deque[EventBatch]] = {}
        self.turns = _Turns(quantum)
        self.size = 0


class FairQueue:
    """Per-source FIFOs of batches served in turns between lanes, then between the sources
    of a lane (surplus round robin at both levels); thread-safe.

    Args:
        capacity: batches held in all (>= 1).
        source_capacity: batches held for one source (>= 1; ``None``: ``capacity``).
        lane_capacity: batches held for one lane (>= 1; ``None``: ``capacity``).
        quantum_s: credit per turn, seconds of the consumer's time (> 0).
        min_cost_s: least cost of a batch, seconds (>= 0).
        clock: monotonic clock, seconds (tests pass their own).

    Raises:
        ConfigError: a bound out of range.
    """

    def __init__(self, capacity: int, source_capacity: int | None = None, *, lane_capacity: int | None = None,
                 quantum_s: float = QUANTUM_S, min_cost_s: float = MIN_COST_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        source_capacity = capacity if source_capacity is None else source_capacity
        lane_capacity = capacity if lane_capacity is None else lane_capacity
        for name, value in (("capacity", capacity), ("source_capacity", source_capacity),
                            ("lane_capacity", lane_capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if not quantum_s > 0 or not min_cost_s >= 0:
            raise ConfigError(f"quantum_s must be > 0 and min_cost_s >= 0, got {quantum_s!r}, {min_cost_s!r}")
        self.capacity = capacity
        self.source_capacity = min(source_capacity, capacity)
        self.lane_capacity = min(lane_capacity, capacity)
        self.quantum_s = quantum_s
        self.min_cost_s = min_cost_s
        self._clock = clock
        self._served: tuple[str | None, str | None, float] | None = None
        """The batch the consumer took last: its lane and source (``None`` where they left the
        turns, empty) and when; charged at the next ``get``."""
        self._lanes: dict[str, _Lane] = {}
        self._turns = _Turns(quantum_s)
        self._lane_of: dict[str, str] = {}  # source -> the lane its queued batches are in
        self._size = 0
        self._at_cap = 0  # sources and lanes holding their capacity
        self._cond = threading.Condition()

    def put_nowait(self, batch: EventBatch, lane: str | None = None) -> None:
        """Queue ``batch`` behind the other queued batches of its source, in ``lane`` (its
        origin; ``None``: a lane of its own source). While a source has batches queued they
        stay in the lane of its first one, so its order holds.

        Raises:
            queue.Full: ``capacity`` batches are queued, or the lane's or source's capacity.
        """
        src = batch.source
        with self._cond:
            if self._size >= self.capacity:
                raise queue.Full
            key = self._lane_of.get(src)
            if key is None:
                key = src if lane is None else lane
            ln = self._lanes.get(key)
            if ln is not None and ln.size >= self.lane_capacity:
                raise queue.Full
            q = None if ln is None else ln.queues.get(src)
            if q is not None and len(q) >= self.source_capacity:
                raise queue.Full
            if ln is None:
                ln = self._lanes[key] = _Lane(self.quantum_s)
                self._turns.add(key)
            if q is None:
                q = ln.queues[src] = deque()
                ln.turns.add(src)
                self._lane_of[src] = key
            q.append(batch)
            ln.size += 1
            self._size += 1
            self._at_cap += (len(q) == self.source_capacity) + (ln.size == self.lane_capacity)
            self._cond.notify()

    def get(self, timeout: float | None = None) -> EventBatch:
        """The next batch in fair order, waiting up to ``timeout`` seconds (``None``: for ever).

        Raises:
            queue.Empty: nothing came within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._charge_served()
            while not self._size:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Empty
                self._cond.wait(left)
            return self._pop()

    def get_nowait(self) -> EventBatch:
        """The next batch in fair order.

        Raises:
            queue.Empty: none is queued.
        """
        return self.get(timeout=0)

    def _charge_served(self) -> None:
        """Charge the lane and source of the batch taken last with the time the consumer
        spent on it (they are still at the head of their turns: puts only append)."""
        if self._served is None:
            return
        key, src, t0 = self._served
        self._served = None
        cost = max(self._clock() - t0, self.min_cost_s)
        if key is None:
            return
        ln = self._lanes[key]
        if src is not None:
            ln.turns.charge(src, cost, False)
        self._turns.charge(key, cost, False)

    def _pop(self) -> EventBatch:
        """Take the next batch (under the condition's lock, with at least one queued); a
        source or lane left empty leaves the turns now, the others are charged later."""
        key = self._turns.next()
        ln = self._lanes[key]
        src = ln.turns.next()
        q = ln.queues[src]
        self._at_cap -= (len(q) == self.source_capacity) + (ln.size == self.lane_capacity)
        batch = q.popleft()
        ln.size -= 1
        self._size -= 1
        src_left: str | None = src
        if not q:
            del ln.queues[src], self._lane_of[src]
            ln.turns.charge(src, 0.0, True)
            src_left = None
        key_left: str | None = key
        if not ln.size:
            del self._lanes[key]
            self._turns.charge(key, 0.0, True)
            key_left = None
        self._served = (key_left, src_left, self._clock())
        return batch

    def qsize(self) -> int:
        """Batches queued in all."""
        with self._cond:
            return self._size

    def empty(self) -> bool:
        """Whether no batch is queued."""
        return self.qsize() == 0

    def full(self) -> bool:
        """Whether a put could be refused now: ``capacity`` reached, or some lane or source
        at its capacity (a durable transport waits for room while this holds, so it never
        drops)."""
        with self._cond:
            return self._size >= self.capacity or self._at_cap > 0

    def sources(self) -> dict[str, int]:
        """Batches queued per source (sources with none are absent)."""
        with self._cond:
            return {s: len(q) for ln in self._lanes.values() for s, q in ln.queues.items()}
