"""The default policy: the real tier follows, online, the best of a set of expert policies.

Experts (:data:`EXPERTS`): ``prefix_value`` (:mod:`advisor.policy.eviction.prefix_value`), ARC,
S3-FIFO, LFU-DA and LRU served tail first (below), SIEVE, prefix-LRU and ``finish_aware``
(:mod:`advisor.policy.eviction.finish_aware`: prefix-LRU where requests carry no finish
reason, sessions waiting on a tool call kept over those that ended their turn where they
do).  Every online baseline the evaluator reports is an expert or is matched by one on
every row measured (ARC, S3-FIFO, LFU-DA and LRU by their tail-first forms, below), so no
baseline can be strong on a workload without the selector seeing it.

**Tail first.**  The block-level experts ARC, S3-FIFO, LFU-DA and LRU (:data:`TAIL_FIRST`)
take each request's blocks last block first, the order in which vLLM returns a finished
request's blocks to its free queue (``KVCacheManager.free``: "We free the blocks in reverse
order so that the tail blocks are evicted first when caching is enabled"): a prefix's first
blocks are then its most recent, and a policy that evicts oldest first takes a prefix's
tail before its head, the only order in which the blocks left can still be hit (a prefix
hit stops at its first missing block).  The baselines keep the classic block-by-block order
(``tail_first=False``).  Measured over 169 rows (Mooncake, WEKA, the synthetic suite and
variants of seeds 0, 1,000 and 2,000; ``python bench/evaluator.py --tail-first 0,1000,2000``,
docs/BENCHMARKS.md), tail first minus classic is −0.0000 to +0.099 for ARC, −0.0000 to
+0.096 for S3-FIFO, +0.0000 to +0.085 for LRU and −0.0019 to +0.102 for LFU-DA, within the
0.002 tolerance on every row, so their classic forms are not experts.  SIEVE's is −0.56 to
+0.16 (its hand keeps "visited" blocks anywhere in the queue), so SIEVE keeps the classic
order.

**Experts run whole.**  Every expert replays every request on a cache of its own with the
tier's full capacity (its own metadata and ghost lists over all keys, exactly as it runs
alone), so its hit count per request is exact.  Cost: E full caches of metadata (E = 8)
and E updates per block reference, i.e. E times one policy's memory and time.  The
evaluator replays the experts one after another (peak memory: one expert's), then replays
each expert that led again, logging its evictions during its spells (16 bytes per
eviction, at most one per reference) and the blocks it holds at the start of each spell
(at most C per switch), then runs the mirror below, O(references + C × switches).  The
live advisor runs the same selection (:class:`LiveSelector`: the same experts, kernels
and rule, over a window of the event stream on a hashed sample of prefixes) and ranks its
blocks by the leader's order (:mod:`advisor.policy.eviction.live_scoring`).

**Miniature simulations: live only, and off by default** (C. A. Waldspurger et al., "Cache
Modeling and Optimization using Miniature Simulations", USENIX ATC 2017).  The live
selector can replay a hashed sample of prefixes (by root block, ``sample_rate``) on caches
scaled by the same rate; its default rate is 1 (exact), and the evaluator never samples:
(1) a hit here
is a *prefix* hit, so a sample of single keys does not see the quantity being chosen
(SIEVE keeps most sampled keys but loses the roots of long prefixes and with them nearly
every prefix hit, docs/BENCHMARKS.md); a prefix-closed sample (by subtree) keeps the
shared roots at full weight in a cache scaled by R, which SHARDS' scaling does not cover;
(2) the real tier must follow the chosen expert's evictions without losing its contents at
a switch (below), which needs each expert's full state anyway, and with it the exact
counts come for free; (3) at the smallest capacities (1,000 blocks × R = 0.01 is 10
blocks) a miniature cache's hit-count noise is larger than the 0.002 tolerance asked;
(4) a root sample is all-or-nothing on a workload whose requests share one root (a common
system prompt).

**Switching rule (follow the leader with a paired noise bound).**  After request i each
expert's score is its hit count decayed with a half-life of ``H = half_life × capacity``
block references: ``S_e ← S_e · 2^(−n_i / H) + h_e(i)``, and for each pair the decayed sum
of squared per-request differences ``V_ef ← V_ef · 2^(−n_i / H) + (h_e(i) − h_f(i))²``.
The leader changes to ``b = argmax S`` only when ``S_b − S_lead > z · sqrt(V_b,lead + 1)``:
the lead must exceed z times the spread of the two experts' *difference* (a paired
test; two experts that hit on the same requests differ only where they disagree, so this is
far more sensitive than a bound on each count's own noise, and it never switches between
experts that make the same decisions).  ``V`` weighs each squared difference once where the
variance of the decayed difference weighs it by the square of its weight, so once the
window is full ``V`` is about twice that variance: z = 0.75 tests at about 1.06 standard
deviations of independent per-request differences (at 0.75 while the weights are near 1).
A loose test, because a switch is cheap once its refill is promoted ("Refill by promotion",
below): z = 2, the setting before, cost more in lag than it saved in refill.
The leader for request i+1 is decided from requests ≤ i only (online).
The first leader is ``initial`` (S3-FIFO, tail first): before any evidence the tier follows the
expert that needs none — S3-FIFO learns nothing from the trace and is scan- and
one-hit-resistant by construction (Yang et al., SOSP '23), while ``prefix_value`` learns
its reuse classes from the trace and, before it has, ranks like LRU, the classic that loops
and scans defeat.  A loop larger than the tier shows why the first leader matters: an
expert's lead there appears only once its protected set is reused, a full loop period
after the start, and following it then costs one more period (the switch cost below), so a
selector that starts on the recency-led expert loses about two periods of the gain.

**Following without losing contents (mirroring).**  The real tier R holds blocks; the
leader L is one expert's cache.  Every request's blocks are inserted into R (the hit rule),
in the leader's order.
When L evicts a block that R holds, the block becomes an *orphan* of R (held, but not
wanted by the leader); R evicts only orphans, oldest first, and only when it is over
capacity.  At a switch the blocks of R the new leader does not hold become orphans, and
orphans it holds are wanted again.  Invariant: every block referenced since the last
switch that L holds is in R (R evicts no block L holds while an orphan exists, and after
a request ``|R| > C ≥ |L|`` implies one exists).  So once L's contents all date from after
the switch, R = L, and R's hits are L's exactly; a leader that never changes gives R = L
from the start (tested).

**Switch cost (refill).**  After a switch from a to b at request t the real tier holds a's
contents, and b's hits on blocks b held at t but R did not are lost until each is
referenced once (it then enters R and stays while b holds it).  The refill cost c_k of
spell k is the followed leader's hits minus R's over the spell (:attr:`SelectorRun.followed`;
the evaluator reports it per capacity, ``refill``).  It grows with the tier's turnover time
(C / miss ratio, block references): on the synthetic suite a switch costs a median of 44
hits, and up to about 400 (0.0015 of a trace) for a tier of 9/10 of the footprint, which
turns over slowly (figures before refill by promotion, below).  The threshold has no term
for it, by measurement
(docs/benchmarks-history.md, "Switching rules measured against the default's"):
switching only when the lead also exceeds an estimate κ of the refill (``S_b − S_lead >
z·sqrt(V) + κ``, the ski-rental rule of metrical task systems, Borodin,
Linial and Saks, JACM 1992; κ = the challenger's lead rate × its turnover time, or its
excess hits over one turnover), a batch-means variance over one turnover, scores decayed by
misses instead of references, a minimum dwell, restarts when the leader's hit rate drops,
and a LeCaR-style blend of the two best experts' contents (Vietri et al., HotStorage '18)
each traded refill for lag (hits lost following a worse expert while the evidence builds)
about one for one, or lost both: on the suite and on other seeds none lowered the share of
rows more than 0.002 below the best baseline beyond the spread between seeds (about one
row in seven for this rule and for the best of them).
The rows that miss are near-ties whose difference over the whole trace is within the
paired noise (S3-FIFO, SIEVE and ARC on Zipf traces, 0.002–0.005 apart), where no online
rule knows the winner in time, and large tiers where one switch's refill is most of the
tolerance.

**Refill by promotion.**  The blocks a refill waits for are not lost: every block was
written down when it was first referenced, so the tier below holds it (the evaluator's time
model, :mod:`kvadvisor.timemodel`; the live advisor's slow volumes and archive).  So at a
switch the real tier does not wait for references: it queues the new leader's blocks it
lacks (from the leader's snapshot at the switch), most recently referenced first (by last
reference in the trace, so within one request its last block first), and
promotes them at ``refill_rate`` blocks per block referenced (ρ, default 1: a spell
promotes no more blocks than its requests reference), each into the room of one
orphan and never of a block the leader holds (the invariant above holds), skipping a
block the leader has evicted since or a request has brought back.  A spell's refill then
ends after at most (blocks queued) / ρ block references instead of one reference to each,
so c_k falls; the bound below is unchanged (a promotion only makes a block enter R
sooner).  Cost: one queue of at most C blocks per switch, O(C log C) to order it, and the
promotions themselves, which the evaluator reports (:attr:`SelectorRun.promoted_at`) and
the time model puts on the tiers' links like any other transfer, so a hit on a promoted
block counts as ready only once its transfer is done.  The live advisor's counterpart is
the promotion policy's swaps (:func:`advisor.policy.policies.plan_swaps`): slow-volume
blocks that rank above the fast volume's lowest leaves by the leader's order take their
place, at most ``max_swaps`` a round.  Measured on 648 generated rows (the suite and its
variants, seeds 0–11,000, with z = 2): rows more than 0.002 below the best
baseline 45 → 21 (ρ = 1; 18 with instant promotion), promotions 0.13–0.16 % of the block
references (docs/benchmarks-history.md, "Refill by promotion").  With a switch that
cheap, the test's z was lowered from 2 to 0.75, chosen on seeds 0–6,000 (378 rows: 18 → 1
below) and checked on seeds 7,000–11,000 (270 rows: 3 → 4 below, but better than z = 2 by
more than 0.0005 on 67 rows and worse on 40, mean +0.0001): 5 of 648 in all, with 6 × the
switches and promotions 0.37–0.39 % of the references.

**Regret.**  Let the leader change S times, at requests t_1 < … < t_S, let ℓ_max be the
longest request (blocks), G_e(t) expert e's hits on requests before t, and θ_max the
largest threshold ``z·sqrt(V + 1)`` of the run.  With scores undecayed (H = ∞), after
every check the leader trails the best expert by at most θ_max (else the best would have
passed the test), so one request later by at most θ_max + ℓ_max, and the lead
D_k = G_new(t_k) − G_old(t_k) the new leader holds at switch k is at most θ_max + ℓ_max.
Telescoping over the spells, the followed leaders' hits ``F = Σ_i h_lead(i)(i) = G_last(n) −
Σ_k D_k ≥ max_e G_e − (S + 1)(θ_max + ℓ_max)``.  R loses to the followed leader only by
refill: each block the new leader held at the switch but R did not breaks at most one
request's prefix before it enters R, so c_k ≤ C · ℓ_max and
``hits(R) = F − Σ_k c_k ≥ max_e G_e − (S + 1)(θ_max + ℓ_max) − S · C · ℓ_max`` (tested).
With a finite H the same holds against the best expert of each spell (a shifting
comparator), with S unbounded in the worst case (as for any deterministic
follow-the-leader).  A refill term κ ≥ c_k in the threshold would charge each switch's
refill to the lead that triggered it, at the price of a lead D_k larger by κ at every
switch: the trade measured above.  The evaluator reports S (``switches``) and Σ c_k
(``refill``) so the bound can be checked on every trace.  The first leader enters the
bound only through the first spell: starting on ``initial`` instead of the eventual best
adds at most one switch (S + 1 → S + 2 spells).

**Cost of the rule.**  Per request: E score updates and E(E − 1)/2 pair variances (E = 8:
28 pairs), O(E²) time and memory independent of the trace; a switch in the evaluator costs
one replay of the new leader's spell with its eviction log (above).  Live: a refresh
replays the window once per expert, O(E × window) (:class:`LiveSelector`).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numba
import numpy as np

from advisor.policy.eviction import arc, finish_aware, lfu_da, lru, prefix_lru, prefix_value, s3fifo, sieve
from advisor.policy.eviction.compact import CompactTrace, RequestFinishes, compact
from advisor.policy.eviction.dlist import new_lists, push_head, unlink
from advisor.policy.eviction.evlog import as_arrays, new_log, served

EXPERTS: tuple[str, ...] = ("prefix_value", "arc_tail", "s3fifo_tail", "lfu_da_tail", "lru_tail", "sieve", "prefix_lru",
                            "finish_aware")
"""Expert policies, in order (the first leader is :attr:`SelectorSettings.initial`)."""

_REPLAY: dict[str, Callable[[CompactTrace, int, np.ndarray, np.ndarray], tuple]] = {
    "prefix_value": prefix_value.replay, "sieve": sieve.replay, "prefix_lru": prefix_lru.replay,
    "finish_aware": finish_aware.replay,
    "arc_tail": functools.partial(arc.replay, tail_first=True),
    "s3fifo_tail": functools.partial(s3fifo.replay, tail_first=True),
    "lfu_da_tail": functools.partial(lfu_da.replay, tail_first=True),
    "lru_tail": functools.partial(lru.replay, tail_first=True),
}
ANONYMOUS = "anonymous"
"""The client of hints that name none (an API without tokens, in-process callers); the
finish-hint quota and the prefetch queue share by client (:func:`api.auth.client_id`)."""
TAIL_FIRST: frozenset[str] = frozenset({"arc_tail", "s3fifo_tail", "lfu_da_tail", "lru_tail"})
"""Experts that serve each request's blocks last block first (module docstring, "Tail first")."""


