"""Prefix-value eviction with an adaptive memory: the default policy of the evaluator.

priority(block) = last reference clock + horizon × P(reuse | class of the block)

* ``clock`` counts block references; ``horizon`` = ``horizon_multiplier`` × the mean
  observed reuse distance (clock ticks), so one setting fits every capacity and trace.
* The *class* of a block at a reference is ``(times referenced before (capped), blocks
  from the request's end (capped), whether the request continued a known prefix)``;
  ``P(reuse | class)`` is learned online (a reference credits the class its block had at
  its previous reference), with a prior.  The last, partial block of a request is almost
  never reused; a block referenced again is reused far more often than a new one.
* **Censored estimate** of ``P(reuse | class)``: a reference whose block has not been
  referenced again counts as a miss of its class only once it is older than
  ``censor_after`` × the mean observed reuse distance; until then its outcome is unknown
  and it is not counted (right-censoring, as in survival analysis).  ``P = reuses /
  (reuses + misses)``, smoothed by the prior.  Counting every reference at once
  (``censor_after = 0``, the former estimator) biases the classes whose reuses come late
  towards 0, most of all in the first thousands of requests of a trace (docs/BENCHMARKS.md,
  "The `prefix_value` expert").
* **Memory window** (the adaptivity, after ARC's ghost directory — N. Megiddo and D. S.
  Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", USENIX FAST 2003 — which
  remembers only about ``2c`` recent ids): a block's history is forgotten when it has not
  been referenced for ``window × capacity`` ticks, so it counts as new again.  The window
  is tuned online by two shadow replays of the same requests with half and twice the
  current window (miniature simulations, C. A. Waldspurger et al., "Cache Modeling and
  Optimization using Miniature Simulations", USENIX ATC 2017, here at full size): every
  ``adapt_every × capacity`` ticks the window moves by ``adapt_step`` towards the shadow
  that hit more, between ``min_window`` and ``max_window``, if the two shadows' hit counts
  ``h1, h2`` differ by more than ``adapt_z × sqrt(h1 + h2 + 1)`` (a Poisson noise bound);
  otherwise the counts keep accumulating into the next period (``adapt_z = 0``: move on
  any difference and restart the counts every period, the former tuner).
* **Superseded branches**: when a request continues a known prefix (more than its first
  block known) and then leaves it at block ``d``, the child of ``d`` that the most recent
  earlier request through ``d`` took (its *branch*) is superseded: the conversation went
  on along another path.  The superseded block moves to a class of its own (one for a
  block referenced once, one for a block referenced more often), learned online like the
  others, and its priority is recomputed from its last reference with that class's
  ``P(reuse)``; evicting it takes its cached descendants (cascade below).  On the Mooncake
  conversation trace a child of ``d`` that had been referenced once is referenced again after
  such a request in 7 of 5,337 cases (0.13 %), against 28 % for a new block of a new request
  (docs/BENCHMARKS.md, "The `prefix_value` expert").
* **Superseded first**: a newly superseded branch leaves before every other block
  (priority ``last − SUPERSEDED_FIRST``), not a horizon-weighted amount earlier, when
  three tests pass.  Why: a branch of a conversation that went on elsewhere (a context
  compacted or edited below its system prompt, a finished sub-agent) holds blocks that
  recency ranks with the live ones; on the WEKA agentic-coding traces 197 of the 207
  branches of more than one block superseded at a fork (98 % of their 253,863 blocks)
  were never referenced again (``bench/evaluator.py --supersessions``), and acting on it
  takes the 200,000-block tier from 17.6 % to 43 % of the LRU→Belady gap
  (docs/BENCHMARKS.md, "Advisor policies").  The tests:

  1. *Its kind has proved dead*: the gate's ``P(reuse)`` for the kind of the branch is
     below ``supersede_first_below``.  Two kinds, each with its own estimate: the previous
     request's one-off last block (a chat turn's, replaced by the next turn's full block)
     and a branch of more than one block.  Pooled, thousands of dead last blocks opened
     the gate for the few real branches, a third of which came back (tree-of-thought
     samples, sub-agents under chat traffic: up to −0.0063 at a third of the footprint;
     tested).  One estimate per trace (the three instances share it): a supersession's
     outcome is decided once ``supersede_censor_after`` × the mean distance at which
     superseded blocks of its kind were referenced again (``initial_horizon`` before any
     was) has passed, a reuse if it was referenced in between, else a miss, with the
     class prior.  The wait is the superseded blocks' own: siblings under a header of
     several blocks are "superseded" whenever another is read and come back a whole cycle
     later, and waiting for the mean reuse distance of all blocks (the header's short one)
     judged them dead first, so the rule acted like MRU on a loop (−0.015 on the synthetic
     loop at 9/10 of its footprint; tested).  The factor 4 (twice ``censor_after``) waits
     for returns with a longer tail than ordinary reuses; it was chosen on the synthetic
     suite and variants at seeds 1,000–3,000 (rows below best − 0.002, measured before the
     other two tests: 16 of 144 with 2, 14 with 4, 13 without the rule) and checked with
     all three on seeds 4,000–6,000 (18 of 144, as without the rule).
  2. *At a fork*: ``d`` had fewer than ``supersede_max_fork`` children before the request.
     A conversation forks a few times below its system prompt (compactions, sub-agents); a
     header that many requests share has as many children as requests that read it, and a
     sibling read there says nothing of the others (tested).  Without this test the rule
     evicted a new working set's live siblings before the old set's dead blocks after each
     shift of the synthetic "shifting" case (−0.0080 against −0.0037 at 9/10 of its
     footprint, seed 4,000).
  3. Supersession itself (above): the request continued a known prefix of more than one
     block.

  Where the rule does not act, the branch keeps its class's priority, and that class's
  trial counts take each supersession at once (as before the rule).
* Prefix structure: within a request a block's priority never exceeds its parent's
  (leaves go first, a parent is worth at least its children), and evicting a block evicts
  its cached descendants (a block without its parent can never be hit).
* Lookahead (``lookahead`` = K > 0): the next K requests are visible, as a router's lookup
  or a scheduler's queue makes them.  A cached block due in the window is evicted last
  (the farthest due first), and a visible request's blocks that were seen before (so sit
  on a lower tier) are promoted before it runs, up to the first never-seen block.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace
from advisor.policy.eviction.evlog import as_arrays, log_eviction, new_log, no_logging

BIG = 1.0e18
SUPERSEDED_FIRST = 1.0e17  # a superseded branch's priority: its last reference minus this
N_INST = 3  # 0 = the real tier, 1 = shadow with window / step, 2 = shadow with window × step


@dataclass(frozen=True)
class PrefixValueSettings:
    """Settings of the default policy (one set for every trace and capacity).

    Attributes:
        horizon_multiplier: horizon = this × mean observed reuse distance (ticks).
        initial_horizon: horizon (ticks) before any reuse was observed.
        max_seen: "times referenced before" is capped at this value in the class.
        max_from_end: "blocks from the request's end" is capped at this value.
        prior_reuse: prior P(reuse) of a class, with pseudo-count ``prior_weight``.
        prior_weight: pseudo-count of the prior.
        initial_window: memory window at start, in multiples of the capacity (ticks).
        min_window: smallest window (× capacity).
        max_window: largest window (× capacity); at this value nothing is forgotten.
        adapt_step: factor between the window and its shadows, and of one move.
        adapt_every: adaptation period, in multiples of the capacity (ticks).
        supersede: move superseded branches to their own classes (module docstring).
        censor_after: a reference not yet followed by a reuse counts as a miss once older
            than this × the mean observed reuse distance (0 = at once, the former estimator).
        adapt_z: the window moves only when the shadows' hit counts differ by more than
            this × sqrt(their sum + 1) (0 = on any difference, counts restarted every period).
        supersede_first_below: a superseded branch leaves before every other block while
            the learned ``P(reuse)`` of its kind (one-off last block, or longer branch) is
            below this (0 = never: it keeps the priority of its class, like any block;
            module docstring, "Superseded first").
        supersede_censor_after: for that estimate, a supersession's outcome is decided
            after this × the mean distance at which superseded blocks of its kind were
            referenced again (module docstring).
        supersede_max_fork: the rule acts only where the fork block ``d`` had fewer than
            this many children before the request (a conversation's fork, not a header
            shared by many requests; module docstring).
    """

    horizon_multiplier: float = 8.0
    initial_horizon: float = 100_000.0
    max_seen: int = 4
    max_from_end: int = 1
    prior_reuse: float = 0.3
    prior_weight: float = 1.0
    initial_window: float = 8.0
    min_window: float = 1.0
    max_window: float = 64.0
    adapt_step: float = 2.0
    adapt_every: float = 4.0
    supersede: bool = True
    censor_after: float = 2.0
    adapt_z: float = 2.0
    supersede_first_below: float = 0.05
    supersede_censor_after: float = 4.0
    supersede_max_fork: int = 4

    def __post_init__(self) -> None:
        if not (self.horizon_multiplier > 0 and self.initial_horizon > 0 and self.prior_weight > 0):
            raise ValueError("horizon_multiplier, initial_horizon and prior_weight must be > 0")
        if self.max_seen < 0 or self.max_from_end < 0 or not 0.0 <= self.prior_reuse <= 1.0:
            raise ValueError("max_seen, max_from_end must be >= 0 and prior_reuse in [0, 1]")
        if not 0 < self.min_window <= self.initial_window <= self.max_window:
            raise ValueError("need 0 < min_window <= initial_window <= max_window")
        if self.adapt_step <= 1.0 or self.adapt_every <= 0:
            raise ValueError("adapt_step must be > 1 and adapt_every > 0")
        if self.censor_after < 0 or self.adapt_z < 0:
            raise ValueError("censor_after and adapt_z must be >= 0")
        if not 0.0 <= self.supersede_first_below <= 1.0:
            raise ValueError(f"supersede_first_below must be in [0, 1], got {self.supersede_first_below}")
        if not self.supersede_censor_after > 0 or self.supersede_max_fork < 1:
            raise ValueError(f"need supersede_censor_after > 0 and supersede_max_fork >= 1, got "
                             f"{self.supersede_censor_after}, {self.supersede_max_fork}")
        if (self.max_seen + 1) * (self.max_from_end + 1) * 2 + 2 > 32767:
            raise ValueError("max_seen and max_from_end too large (the kernel keeps a class in an int16)")

    def as_array(self) -> np.ndarray:
        """The settings as the float64 vector the compiled kernel takes."""
        return np.array(astuple(self), dtype=np.float64)


@numba.njit(cache=True, inline="always")
def reuse_class(seen_before: int, from_end: int, continuation: int, max_seen: int, max_from_end: int) -> int:
    """Index of a block's class ``(times referenced before, blocks from the request's end,
    continuation)``, each capped as in :class:`PrefixValueSettings`.

    Args:
        seen_before: times the block was referenced before (>= 0).
        from_end: blocks between it and the end of its request (0 = last block, >= 0).
        continuation: 1 when the request continued a known prefix, else 0.
        max_seen / max_from_end: the caps.

    Returns:
        An int in ``[0, (max_seen + 1) × (max_from_end + 1) × 2)``.
    """
    return (min(seen_before, max_seen) * (max_from_end + 1) + min(from_end, max_from_end)) * 2 + continuation


@numba.njit(cache=True, inline="always")
def superseded_class(seen_before: int, max_seen: int, max_from_end: int) -> int:
    """Index of the class of a superseded branch (module docstring), after every
    :func:`reuse_class` index.

    Args:
        seen_before: times the block was referenced (>= 1: it was cached or seen).
        max_seen / max_from_end: the caps of :class:`PrefixValueSettings`.

    Returns:
        ``n + 0`` for a block referenced once, ``n + 1`` for one referenced more often,
        with ``n = (max_seen + 1) × (max_from_end + 1) × 2`` (the number of regular classes).
    """
    return (max_seen + 1) * (max_from_end + 1) * 2 + (1 if seen_before > 1 else 0)


@numba.njit(cache=True, inline="always")
def priority(last: float, horizon: float, reuses: float, inserts: float, prior: float, prior_weight: float,
             pos: int) -> float:
    """The policy's priority of a block (lower = evicted / demoted first).

    ``last + horizon × (reuses + prior_weight × prior) / (inserts + prior_weight) - pos × 1e-6``:
    the time of its last reference plus the horizon weighted by the smoothed
    ``P(reuse | class)`` of its class (module docstring); ``pos`` (its place in its request)
    breaks ties towards the leaves.  The evaluator's kernel and the live advisor
    (:mod:`advisor.policy.eviction.live_scoring`) both call this function.

    Args:
        last: last reference, in clock units (ticks in the evaluator, ns live).
        horizon: the horizon, same units.
        reuses / inserts: the class's counts: reuses credited, and the references whose
            outcome is counted (the kernel: reuses + censored misses, see the module
            docstring; the live scorer: every reference).
        prior / prior_weight: :attr:`PrefixValueSettings.prior_reuse` and ``prior_weight``.
        pos: the block's position in its request (0 = first).
    """
    return last + horizon * (reuses + prior_weight * prior) / (inserts + prior_weight) - pos * 1e-6


@numba.njit(cache=True, inline="always")
def _push(hkey: np.ndarray, hid: np.ndarray, hsize: np.ndarray, k: int, key: float, x: int) -> None:
    i = hsize[k]
    hsize[k] = i + 1
    while i > 0:
        p = (i - 1) >> 1
        if hkey[k, p] <= key:
            break
        hkey[k, i] = hkey[k, p]
        hid[k, i] = hid[k, p]
        i = p
    hkey[k, i] = key
    hid[k, i] = x


@numba.njit(cache=True, inline="always")
def _pop(hkey: np.ndarray, hid: np.ndarray, hsize: np.ndarray, k: int) -> tuple[float, int]:
    top_key = hkey[k, 0]
    top_id = hid[k, 0]
    n = hsize[k] - 1
    hsize[k] = n
    key = hkey[k, n]
    x = hid[k, n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and hkey[k, c + 1] < hkey[k, c]:
            c += 1
        if hkey[k, c] >= key:
            break
        hkey[k, i] = hkey[k, c]
        hid[k, i] = hid[k, c]
        i = c
    hkey[k, i] = key
    hid[k, i] = x
    return top_key, top_id


@numba.njit(cache=True)
def _rebuild(hkey: np.ndarray, hid: np.ndarray, hsize: np.ndarray, prio: np.ndarray, k: int) -> None:
    hsize[k] = 0
    for x in range(prio.shape[1]):
        if not np.isnan(prio[k, x]):
            _push(hkey, hid, hsize, k, prio[k, x], x)


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, parent: np.ndarray,
         next_use: np.ndarray, lookahead: int, promote: bool, params: np.ndarray,
         reuse_override: np.ndarray | None, want_ev: np.ndarray, want_snap: np.ndarray,
         promoted: np.ndarray) -> tuple:
    horizon_mult, initial_horizon = params[0], params[1]
    max_seen, max_from_end = int(params[2]), int(params[3])
    prior, prior_w = params[4], params[5]
    window, min_window, max_window = params[6], params[7], params[8]
    step, adapt_every = params[9], params[10]
    supersede = params[11] != 0.0
    censor_after, adapt_z = params[12], params[13]
    first_below, sup_censor_after, max_fork = params[14], params[15], int(params[16])
    n_fe = max_from_end + 1
    n_cls = (max_seen + 1) * n_fe * 2 + 2  # regular classes, then the two superseded ones
    n_req = offsets.shape[0] - 1
    max_len = 0
    for i in range(n_req):
        max_len = max(max_len, offsets[i + 1] - offsets[i])
    ins = np.zeros((N_INST, n_cls))
    reu = np.zeros((N_INST, n_cls))
    dist_sum = np.zeros(N_INST)
    dist_n = np.zeros(N_INST)
    seen = np.zeros((N_INST, n_blocks), dtype=np.int32)
    cls_of = np.zeros((N_INST, n_blocks), dtype=np.int32)
    prio = np.full((N_INST, n_blocks), np.nan)  # nan = not cached
    size = np.zeros(N_INST, dtype=np.int64)
    heap_cap = 4 * capacity + 1024 + 2 * max_len + 16
    hkey = np.empty((N_INST, heap_cap))
    hid = np.empty((N_INST, heap_cap), dtype=np.int32)
    hsize = np.zeros(N_INST, dtype=np.int64)
    last = np.zeros(n_blocks, dtype=np.int64)
    ever = np.zeros(n_blocks, dtype=np.bool_)
    branch = np.full(n_blocks, -1, dtype=np.int32)  # the child the latest request through a block took
    n_children = np.zeros(n_blocks, dtype=np.int32)  # distinct children seen so far
    first_child = np.full(n_blocks, -1, dtype=np.int32)
    sibling = np.full(n_blocks, -1, dtype=np.int32)
    for x in range(n_blocks):
        p = parent[x]
        if p >= 0:
            sibling[x] = first_child[p]
            first_child[p] = x
    stack = np.empty(n_blocks, dtype=np.int32)
    # censored estimate: the class of every reference, whether it was followed by a reuse,
    # each instance's misses per class, and the first reference whose outcome is still open
    n_refs = flat.shape[0]
    censor = censor_after > 0
    ref_cls = np.zeros((N_INST, n_refs if censor else 0), dtype=np.int16)
    ref_reused = np.zeros((N_INST, n_refs if censor else 0), dtype=np.bool_)
    prev_ref = np.full(n_blocks if censor else 0, -1, dtype=np.int64)
    misses = np.zeros((N_INST, n_cls))
    open_from = np.zeros(N_INST, dtype=np.int64)
    # the superseded-first gate, per kind (0 = the previous request's one-off last block,
    # 1 = a branch of more than one block): trials queued by kind, outcome known at maturity
    n_trials = n_req if supersede else 0  # at most one supersession per request
    trial_t = np.zeros((2, n_trials), dtype=np.int64)
    trial_blk = np.zeros((2, n_trials), dtype=np.int64)
    n_trial = np.zeros(2, dtype=np.int64)
    trial_open = np.zeros(2, dtype=np.int64)
    gate_reu = np.zeros(2)
    gate_miss = np.zeros(2)
    ret_sum = np.zeros(2)  # superseded blocks referenced again: distance from their supersession
    ret_n = np.zeros(2)
    sup_kind = np.full(n_blocks if supersede else 0, -1, dtype=np.int8)
    sup_since = np.zeros(n_blocks if supersede else 0, dtype=np.int64)
    sup_first = np.zeros(n_blocks if supersede else 0, dtype=np.bool_)  # acted on, not referenced since
    hits = np.zeros(n_req, dtype=np.int64)
    shadow_hits = np.zeros(N_INST)
    windows = np.array([window, window / step, window * step])
    clock = 0
    next_adapt = int(adapt_every * capacity)
    evl, snl = new_log(), new_log()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        n = b - a
        if want_snap[i]:
            for x in range(n_blocks):
                if not np.isnan(prio[0, x]):
                    log_eviction(snl, i, 0, x)
        for k in range(N_INST):
            j = a
            while j < b and not np.isnan(prio[k, flat[j]]):
                j += 1
            if k == 0:
                hits[i] = j - a
            shadow_hits[k] += j - a
        w = i + lookahead
        if lookahead > 0 and w < n_req:
            for k in range(N_INST):
                for jj in range(offsets[w], offsets[w + 1]):
                    x = flat[jj]
                    if np.isnan(prio[k, x]):
                        if not promote or not ever[x]:
                            break  # never seen: nothing to promote from a lower tier
                        size[k] += 1
                        if k == 0 and promoted.shape[0] > 0:
                            promoted[jj] = True
                    elif prio[k, x] >= BIG:
                        continue
                    prio[k, x] = BIG - w
                    _push(hkey, hid, hsize, k, BIG - w, x)
        known = 0
        for jj in range(a, b):
            if not ever[flat[jj]]:
                break
            known += 1
        cont = 1 if known > 1 else 0
        if supersede and cont == 1 and known < n:
            old = branch[flat[a + known - 1]]  # the branch this request leaves
            fork = n_children[flat[a + known - 1]] < max_fork  # not (yet) a header many requests share
            if old >= 0:
                kind = 1 if branch[old] >= 0 else 0  # more than one block, or a one-off last block
                p_gate = (gate_reu[kind] + prior_w * prior) / (gate_reu[kind] + gate_miss[kind] + prior_w)
                act = fork and p_gate < first_below
                trial_t[kind, n_trial[kind]] = clock
                trial_blk[kind, n_trial[kind]] = old
                n_trial[kind] += 1
                sup_kind[old] = kind
                sup_since[old] = clock
                sup_first[old] = act
                for k in range(N_INST):
                    sc = superseded_class(seen[k, old], max_seen, max_from_end)
                    cls_of[k, old] = sc
                    ins[k, sc] += 1.0
                    if not np.isnan(prio[k, old]) and prio[k, old] < BIG:  # cached and not due in the lookahead
                        horizon = initial_horizon if dist_n[k] == 0 else horizon_mult * dist_sum[k] / dist_n[k]
                        if act:
                            q = last[old] - SUPERSEDED_FIRST  # below every regular priority
                        else:
                            q = priority(last[old], horizon, reu[k, sc], ins[k, sc], prior, prior_w, 0)
                        if q < prio[k, old]:
                            prio[k, old] = q
                            _push(hkey, hid, hsize, k, q, old)
        for k in range(N_INST):
            forget = windows[k] * capacity if windows[k] < max_window else np.inf
            horizon = initial_horizon if dist_n[k] == 0 else horizon_mult * dist_sum[k] / dist_n[k]
            parent_prio = np.inf
            for jj in range(a, b):
                x = flat[jj]
                pos = jj - a
                s = seen[k, x]
                if s > 0 and clock - last[x] > forget:
                    s = 0  # forgotten: counts as a new block
                if s > 0:
                    reu[k, cls_of[k, x]] += 1.0
                    if censor:
                        ref_reused[k, prev_ref[x]] = True
                    dist_sum[k] += clock - last[x]
                    dist_n[k] += 1.0
                c = reuse_class(s, n - 1 - pos, cont, max_seen, max_from_end)
                ins[k, c] += 1.0
                if censor:
                    ref_cls[k, jj] = c
                seen[k, x] = s + 1
                cls_of[k, x] = c
                nu = next_use[jj]
                if lookahead > 0 and nu <= i + lookahead:
                    q = BIG - nu
                else:
                    known_n = reu[k, c] + misses[k, c] if censor else ins[k, c]
                    q = priority(clock, horizon, reu[k, c], known_n, prior, prior_w, pos)
                    if reuse_override is not None:  # pruned at compile time when None
                        if reuse_override[jj] >= 0.0:  # P(reuse) given for this reference
                            q = priority(clock, horizon, reuse_override[jj], 1.0, 0.0, 0.0, pos)
                if q > parent_prio:
                    q = parent_prio - 1e-6  # leaves first: never above its parent
                parent_prio = q
                if np.isnan(prio[k, x]):
                    size[k] += 1
                prio[k, x] = q
                _push(hkey, hid, hsize, k, q, x)
        for jj in range(a, b):
            if jj > a and not ever[flat[jj]]:
                n_children[flat[jj - 1]] += 1
            if supersede:
                if sup_kind[flat[jj]] >= 0:  # a superseded block referenced again
                    ret_sum[sup_kind[flat[jj]]] += clock - sup_since[flat[jj]]
                    ret_n[sup_kind[flat[jj]]] += 1.0
                    sup_kind[flat[jj]] = -1
                sup_first[flat[jj]] = False
            last[flat[jj]] = clock
            ever[flat[jj]] = True
            if jj + 1 < b:
                branch[flat[jj]] = flat[jj + 1]
            if censor:
                prev_ref[flat[jj]] = jj
        if censor:  # references older than censor_after × the mean reuse distance: outcome known
            for k in range(N_INST):
                d_k = censor_after * (dist_sum[k] / dist_n[k] if dist_n[k] > 0 else initial_horizon)
                while open_from[k] < b and clock - open_from[k] > d_k:  # a reference's tick is its index
                    r = open_from[k]
                    if not ref_reused[k, r]:
                        misses[k, ref_cls[k, r]] += 1.0
                    open_from[k] = r + 1
        for kind in range(2):  # gate trials whose outcome is known: referenced again, or not within the wait
            wait = sup_censor_after * (ret_sum[kind] / ret_n[kind] if ret_n[kind] > 0 else initial_horizon)
            while trial_open[kind] < n_trial[kind] and clock - trial_t[kind, trial_open[kind]] > wait:
                t = trial_open[kind]
                if last[trial_blk[kind, t]] > trial_t[kind, t]:
                    gate_reu[kind] += 1.0
                else:
                    gate_miss[kind] += 1.0
                trial_open[kind] = t + 1
        clock += n
        for k in range(N_INST):
            while size[k] > capacity:
                q, v = _pop(hkey, hid, hsize, k)
                if prio[k, v] != q:
                    continue  # stale entry
                prio[k, v] = np.nan
                size[k] -= 1
                if k == 0 and want_ev[i]:
                    log_eviction(evl, i, n, v)
                top = 0
                c2 = first_child[v]
                while c2 >= 0:
                    stack[top] = c2
                    top += 1
                    c2 = sibling[c2]
                while top > 0:  # cascade: a child without its parent is never hit
                    top -= 1
                    u = stack[top]
                    if not np.isnan(prio[k, u]):
                        prio[k, u] = np.nan
                        size[k] -= 1
                        if k == 0 and want_ev[i]:
                            log_eviction(evl, i, n, u)
                        c2 = first_child[u]
                        while c2 >= 0:
                            stack[top] = c2
                            top += 1
                            c2 = sibling[c2]
            if hsize[k] > 4 * capacity + 1024:
                _rebuild(hkey, hid, hsize, prio, k)
        if clock >= next_adapt:
            next_adapt = clock + int(adapt_every * capacity)
            noise = adapt_z * np.sqrt(shadow_hits[1] + shadow_hits[2] + 1.0)
            moved = True
            if shadow_hits[2] > shadow_hits[1] + noise:
                window = min(window * step, max_window)
            elif shadow_hits[1] > shadow_hits[2] + noise:
                window = max(window / step, min_window)
            else:
                moved = False
            windows[0], windows[1], windows[2] = window, max(window / step, min_window), min(window * step, max_window)
            if moved or adapt_z == 0.0:
                shadow_hits[:] = 0.0
    return hits, as_arrays(evl), as_arrays(snl), sup_first


@numba.njit(cache=True)
def _with_descendants(flat: np.ndarray, parent: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """``roots`` (bool ``[blocks]``) and every block below one of them: a block's parent is
    referenced before it, so one pass over ``flat`` in order reaches each block after its
    parent's mark is final."""
    out = roots.copy()
    done = np.zeros(roots.shape[0], dtype=np.bool_)
    for jj in range(flat.shape[0]):
        x = flat[jj]
        if not done[x]:
            done[x] = True
            if parent[x] >= 0 and out[parent[x]]:
                out[x] = True
    return out


