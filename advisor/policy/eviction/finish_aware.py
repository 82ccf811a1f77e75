"""Finish-aware prefix-LRU: evict the leaf whose session is expected back last.

An agent's conversation is a loop of requests: the model answers, and the next request of
the session follows once the client has acted on the answer.  *How* the answer ended says
how soon that is.  An answer that stopped on a tool call (OpenAI ``finish_reason =
"tool_calls"``, Anthropic ``stop_reason = "tool_use"``) is followed by the tool's result
within seconds; one that ended the turn (``"stop"`` / ``"end_turn"``) waits for a person,
or the session is over.  On the WEKA Claude Code traces (docs/traces.md) a session's next
request came a median of 10 s after an answer that stopped on a tool call and 264 s after
one that ended the turn, and 101 of 512 end-of-turn answers were never followed at all,
against 45 of 5,359 tool calls (``python bench/evaluator.py --finish-gaps``).
Retention by tool-call state is the idea of InferCept (Abhyankar et al., ICML 2024) and of
Continuum's KV-cache time-to-live for tool calls (Li et al., arXiv 2511.02230, 2025); this
expert learns the waiting times instead of taking a tool's duration as given.

**Rule.**  The cached prefixes form a tree and only leaves are evicted (prefix-LRU, SGLang's
RadixAttention).  Each leaf has the *state* of the latest request that referenced it: in
flight (arrived, not finished), or finished with a reason class (:data:`FINISH_CLASSES`).
Within a state, leaves leave least recently used first (by the time their request
finished; arrived, in flight).  Across states, the leaf evicted is the oldest leaf
of the state whose *mean residual life* is longest: the expected time until the session's
next request, given the state and the time ``a`` since the leaf's request finished
(arrived, for in flight), ``MRL_s(a) = E[G − a | G > a]`` over the gaps ``G`` observed
after requests in state ``s`` (Belady's rule with the next use replaced by its
conditional expectation).  The gaps are learned online: when a request continues an
earlier one (the deepest of its blocks seen before was last referenced by that request),
the gap from that request's finish (and, for the in-flight state, from its arrival) is
counted once, in log-spaced bins (4 a doubling, from 1 s).  Where fewer than
:data:`MIN_GAPS` observed gaps exceed ``a`` the leaf is past nearly every gap seen in its
state, and it goes first (oldest first among such leaves).

**Without finish reasons** (a trace or an engine that reports none) every finished request
is in the one state ``unknown`` and no request is in flight, so the order is prefix-LRU's
exactly (tested): the expert costs nothing where it has nothing to learn from.

**Cost.**  One binary heap of leaves per state (5), O(log C) per reference; an eviction
compares the 5 heads, each ``MRL`` read from suffix sums in O(1); a learned gap costs
O(bins) once per continued request.  Memory O(blocks + requests), as prefix-LRU's.

**Online.**  A request's finish reason and finish time are used only once the replay's
clock (the arrival of the request being served) has passed its finish; until then its
blocks are in flight.  Arrival and finish times are the trace's (seconds); a trace without
them uses the request index as the clock, with finish = arrival.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace, add_block, drop_leaf
from advisor.policy.eviction.evlog import as_arrays, log_eviction, log_resident, new_log, no_logging, prefix_hit

FINISH_UNKNOWN = 0
"""No finish reason reported (or one outside the classes below)."""
FINISH_TOOL_CALL = 1
"""The answer stopped on a tool call: ``tool_calls`` (OpenAI, vLLM), ``tool_use`` (Anthropic)."""
FINISH_END_TURN = 2
"""The answer ended the turn: ``stop`` (OpenAI, vLLM), ``end_turn`` / ``stop_sequence`` (Anthropic)."""
FINISH_LENGTH = 3
"""The answer hit its token limit: ``length`` (OpenAI, vLLM), ``max_tokens`` (Anthropic)."""
FINISH_CLASSES: dict[str, int] = {
    "tool_calls": FINISH_TOOL_CALL, "tool_use": FINISH_TOOL_CALL, "function_call": FINISH_TOOL_CALL,
    "stop": FINISH_END_TURN, "end_turn": FINISH_END_TURN, "stop_sequence": FINISH_END_TURN,
    "length": FINISH_LENGTH, "max_tokens": FINISH_LENGTH,
}
"""Finish reasons as OpenAI, vLLM and Anthropic name them, by class."""
FINISH_CLASS_NAMES: tuple[str, ...] = ("unknown", "tool_call", "end_turn", "length")
"""Name of each class, by number."""
N_FINISH = 4
"""Finish classes (the states of finished requests)."""
MIN_GAPS = 8
"""Observed gaps beyond a leaf's age below which the leaf is past its state's gaps (module docstring)."""
IN_FLIGHT = N_FINISH
"""The state of a leaf whose latest request has arrived and not finished."""
MAX_TIME = 1e12
"""Residual life (s) of a leaf past its state's gaps: above every learned one."""
_IN_FLIGHT = IN_FLIGHT
_BINS = 96
_MAX_TIME = MAX_TIME