@dataclass(frozen=True)
class SelectorSettings:
    """Settings of the switching rule (module docstring); one set for every trace.

    Attributes:
        half_life: half-life of the scores, in multiples of the capacity (block refs);
            ``inf`` = cumulative counts.
        z: hysteresis in standard deviations of the two scores' difference.
        initial: the first leader.
    """

    half_life: float = 16.0
    z: float = 0.75
    initial: str = "s3fifo_tail"
    """The leader before any evidence (one of :data:`EXPERTS`, module docstring)."""
    refill_rate: float = 1.0
    """Refill promotions after a switch (module docstring, "Refill by promotion"): at most
    this many blocks promoted from the tier below per block referenced; 0 = none."""

    def __post_init__(self) -> None:
        if (not self.half_life > 0 or self.z < 0 or self.initial not in EXPERTS
                or not 0 <= self.refill_rate < math.inf):
            raise ValueError(f"need half_life > 0, z >= 0, a finite refill_rate >= 0 and initial one of {EXPERTS}, got "
                             f"{self.half_life}, {self.z}, {self.refill_rate}, {self.initial!r}")


@dataclass
class SelectorRun:
    """One replay of the default policy.

    Attributes:
        hits: hit blocks per request of the real tier (int64 ``[requests]``).
        leader: index into :data:`EXPERTS` of the leader of each request (int8 ``[requests]``).
        expert_hits: each expert's own hits per request (int64 ``[experts, requests]``).
        switches: leader changes.
        fallbacks: times the real tier had to evict a block the leader holds (0 when the
            mirror invariant holds; a test checks it).
        followed: hits per request of the expert followed, ``expert_hits[leader[i], i]``
            (int64 ``[requests]``); ``followed − hits`` summed over a spell is that
            switch's refill cost (module docstring), 0 without switches.
        promoted_at: the refill promotions (module docstring, "Refill by promotion"): the
            request each was made before (int64 ``[promotions]``, non-decreasing).
        promoted_blocks: the block of each (dense ids, int64 ``[promotions]``).
    """

    hits: np.ndarray
    leader: np.ndarray
    expert_hits: np.ndarray
    switches: int
    fallbacks: int
    followed: np.ndarray
    promoted_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    promoted_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@numba.njit(cache=True)