def simulate(trace: CompactTrace, capacity: int, lookahead: int = 0,
             settings: PrefixValueSettings | None = None, promote: bool = True,
             reuse_override: np.ndarray | None = None) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under the default policy.

    Args:
        trace: the compact trace.
        capacity: fast-tier capacity in blocks (>= 1).
        lookahead: upcoming requests visible (0 = none).
        settings: policy settings (default: :class:`PrefixValueSettings`).
        promote: with a lookahead, also promote a visible request's known blocks (else the
            hints only keep cached blocks from eviction).
        reuse_override: optional float64 ``[refs]``, a ``P(reuse)`` in [0, 1] per block
            reference to rank it by in place of its class's estimate (negative = use the
            estimate).  Not for serving: it measures what a better predictor would give the
            same rule (``bench/reuse_signals.py --replay``).  The class counts, the window
            tuner and superseded branches run as without it.

    Memory: besides O(blocks) state, the censored estimate (``censor_after`` > 0) keeps a
    class (int16) and a reused bit per reference for each of the 3 instances, 9 bytes per
    reference.

    Raises:
        ValueError: ``capacity`` < 1 or ``lookahead`` < 0, or ``reuse_override`` is not
            one value per reference or holds a value above 1 or a NaN.
    """
    if capacity < 1 or lookahead < 0:
        raise ValueError(f"need capacity >= 1 and lookahead >= 0, got {capacity}, {lookahead}")
    p = (settings or PrefixValueSettings()).as_array()
    nu = trace.next_use() if lookahead > 0 else np.zeros(trace.refs, dtype=np.int64)
    over = None
    if reuse_override is not None:
        over = np.ascontiguousarray(reuse_override, dtype=np.float64)
        if over.shape != (trace.refs,) or np.isnan(over).any() or (over > 1.0).any():
            raise ValueError(f"reuse_override must be {trace.refs} values <= 1 (negative = the estimate), "
                             f"got shape {over.shape}")
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, nu, lookahead, promote, p, over,
                *no_logging(trace.requests), np.zeros(0, dtype=np.bool_))[0]


def simulate_promotions(trace: CompactTrace, capacity: int, lookahead: int) -> tuple[np.ndarray, np.ndarray]:
    """``(hits per request, promoted)`` with a lookahead of ``lookahead`` requests and the
    default settings: ``promoted`` (bool ``[refs]``) marks each reference whose block the
    policy promoted from a lower tier, ahead of that request, when the request became
    visible (the time model, :mod:`kvadvisor.timemodel`, schedules those transfers).

    Raises:
        ValueError: ``capacity`` < 1 or ``lookahead`` < 1.
    """
    if capacity < 1 or lookahead < 1:
        raise ValueError(f"need capacity >= 1 and lookahead >= 1, got {capacity}, {lookahead}")
    prom = np.zeros(trace.refs, dtype=np.bool_)
    hits = _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, trace.next_use(), lookahead,
                True, PrefixValueSettings().as_array(), None, *no_logging(trace.requests), prom)[0]
    return hits, prom


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray) -> tuple:
    """``(hits, evictions, snapshots)`` with the default settings, no lookahead, and the logs of
    :mod:`advisor.policy.eviction.evlog` (evictions at position ``len(request)``: this policy evicts
    after the whole request)."""
    p = PrefixValueSettings().as_array()
    nu = np.zeros(trace.refs, dtype=np.int64)
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, nu, 0, True, p, None,
                want_ev, want_snap, np.zeros(0, dtype=np.bool_))[:3]


def superseded_first(trace: CompactTrace, capacity: int,
                     settings: PrefixValueSettings | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(hits per request, superseded)`` after replaying ``trace``: ``superseded`` (bool
    ``[blocks]``, by dense id) marks each block that "Superseded first" (module docstring)
    ranks below every other block at the end of the trace: the root of a branch the rule
    acted on and not referenced since, and every block below such a root.

    The verdict depends on the trace alone, not on ``capacity`` (the gate is one estimate
    per trace, shared by the three instances); ``capacity`` sizes the replay whose hits
    are returned with it.  The live advisor ranks its blocks with it
    (:mod:`advisor.policy.eviction.live_scoring`).  With ``settings.supersede`` off, none.

    Raises:
        ValueError: ``capacity`` < 1.
    """
    if capacity < 1:
        raise ValueError(f"need capacity >= 1, got {capacity}")
    none = np.zeros(trace.requests, dtype=np.bool_)
    hits, _, _, sup = _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent,
                           np.zeros(trace.refs, dtype=np.int64), 0, True, (settings or PrefixValueSettings()).as_array(),
                           None, none, none, np.zeros(0, dtype=np.bool_))
    if not sup.shape[0]:  # the rule is off
        return hits, np.zeros(trace.n_blocks, dtype=np.bool_)
    return hits, _with_descendants(trace.flat, trace.parent, sup)


__all__ = ["PrefixValueSettings", "priority", "replay", "reuse_class", "simulate", "simulate_promotions",
           "superseded_class", "superseded_first"]