def finish_class(reason: str | None) -> int:
    """The class (:data:`FINISH_CLASSES`) of a finish reason; :data:`FINISH_UNKNOWN` for
    ``None``, an empty string, ``abort`` or a reason not listed."""
    return FINISH_CLASSES.get(reason or "", FINISH_UNKNOWN)


@numba.njit(cache=True, inline="always")
def _bin(gap: float) -> int:
    if gap < 1.0:
        return 0
    if not gap < _MAX_TIME:  # inf and NaN: past every bin
        return _BINS - 1
    return min(int(np.log2(gap) * 4.0) + 1, _BINS - 1)


@numba.njit(cache=True)
def _residual(count: np.ndarray, total: np.ndarray, state: int, age: float) -> float:
    """``MRL_state(age)`` from the binned gaps (bins above the age's); ``_MAX_TIME + age``
    when fewer than ``MIN_GAPS`` gaps lie beyond it.  ``count`` and ``total`` are suffix
    sums (gaps, and their seconds, in bins ``>= k``): O(1) per call."""
    k = _bin(age) + 1
    if k >= _BINS or count[state, k] < MIN_GAPS:
        return _MAX_TIME + age
    return (total[state, k] - age * count[state, k]) / count[state, k]


@numba.njit(cache=True, inline="always")
def _add_gap(count: np.ndarray, total: np.ndarray, state: int, gap: float) -> None:
    """Count one gap into the suffix sums of ``state`` (O(bins), once per continued request)."""
    for k in range(_bin(gap) + 1):
        count[state, k] += 1.0
        total[state, k] += gap


@numba.njit(cache=True)
def _heap(s: int, h0: list, h1: list, h2: list, h3: list, h4: list) -> list:
    if s == 0:
        return h0
    if s == 1:
        return h1
    if s == 2:
        return h2
    if s == 3:
        return h3
    return h4


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, parent: np.ndarray,
         arrival: np.ndarray, finish: np.ndarray, reason: np.ndarray, want_ev: np.ndarray,
         want_snap: np.ndarray) -> tuple:
    n_req = offsets.shape[0] - 1
    cached = np.zeros(n_blocks, dtype=np.bool_)
    children = np.zeros(n_blocks, dtype=np.int32)
    key = np.zeros(n_blocks, dtype=np.float64)  # the leaf's place in its state's heap
    state = np.zeros(n_blocks, dtype=np.int64)
    lastreq = np.full(n_blocks, -1, dtype=np.int64)
    since = np.zeros(n_blocks, dtype=np.float64)  # finish (arrival while in flight) of lastreq
    continued = np.zeros(n_req, dtype=np.bool_)
    count = np.zeros((N_FINISH + 1, _BINS))
    total = np.zeros((N_FINISH + 1, _BINS))
    h0 = [(0.0, np.int64(0))]
    h1 = [(0.0, np.int64(0))]
    h2 = [(0.0, np.int64(0))]
    h3 = [(0.0, np.int64(0))]
    h4 = [(0.0, np.int64(0))]
    h0.pop()
    h1.pop()
    h2.pop()
    h3.pop()
    h4.pop()
    by_finish = np.argsort(finish, kind="mergesort")
    fp = 0
    size = 0
    stale = 0
    hits = np.zeros(n_req, dtype=np.int64)
    evl, snl = new_log(), new_log()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        now = arrival[i]
        while fp < n_req and finish[by_finish[fp]] <= now:  # answers finished by now: their state is known
            q = by_finish[fp]
            fp += 1
            if q >= i or finish[q] <= arrival[q]:
                continue  # not arrived yet, or never in flight (placed at arrival)
            for j in range(offsets[q], offsets[q + 1]):
                x = flat[j]
                if cached[x] and lastreq[x] == q and state[x] == _IN_FLIGHT:
                    state[x] = reason[q]
                    since[x] = finish[q]
                    key[x] = finish[q] + (j - offsets[q]) * 1e-9
                    if children[x] == 0:
                        heapq.heappush(_heap(reason[q], h0, h1, h2, h3, h4), (key[x], np.int64(x)))
                        stale += 1
        if want_snap[i]:
            log_resident(snl, i, cached)
        hits[i] = prefix_hit(flat, a, b, cached)
        r = np.int64(-1)
        for j in range(a, b):
            if lastreq[flat[j]] >= 0:
                r = lastreq[flat[j]]
        if r >= 0 and not continued[r] and finish[r] <= now:
            continued[r] = True
            _add_gap(count, total, reason[r], now - finish[r])
            if finish[r] > arrival[r]:
                _add_gap(count, total, _IN_FLIGHT, now - arrival[r])
        flying = finish[i] > now
        s_i = _IN_FLIGHT if flying else reason[i]
        for j in range(a, b):
            x = flat[j]
            lastreq[x] = i
            state[x] = s_i
            since[x] = now
            key[x] = now + (j - a) * 1e-9
            size += add_block(x, cached, children, parent)
            if children[x] == 0:
                heapq.heappush(_heap(s_i, h0, h1, h2, h3, h4), (key[x], np.int64(x)))
                stale += 1
            while size > capacity:
                best = -1
                best_mrl = -1.0
                for s in range(N_FINISH + 1):
                    h = _heap(s, h0, h1, h2, h3, h4)
                    while len(h) > 0:
                        t, v = h[0]
                        if cached[v] and children[v] == 0 and state[v] == s and key[v] == t:
                            break
                        heapq.heappop(h)
                    if len(h) == 0:
                        continue
                    v = h[0][1]
                    m = _residual(count, total, s, max(now - since[v], 0.0))
                    if best < 0 or m > best_mrl:
                        best = s
                        best_mrl = m
                t, v = heapq.heappop(_heap(best, h0, h1, h2, h3, h4))
                size -= 1
                if want_ev[i]:
                    log_eviction(evl, i, j - a, v)
                p = drop_leaf(v, cached, children, parent)
                if p >= 0:
                    heapq.heappush(_heap(state[p], h0, h1, h2, h3, h4), (key[p], np.int64(p)))
                    stale += 1
            if stale > 4 * capacity + n_blocks:  # drop stale heap entries (a rebuild scans every block)
                h0.clear()
                h1.clear()
                h2.clear()
                h3.clear()
                h4.clear()
                stale = 0
                for v in range(n_blocks):
                    if cached[v] and children[v] == 0:
                        _heap(state[v], h0, h1, h2, h3, h4).append((key[v], np.int64(v)))
                        stale += 1
                heapq.heapify(h0)
                heapq.heapify(h1)
                heapq.heapify(h2)
                heapq.heapify(h3)
                heapq.heapify(h4)
    return hits, as_arrays(evl), as_arrays(snl), count, total