def _schedule(hits: np.ndarray, lengths: np.ndarray, half_life_refs: float, z: float, first: int) -> np.ndarray:
    """Leaders ``[requests + 1]``: entry i leads request i; the last entry leads the next request."""
    n_exp, n_req = hits.shape
    score = np.zeros(n_exp)
    var = np.zeros((n_exp, n_exp))  # decayed sum of squared per-request differences, per pair
    lead = first
    leader = np.zeros(n_req + 1, dtype=np.int8)
    for i in range(n_req):
        leader[i] = lead
        decay = 0.5 ** (lengths[i] / half_life_refs) if half_life_refs < np.inf else 1.0
        for e in range(n_exp):
            score[e] = score[e] * decay + hits[e, i]
            for f in range(e + 1, n_exp):
                d = float(hits[e, i] - hits[f, i])
                var[e, f] = var[e, f] * decay + d * d
                var[f, e] = var[e, f]
        best = lead
        for e in range(n_exp):
            if score[e] > score[best]:
                best = e
        if best != lead and score[best] - score[lead] > z * np.sqrt(var[best, lead] + 1.0):
            lead = best
    leader[n_req] = lead
    return leader


def _leaders(expert_hits: np.ndarray, lengths: np.ndarray, capacity: int,
             settings: SelectorSettings | None) -> np.ndarray:
    s = settings or SelectorSettings()
    return _schedule(np.ascontiguousarray(expert_hits, dtype=np.int64), lengths.astype(np.int64),
                     float(s.half_life * capacity), float(s.z), EXPERTS.index(s.initial))


def schedule(expert_hits: np.ndarray, lengths: np.ndarray, capacity: int,
             settings: SelectorSettings | None = None) -> np.ndarray:
    """The leader of each request (int8 ``[requests]``, index into the experts) by the
    switching rule of the module docstring.

    Args:
        expert_hits: int64 ``[experts, requests]``, each expert's hits per request.
        lengths: int64 ``[requests]``, blocks per request.
        capacity: the tier's capacity in blocks (sets the half-life).
        settings: the rule's settings (default :class:`SelectorSettings`).
    """
    return _leaders(expert_hits, lengths, capacity, settings)[:-1]


def expert_hits(trace: CompactTrace, capacity: int,
                known: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """Each expert's own hits per request (int64 ``[experts, requests]``), every expert
    replaying the whole trace alone on a cache of ``capacity`` blocks.

    Args:
        trace: the compact trace.
        capacity: blocks (>= 1).
        known: hits per request already replayed at this capacity (by expert name).
    """
    known = known or {}
    none = np.zeros(trace.requests, dtype=np.bool_)
    hits = np.zeros((len(EXPERTS), trace.requests), dtype=np.int64)
    for e, name in enumerate(EXPERTS):
        hits[e] = known[name] if name in known else _REPLAY[name](trace, capacity, none, none)[0]
    return hits


def next_leader(trace: CompactTrace, capacity: int, settings: SelectorSettings | None = None) -> tuple[int, int]:
    """``(leader, switches)``: the expert (index into :data:`EXPERTS`) the switching rule
    picks for the request after the last of ``trace``, and the leader changes on the way.

    This is the selection of :func:`run` (same experts, same replays, same rule), asked at
    the end of the trace instead of before each request; the live advisor uses it
    (:class:`LiveSelector`).

    Raises:
        ValueError: ``capacity`` < 1.
    """
    sel = select(trace, capacity, settings)
    return sel.leader, sel.switches


@dataclass(frozen=True)
class Selection:
    """What the live advisor takes from one replay of its window (:func:`select`).

    Attributes:
        leader: index into :data:`EXPERTS` of the expert to follow after the trace.
        switches: leader changes on the way.
        superseded: bool ``[blocks]`` by dense id: the blocks ``prefix_value`` ranks below
            every other block at the end of the trace (its "Superseded first" rule,
            :func:`advisor.policy.eviction.prefix_value.superseded_first`).
        returns: the gaps ``finish_aware`` learned (its ranking's input,
            :class:`advisor.policy.eviction.finish_aware.ReturnTimes`).
    """

    leader: int
    switches: int
    superseded: np.ndarray
    returns: finish_aware.ReturnTimes | None = None


def select(trace: CompactTrace, capacity: int, settings: SelectorSettings | None = None) -> Selection:
    """:func:`next_leader`'s leader and switches and, from the same replay of
    ``prefix_value``, the blocks its superseded-first rule ranks first (one replay per expert).

    Raises:
        ValueError: ``capacity`` < 1.
    """
    if capacity < 1:
        raise ValueError(f"need capacity >= 1, got {capacity}")
    if trace.requests == 0:
        return Selection(EXPERTS.index((settings or SelectorSettings()).initial), 0,
                         np.zeros(trace.n_blocks, dtype=np.bool_))
    pv_hits, superseded = prefix_value.superseded_first(trace, capacity)
    fa_hits, returns = finish_aware.learn(trace, capacity)
    lead = _leaders(expert_hits(trace, capacity, {"prefix_value": pv_hits, "finish_aware": fa_hits}),
                    np.diff(trace.offsets), capacity, settings)
    return Selection(int(lead[-1]), int((lead[1:] != lead[:-1]).sum()), superseded, returns)


@numba.njit(cache=True)
def _mirror(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, leader: np.ndarray,
            tail_first: np.ndarray, ev_key: np.ndarray, ev_blk: np.ndarray, sn_key: np.ndarray,
            sn_blk: np.ndarray, refill_rate: float) -> tuple:
    prev, nxt, head, tail, size = new_lists(n_blocks, 2)  # 0 = held and wanted by the leader, 1 = orphans
    state = np.zeros(n_blocks, dtype=np.int8)  # 0 = not held, 1 = wanted, 2 = orphan
    mark = np.zeros(n_blocks, dtype=np.int64)  # == gen: the leader holds it
    refpos = np.full(n_blocks, -1, dtype=np.int64)  # index in flat of a block's last reference served
    n_req = offsets.shape[0] - 1
    hits = np.zeros(n_req, dtype=np.int64)
    queue = np.zeros(n_blocks, dtype=np.int64)  # refill promotions of the current spell, in order
    qh = 0
    qt = 0
    credit = 0.0
    promoted = new_log()  # (request, block) of each refill promotion
    gen = 0
    e = 0
    s = 0
    fallbacks = 0
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        if i == 0 or leader[i] != leader[i - 1]:  # a switch: re-sort R by the new leader's contents
            gen += 1
            while s < sn_key.shape[0] and (sn_key[s] >> 32) < i:
                s += 1
            s0 = s
            while s < sn_key.shape[0] and (sn_key[s] >> 32) == i:
                mark[sn_blk[s]] = gen
                s += 1
            x = tail[1]
            while x >= 0:
                p = prev[x]
                if mark[x] == gen:
                    unlink(prev, nxt, head, tail, size, 1, x)
                    push_head(prev, nxt, head, tail, size, 0, x)
                    state[x] = 1
                x = p
            x = tail[0]
            while x >= 0:
                p = prev[x]
                if mark[x] != gen:
                    unlink(prev, nxt, head, tail, size, 0, x)
                    push_head(prev, nxt, head, tail, size, 1, x)
                    state[x] = 2
                x = p
            qh = 0  # refill: the new leader's blocks R lacks, most recently referenced first
            qt = 0
            credit = 0.0
            if i > 0 and refill_rate > 0:
                for t in range(s0, s):
                    if state[sn_blk[t]] == 0:
                        queue[qt] = sn_blk[t]
                        qt += 1
                if qt > 1:
                    order = np.argsort(-refpos[queue[:qt]], kind="mergesort")
                    queue[:qt] = queue[:qt][order]
        if qh < qt:  # promote what the budget allows, into room taken from orphans only
            credit += refill_rate * (offsets[i] - offsets[i - 1])
            while qh < qt and credit >= 1.0:
                v = queue[qh]
                qh += 1
                if mark[v] != gen or state[v] != 0:
                    continue  # the leader evicted it since, or a request brought it back
                if size[0] + size[1] >= capacity:
                    if size[1] == 0:  # R is all the leader's (cannot be while it holds v too): stop
                        qh = qt
                        break
                    w = tail[1]
                    unlink(prev, nxt, head, tail, size, 1, w)
                    state[w] = 0
                push_head(prev, nxt, head, tail, size, 0, v)
                state[v] = 1
                credit -= 1.0
                promoted[0].append(np.int64(i))
                promoted[1].append(np.int64(v))
        j = a
        while j < b and state[flat[j]] != 0:
            j += 1
        hits[i] = j - a
        tf = tail_first[leader[i]]
        for k in range(b - a):  # in the leader's order
            j = served(a, b, k, tf)
            x = flat[j]
            refpos[x] = j
            if state[x] != 0:
                unlink(prev, nxt, head, tail, size, state[x] - 1, x)
            push_head(prev, nxt, head, tail, size, 0, x)
            state[x] = 1
            mark[x] = gen
        while e < ev_key.shape[0] and (ev_key[e] >> 32) < i:
            e += 1
        while e < ev_key.shape[0] and (ev_key[e] >> 32) == i:
            v = ev_blk[e]
            pos = ev_key[e] & 0xFFFFFFFF
            e += 1
            if refpos[v] >= a and (b - 1 - refpos[v] if tf else refpos[v] - a) > pos:
                continue  # referenced again later in the same request: the leader holds it
            mark[v] = 0
            if state[v] == 1:
                unlink(prev, nxt, head, tail, size, 0, v)
                push_head(prev, nxt, head, tail, size, 1, v)
                state[v] = 2
        while size[0] + size[1] > capacity:
            if size[1] > 0:
                v = tail[1]
                unlink(prev, nxt, head, tail, size, 1, v)
            else:
                v = tail[0]
                unlink(prev, nxt, head, tail, size, 0, v)
                fallbacks += 1
            state[v] = 0
    rq, rb = as_arrays(promoted)
    return hits, fallbacks, rq, rb


def _sorted_log(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    keys = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    blks = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    return keys[order], blks[order]


def run(trace: CompactTrace, capacity: int, settings: SelectorSettings | None = None,
        known: Mapping[str, np.ndarray] | None = None, leader: np.ndarray | None = None) -> SelectorRun:
    """Replay the default policy: every expert, the switching rule, the mirrored real tier.

    Args:
        trace: the compact trace.
        capacity: the tier's capacity in blocks (>= 1).
        settings: the switching rule's settings.
        known: experts' hits per request already replayed at this capacity (by name), to
            skip their first replay.
        leader: a fixed schedule (int8 ``[requests]``, indices into :data:`EXPERTS`) in place
            of the switching rule (tests, what-if runs).

    Raises:
        ValueError: ``capacity`` < 1, or ``leader`` has the wrong shape or an index out of range.
    """
    if capacity < 1:
        raise ValueError(f"need capacity >= 1, got {capacity}")
    n_req = trace.requests
    hits = expert_hits(trace, capacity, known)
    lengths = np.diff(trace.offsets)
    if leader is None:
        leader = schedule(hits, lengths, capacity, settings)
    elif leader.shape != (n_req,) or (n_req and (leader.min() < 0 or leader.max() >= len(EXPERTS))):
        raise ValueError(f"leader must be {n_req} indices in [0, {len(EXPERTS)})")
    leader = leader.astype(np.int8)
    start = np.ones(n_req, dtype=np.bool_)
    start[1:] = leader[1:] != leader[:-1]
    evs, sns = [], []
    for e, name in enumerate(EXPERTS):
        mine = leader == e
        if mine.any():
            _, ev, sn = _REPLAY[name](trace, capacity, mine, mine & start)
            evs.append(ev)
            sns.append(sn)
    ev_key, ev_blk = _sorted_log(evs)
    sn_key, sn_blk = _sorted_log(sns)
    tail_first = np.array([name in TAIL_FIRST for name in EXPERTS], dtype=np.bool_)
    rate = (settings or SelectorSettings()).refill_rate
    real, fallbacks, at, blocks = _mirror(trace.flat, trace.offsets, trace.n_blocks, capacity, leader, tail_first,
                                          ev_key, ev_blk, sn_key, sn_blk, float(rate))
    followed = hits[leader.astype(np.int64), np.arange(n_req)]
    return SelectorRun(real, leader, hits, int(start[1:].sum()), int(fallbacks), followed, at, blocks)


def simulate(trace: CompactTrace, capacity: int, settings: SelectorSettings | None = None,
             known: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) of the real tier under the default policy."""
    return run(trace, capacity, settings, known).hits


_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
CLOCK_AHEAD_S = 5.0
"""An arrival further ahead of the host's clock than this (s) is not taken (:meth:`LiveSelector.observe`)."""


def _block_states(reqs: list[tuple[int, ...]], finishes: RequestFinishes) -> dict[int, tuple[int, float]]:
    """``{u64 hash: (state, since s)}`` at the end of the window (:meth:`LiveSelector.finish_states`)."""
    end = float(finishes.arrival[-1]) if len(reqs) else 0.0
    out: dict[int, tuple[int, float]] = {}
    for req, a, f, c in zip(reqs, finishes.arrival.tolist(), finishes.finish.tolist(), finishes.reason.tolist()):
        st = (finish_aware.IN_FLIGHT, a) if f > end else (int(c), f)
        for h in req:
            out[h & _MASK] = st
    return out


class WindowRequest(NamedTuple):
    """One request of a :class:`LiveSelector`'s window.

    Attributes:
        path: its blocks, first block first, as int64 ids (the sequence hashes' u64 bits
            read signed, the kernels' ids).
        arrival_s: when it was seen (s, the batches' clock).
        run_start: index in ``path`` of its first stored block (before it: ancestors).
        finish_s: when it finished, from a Store's ``finish_reason`` (s; -1: not known).
        reason: the class of that finish reason (:func:`finish_aware.finish_class`).
    """

    path: tuple[int, ...]
    arrival_s: float
    run_start: int
    finish_s: float
    reason: int


class LiveSelector:
    """The live advisor's expert selection: :func:`next_leader` over a window of the
    requests the event stream shows, on a hashed sample of prefixes.

    **What is a request.**  A worker Stores the blocks of a request it served, each with
    its parent; a run of Store events in one batch at an engine tier (``locations``,
    default ``g1``/``g2``), each the child of the one before, is one request.  Its path is
    the first block's ancestors (walked back through ``parent_of``, the index, at most
    ``max_path`` blocks: the prefix the request read) then the run, so a request that
    stored only its new blocks still references its whole prefix, as in the evaluator's
    traces.  Batches of ``skip_source`` (the advisor's own moves) are not requests.

    **Shadow caches over a hashed sample.**  A request is kept when the hash of its first
    block falls in the sample (``sample_rate``, Waldspurger et al., USENIX ATC 2017): the
    sample is closed under prefixes (a kept request keeps its whole path and every request
    sharing its root is kept too), so a prefix hit of the sample is a prefix hit of the
    trace.  Each expert replays the window alone on a cache of ``capacity × sample_rate``
    blocks (a miniature of the tier) with the evaluator's own kernels, and the evaluator's
    switching rule (:func:`next_leader`, module docstring) picks the leader after the
    window's last request.  At ``sample_rate = 1`` the leader is exactly the one
    ``kvadvisor evaluate`` would follow after the same requests (tested).

    **Cost and quota.**  The window holds at most ``max_window_refs`` block references
    (the oldest requests leave first; 8 bytes a reference); :meth:`refresh` replays it
    once per expert (E = 8 compiled replays, O(window) each) and only when
    ``min_new_refs`` references arrived since the last refresh.  The replays start cold
    at the window's first request, so the leader is the one of a selector that began
    there; a window shorter than the miniature cache's turnover shows no expert ahead and
    keeps the first leader (``settings.initial``).

    **Finish reasons.**  The ``finish_aware`` expert replays each window request with its
    arrival (the batch's ``ts_ns``), finish time and finish-reason class
    (:mod:`advisor.policy.eviction.finish_aware`).  A finish comes either in the batch (a
    Store of the run with ``extra_metadata = {"finish_reason": ...}`` from a publisher of
    ``finish_sources``: the request finished when it was stored) or later from a router
    (:meth:`finished`, ``POST /v1/finished``: the prompt's sequence hashes, matched to the
    latest window request that arrived by then and whose Store run holds the deepest of
    them; one request per hint).  Arrivals, hints and the ranking's "now" are on one
    clock, the batches' (:meth:`clock_now`).  At most ``max_hints`` router hints are kept (the
    quota of that state), shared by the routers: each hint names its client (a digest of the
    API token), and past the quota the oldest hint of the client holding the most goes first
    (longest queue drop, as the prefetch queue, :mod:`advisor.moves.prefetch`), so a token
    that floods hints cannot push out another router's; a request without either has finished with
    no reason known at its arrival (the ``unknown`` state, prefix-LRU's order).
    :attr:`returns` holds the gaps the expert learned and :meth:`finish_states` each
    window block's state, the live ranking's inputs when it leads.

    **Superseded branches.**  The same replay of ``prefix_value`` tells which of the
    window's blocks its "Superseded first" rule ranks below every other block
    (:func:`select`); :attr:`superseded` holds their sequence hashes after each refresh (at
    most the window's distinct blocks), and the live ranking puts them first when it
    follows ``prefix_value`` (:mod:`advisor.policy.eviction.live_scoring`), as the
    evaluator's tier does.  Blocks of unsampled prefixes are never in it.

    Args:
        sample_rate: fraction of prefixes (by root hash) kept, in (0, 1].
        max_window_refs: block references kept (>= 1).
        min_new_refs: references observed between two replays (>= 1).
        settings: the switching rule (default :class:`SelectorSettings`, the evaluator's).
        max_path: longest path taken from one request, in blocks.
        locations: storage locations whose Stores are requests.
        max_hints: router finish hints kept (:meth:`finished`).
        finish_sources: publishers whose Stores' ``finish_reason`` is taken (the others'
            is ignored: a publisher could mark its own prefixes ``tool_calls`` to keep them).

    Raises:
        ValueError: a setting out of range.
    """

    def __init__(self, sample_rate: float = 1.0, max_window_refs: int = 1 << 20, min_new_refs: int = 1,
                 settings: SelectorSettings | None = None, max_path: int = 4096,
                 locations: Iterable[str] = ("g1", "g2"), max_hints: int = 1 << 16,
                 finish_sources: Iterable[str] = ()) -> None:
        if not 0.0 < sample_rate <= 1.0 or max_window_refs < 1 or min_new_refs < 1 or max_path < 1 or max_hints < 0:
            raise ValueError(f"need 0 < sample_rate <= 1, max_window_refs, min_new_refs, max_path >= 1 and "
                             f"max_hints >= 0, got {sample_rate}, {max_window_refs}, {min_new_refs}, {max_path}, "
                             f"{max_hints}")
        self.sample_rate = float(sample_rate)
        self.max_window_refs = int(max_window_refs)
        self.min_new_refs = int(min_new_refs)
        self.settings = settings or SelectorSettings()
        self.max_path = int(max_path)
        self.locations = frozenset(locations)
        self._limit = int(self.sample_rate * float(1 << 64)) if sample_rate < 1.0 else 1 << 64
        self._window: deque[WindowRequest] = deque()
        self.max_hints = int(max_hints)
        self._hints: OrderedDict[int, tuple[float, int]] = OrderedDict()  # deepest prompt hash -> (finish s, class)
        self._hint_owner: dict[int, str] = {}  # deepest prompt hash -> the client that hinted it
        self._client_hints: dict[str, OrderedDict[int, None]] = {}  # client -> its hints, oldest first
        self.hints_dropped = 0
        """Router finish hints dropped by the ``max_hints`` quota."""
        self.returns: finish_aware.ReturnTimes | None = None
        """The gaps ``finish_aware`` learned in the latest refresh (class docstring)."""
        self._states: dict[int, tuple[int, float]] | None = None
        self.finish_sources = frozenset(finish_sources)
        self.latest_s = 0.0
        """Latest arrival observed (s, the batches' clock): "now" of the live ranking's ages."""
        self._latest_at = 0.0  # host time when latest_s last advanced
        self.clock_refused = 0
        """Arrivals not taken: more than :data:`CLOCK_AHEAD_S` ahead of the host's clock, or not a number."""
        self._refs = 0
        self._new = 0
        self._lock = threading.Lock()
        self.leader_index = EXPERTS.index(self.settings.initial)
        self.requests = 0
        """Requests observed (sampled or not)."""
        self.switches = 0
        """Times :meth:`refresh` changed the leader."""
        self.block_bytes = 0
        """Bytes per block of the latest Store seen (0 before any): converts a tier's bytes to blocks."""
        self.superseded: frozenset[int] = frozenset()
        """Sequence hashes (u64) that ``prefix_value`` ranks first after the latest refresh (class docstring)."""

    @property
    def leader(self) -> str:
        """Name of the expert the live advisor follows (one of :data:`EXPERTS`)."""
        return EXPERTS[self.leader_index]

    def sampled(self, root: int) -> bool:
        """Whether prefixes rooted at block ``root`` are in the sample."""
        return ((root * _GOLDEN) & _MASK) < self._limit

    def observe(self, path: Sequence[int], root: int | None = None, arrival_s: float | None = None,
                run_start: int = 0, finish_reason: str | None = None) -> None:
        """One request: its blocks, first block first; kept when its root (``root``, default
        ``path[0]``) is sampled.

        Args:
            path: sequence hashes (u64), the prefix read then the blocks stored.
            root: the hash that decides the sample (default ``path[0]``).
            arrival_s: when it was seen (s, the batches' clock, Unix epoch; default: that
                clock now, :meth:`clock_now`); one more than :data:`CLOCK_AHEAD_S` ahead
                of the host's clock, or not a number, is taken as the latest arrival
                instead (one publisher's clock cannot move the others' ages or erase
                their gaps), and counted in ``clock_refused``.
            run_start: index in ``path`` of its first stored block (before it: ancestors).
            finish_reason: how its answer ended, when the batch says so (it has finished).
        """
        if not path:
            return
        self.requests += 1
        if not self.sampled(path[0] if root is None else root):
            return
        # sequence hashes are u64, the kernels' ids int64: the same bits, read signed
        req = tuple(h - (1 << 64) if h >= 1 << 63 else h for h in path[: self.max_path])
        with self._lock:
            t = self._arrival(arrival_s)
            self._window.append(WindowRequest(req, t, min(max(int(run_start), 0), len(req)),
                                              t if finish_reason is not None else -1.0,
                                              finish_aware.finish_class(finish_reason)))
            self._refs += len(req)
            self._new += len(req)
            while self._refs > self.max_window_refs and len(self._window) > 1:
                self._refs -= len(self._window.popleft().path)

    def finished(self, hashes: Sequence[int], finish_reason: str | None, at_s: float | None = None,
                 client: str = ANONYMOUS) -> bool:
        """A router's word that the request whose prompt is ``hashes`` finished, and how
        (class docstring, "Finish reasons"); ``False`` when ``hashes`` is empty.

        Args:
            hashes: the prompt's sequence hashes (u64), first block first.
            finish_reason: ``tool_calls``, ``stop``, ``length``, ... (:data:`finish_aware.FINISH_CLASSES`).
            at_s: when it finished (s, the batches' clock; default: that clock now,
                :meth:`clock_now`, so a router's hint and the workers' Stores share one clock).
            client: who hinted (the quota's share, class docstring; :func:`api.auth.client_id`
                of the API token).
        """
        if not hashes or self.max_hints == 0 or (at_s is not None and not math.isfinite(at_s)):
            return False
        h = int(hashes[-1])
        key = h - (1 << 64) if h >= 1 << 63 else h
        with self._lock:
            t = self._clock_now() if at_s is None else float(at_s)
            self._forget_hint(key)
            self._hints[key] = (t, finish_aware.finish_class(finish_reason))
            self._hint_owner[key] = client
            self._client_hints.setdefault(client, OrderedDict())[key] = None
            while len(self._hints) > self.max_hints:  # the longest holder's oldest hint goes
                longest = max(self._client_hints, key=lambda c: len(self._client_hints[c]))
                self._forget_hint(next(iter(self._client_hints[longest])))
                self.hints_dropped += 1
        return True

    def _forget_hint(self, key: int) -> None:
        """Drop the hint on ``key`` if any (caller holds the lock)."""
        if self._hints.pop(key, None) is None:
            return
        client = self._hint_owner.pop(key)
        mine = self._client_hints[client]
        del mine[key]
        if not mine:
            del self._client_hints[client]

    def clock_now(self) -> float:
        """The batches' clock now (s): the latest arrival, moved on by the host time passed
        since it was seen (the host's clock before any arrival)."""
        with self._lock:
            return self._clock_now()

    def _clock_now(self) -> float:
        host = time.time()
        return host if self._latest_at == 0.0 else self.latest_s + max(host - self._latest_at, 0.0)

    def _arrival(self, arrival_s: float | None) -> float:
        """The arrival kept for a request (caller holds the lock; :meth:`observe`)."""
        host = time.time()
        if arrival_s is None:
            t = self._clock_now()
        elif not math.isfinite(arrival_s) or arrival_s > host + CLOCK_AHEAD_S:
            self.clock_refused += 1
            t = self.latest_s if self._latest_at else host
        else:
            t = float(arrival_s)
        if t > self.latest_s or not self._latest_at:
            self.latest_s, self._latest_at = max(t, self.latest_s), host
        return t

    def window(self) -> list[WindowRequest]:
        """The window's requests, oldest first (a copy)."""
        with self._lock:
            return list(self._window)

    @staticmethod
    def _finishes(window: Sequence[WindowRequest], hints: Mapping[int, tuple[float, int]]) -> RequestFinishes:
        """Each window request's arrival (made non-decreasing), finish and reason: its own
        (a Store's ``finish_reason``), else the router hint on the deepest hash of its Store
        run, taken by the latest request that arrived by the hint's time and by no other."""
        n = len(window)
        arrival = (np.maximum.accumulate(np.array([w.arrival_s for w in window], dtype=np.float64)) if n
                   else np.zeros(0))
        finish = arrival.copy()
        reason = np.zeros(n, dtype=np.int8)
        taken: set[int] = set()
        for k in range(n - 1, -1, -1):
            w = window[k]
            if w.finish_s >= 0:
                finish[k], reason[k] = max(w.finish_s, arrival[k]), w.reason
                continue
            if not hints:
                continue
            for h in reversed(w.path[w.run_start:]):
                hint = hints.get(h)
                if hint is not None and h not in taken and hint[0] >= arrival[k]:
                    taken.add(h)
                    finish[k], reason[k] = hint[0], hint[1]
                    break
        return RequestFinishes(arrival, finish, reason)

    def observe_batch(self, batch: object, parent_of: Callable[[int], int | None],
                      skip_source: str | None = None) -> int:
        """Take the requests of one event batch (class docstring); returns how many.

        The sample is decided on each run's ``prefix_hash`` (its chain's first block)
        before its ancestors are walked, so an unsampled request costs no index lookups.

        Args:
            batch: an :class:`event_plane.schema.EventBatch` (``source``, ``events``).
            parent_of: the parent of a known block (``None``: a first block or unknown).
            skip_source: a source whose batches are not requests.
        """
        if skip_source is not None and getattr(batch, "source", None) == skip_source:
            return 0
        runs: list[tuple[int, int | None, list[int]]] = []
        run: list[int] = []
        reasons: dict[int, str] = {}  # run number -> finish reason of a Store of the run
        ts = getattr(batch, "ts_ns", None)
        arrival = ts / 1e9 if isinstance(ts, int) and ts > 0 else None
        trusted = getattr(batch, "source", None) in self.finish_sources
        for ev in getattr(batch, "events", ()):
            if int(ev.type) != 0 or ev.storage_location not in self.locations:  # 0 = STORE
                continue
            if block := int(ev.block_size):
                self.block_bytes = block
            if not (run and ev.parent_hash == run[-1]):
                run = [ev.sequence_hash]
                runs.append((int(ev.prefix_hash), ev.parent_hash, run))
            else:
                run.append(ev.sequence_hash)
            meta = ev.extra_metadata
            if meta and trusted and isinstance(why := meta.get("finish_reason"), str):
                reasons[len(runs) - 1] = why[:64]
        for k, (root, parent, r) in enumerate(runs):
            if self.sampled(root):
                path = self._path(r, parent, parent_of)
                self.observe(path, root, arrival, len(path) - len(r), reasons.get(k))
            else:
                self.requests += 1
        return len(runs)

    def _path(self, run: list[int], parent: int | None, parent_of: Callable[[int], int | None]) -> list[int]:
        head: list[int] = []
        seen = set(run)
        p = parent
        while p is not None and p not in seen and len(head) + len(run) < self.max_path:
            seen.add(p)
            head.append(p)
            p = parent_of(p)
        head.reverse()
        return head + run

    def refresh(self, capacity_blocks: int) -> str:
        """Replay the window (class docstring) for a tier of ``capacity_blocks`` blocks and
        return the leader's name; without ``min_new_refs`` new references, the current one.

        Raises:
            ValueError: ``capacity_blocks`` < 1.
        """
        if capacity_blocks < 1:
            raise ValueError(f"need capacity_blocks >= 1, got {capacity_blocks}")
        with self._lock:
            if self._new < self.min_new_refs or not self._window:
                return self.leader
            window = list(self._window)
            hints = dict(self._hints)
            self._new = 0
        reqs = [w.path for w in window]
        finishes = self._finishes(window, hints)
        trace = compact(reqs, finishes)
        # a tier larger than the window's distinct blocks never evicts: replay no larger one
        # (the block size comes from the latest Store, any publisher's: 1 byte would ask for
        # a tier of 10^12 blocks)
        cap = max(1, min(round(capacity_blocks * self.sample_rate), trace.n_blocks))
        sel = select(trace, cap, self.settings)
        lead = sel.leader
        assert trace.keys is not None
        self.superseded = frozenset(int(k) & _MASK for k in trace.keys[sel.superseded])  # back to u64
        self.returns = sel.returns
        self._states = _block_states(reqs, finishes) if EXPERTS[lead] == "finish_aware" else None
        if lead != self.leader_index:
            self.switches += 1
            self.leader_index = lead
        return self.leader

    def finish_states(self) -> Mapping[int, tuple[int, float]]:
        """Sequence hash (u64) → ``(state, since s)`` of each window block after the latest
        refresh that ``finish_aware`` led: the state of the latest request that referenced
        it (:data:`finish_aware.IN_FLIGHT` or a finish class) and that request's finish
        (arrival while in flight), as its kernel sees them at the window's end.  Empty
        when another expert leads."""
        return self._states or {}

    def stats(self) -> dict[str, object]:
        """``leader``, ``switches``, ``requests`` observed, ``window_requests``, ``window_refs``
        and ``superseded_blocks`` (blocks ranked first when ``prefix_value`` leads)."""
        with self._lock:
            return {"leader": self.leader, "switches": self.switches, "requests": self.requests,
                    "window_requests": len(self._window), "window_refs": self._refs,
                    "superseded_blocks": len(self.superseded), "finish_hints": len(self._hints),
                    "finish_hint_clients": len(self._client_hints),
                    "finish_hints_dropped": self.hints_dropped, "clock_refused": self.clock_refused}


__all__ = ["CLOCK_AHEAD_S", "EXPERTS", "TAIL_FIRST", "LiveSelector", "Selection", "SelectorRun", "SelectorSettings",
           "WindowRequest", "expert_hits",
           "next_leader", "run", "schedule", "select", "simulate"]