def _inputs(trace: CompactTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = trace.finishes
    if t is None:
        clock = np.arange(trace.requests, dtype=np.float64)
        return clock, clock, np.zeros(trace.requests, dtype=np.int64)
    t0 = float(t.arrival[0]) if trace.requests else 0.0  # from the first arrival: an epoch clock (1.7e9 s)
    return t.arrival - t0, t.finish - t0, t.reason.astype(np.int64)  # leaves float64 no room for the tie-break


def simulate(trace: CompactTrace, capacity: int) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) of finish-aware prefix-LRU with
    ``capacity`` blocks, on the trace's :attr:`~CompactTrace.finishes` (module docstring)."""
    return replay(trace, capacity, *no_logging(trace.requests))[0]


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray) -> tuple:
    """``(hits, evictions, snapshots)`` with the logs of :mod:`advisor.policy.eviction.evlog`."""
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, *_inputs(trace), want_ev,
                want_snap)[:3]


@dataclass(frozen=True)
class ReturnTimes:
    """The gaps the kernel learned: what :func:`residual_life` reads (the live ranking's input).

    Attributes:
        count: float64 ``[states, bins]``, per state (``N_FINISH`` finish classes, then in
            flight) the gaps in log-spaced bins ``>= k`` (suffix sums).
        total: float64 ``[states, bins]``, their sum in seconds.
    """

    count: np.ndarray
    total: np.ndarray

    def residual_life(self, state: int, age_s: float) -> float:
        """``MRL_state(age)`` in seconds (module docstring); :data:`MAX_TIME` + age when fewer
        than :data:`MIN_GAPS` gaps of the state exceed ``age_s``.

        Raises:
            ValueError: ``state`` outside ``0 .. N_FINISH`` (``N_FINISH`` = in flight), or
                ``age_s`` not a number.
        """
        if not 0 <= state <= N_FINISH:
            raise ValueError(f"state must be in 0..{N_FINISH}, got {state}")
        if age_s != age_s:
            raise ValueError("age_s is not a number")
        return float(_residual(self.count, self.total, int(state), max(float(age_s), 0.0)))


def learn(trace: CompactTrace, capacity: int) -> tuple[np.ndarray, ReturnTimes]:
    """Replay ``trace`` at ``capacity`` blocks: ``(hits per request, the gaps learned)``."""
    r = _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, *_inputs(trace),
             *no_logging(trace.requests))
    return r[0], ReturnTimes(r[3], r[4])


__all__ = ["FINISH_CLASSES", "FINISH_CLASS_NAMES", "FINISH_END_TURN", "FINISH_LENGTH", "FINISH_TOOL_CALL", "FINISH_UNKNOWN", "IN_FLIGHT",
           "MAX_TIME", "MIN_GAPS", "N_FINISH", "ReturnTimes", "finish_class", "learn", "replay", "simulate"]
