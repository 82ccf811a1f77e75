"""Seeded synthetic prefix-tree traces: the robustness suite of ``kvadvisor evaluate --synthetic``.

Each case is a workload where some classic cache is strong (docs/traces.md, "Synthetic
robustness suite"); the default policy must stay within 0.002 of the best online baseline
on every case at every capacity.  Every request is a root-to-node path of a prefix tree
(block ids are prefix-chained, as in the real traces) and, like a real prompt, ends with
one fresh block of its own (the question, never reused).

An *object* is a prefix: a header shared by its group (``HEADER`` blocks, groups of 16
objects, like a system prompt) then blocks of its own (4–24, uniform).  Zipf popularity
ranks objects in a seeded random order.  Capacities are set per case from its footprint
(distinct blocks that can be reused), so each case is tested with a tier much smaller
than, about a third of, and close to its working set.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from advisor.policy.eviction.compact import RequestFinishes
from advisor.policy.eviction.finish_aware import FINISH_END_TURN, FINISH_TOOL_CALL

HEADER = 2
GROUP = 16
REQUESTS = 16_000
"""Requests per case (a tier sees its contents turn over many times, as in a real trace)."""


@dataclass(frozen=True)
class SyntheticCase:
    """One generated trace.

    Attributes:
        name: short name (``zipf-0.8``, ``loop``, ...).
        description: what it is and which classic cache it favours.
        requests: block id lists in arrival order.
        capacities: tier capacities (blocks) it is evaluated at.
        finishes: arrival, finish and finish reason of each request, for a case that
            has them (``None``: the trace records none, as the Mooncake trace).
    """

    name: str
    description: str
    requests: list[list[int]]
    capacities: tuple[int, ...]
    finishes: RequestFinishes | None = None


class _Ids:
    def __init__(self) -> None:
        self.n = 0

    def take(self, k: int) -> list[int]:
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


def _objects(ids: _Ids, rng: np.random.Generator, n: int, lo: int = 4, hi: int = 24) -> list[list[int]]:
    headers: list[list[int]] = []
    objs = []
    for o in range(n):
        if o % GROUP == 0:
            headers.append(ids.take(HEADER))
        objs.append(headers[-1] + ids.take(int(rng.integers(lo, hi + 1))))
    return objs


def _zipf(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** alpha
    rank_to_obj = rng.permutation(n)
    return rank_to_obj[rng.choice(n, size=size, p=w / w.sum())]


def _footprint(objs: list[list[int]]) -> int:
    return len({b for o in objs for b in o})


def _caps(footprint: int) -> tuple[int, ...]:
    return (max(16, footprint // 20), max(32, footprint // 3), max(64, (9 * footprint) // 10))


def zipf(alpha: float, seed: int, n_objects: int = 2000, n_requests: int = REQUESTS) -> SyntheticCase:
    """Independent requests for objects with Zipf(``alpha``) popularity (LFU's and ARC's case
    at high skew, LRU's at low skew)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    objs = _objects(ids, rng, n_objects)
    reqs = [objs[o] + ids.take(1) for o in _zipf(rng, n_objects, alpha, n_requests)]
    return SyntheticCase(f"zipf-{alpha:g}", f"{n_requests:,} requests, {n_objects:,} objects, Zipf α = {alpha:g}",
                         reqs, _caps(_footprint(objs)))


def scan_hot(seed: int, n_objects: int = 400, n_requests: int = REQUESTS, scan_share: float = 0.25,
             scan_len: int = 48) -> SyntheticCase:
    """A Zipf(0.9) hot set with one-pass scans mixed in (a quarter of the requests read
    ``scan_len`` blocks never read again): scan resistance (ARC, S3-FIFO, LFU-DA) wins."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    objs = _objects(ids, rng, n_objects)
    hot = iter(_zipf(rng, n_objects, 0.9, n_requests))
    reqs = [ids.take(scan_len) if rng.random() < scan_share else objs[next(hot)] + ids.take(1)
            for _ in range(n_requests)]
    return SyntheticCase("scan+hot", f"{n_requests:,} requests: Zipf(0.9) over {n_objects} objects, "
                         f"{scan_share:.0%} one-pass scans of {scan_len} blocks", reqs, _caps(_footprint(objs)))


def loop(seed: int, n_objects: int = 1000, n_requests: int = REQUESTS) -> SyntheticCase:
    """Objects read in a fixed cyclic order, the loop larger than every capacity: LRU and
    FIFO keep nothing that is reused in time; LFU-like and scan-resistant caches keep a part."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    objs = _objects(ids, rng, n_objects, 8, 16)
    reqs = [objs[i % n_objects] + ids.take(1) for i in range(n_requests)]
    fp = _footprint(objs)
    return SyntheticCase("loop", f"{n_requests:,} requests cycling over {n_objects:,} objects "
                         f"({fp:,} blocks, above every capacity)", reqs, (fp // 20, fp // 3, (3 * fp) // 4))


def shifting(seed: int, phases: int = 4, n_objects: int = 500, per_phase: int = REQUESTS // 4) -> SyntheticCase:
    """A working set that moves: each phase reads a fresh set of objects with Zipf(1.0)
    popularity, so recency (LRU, ARC) must forget the old set quickly."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    reqs: list[list[int]] = []
    fp = 0
    for _ in range(phases):
        objs = _objects(ids, rng, n_objects)
        fp = max(fp, _footprint(objs))
        reqs += [objs[o] + ids.take(1) for o in _zipf(rng, n_objects, 1.0, per_phase)]
    return SyntheticCase("shifting", f"{phases} phases of {per_phase:,} requests, each Zipf(1.0) over "
                         f"{n_objects} fresh objects", reqs, _caps(fp))


def one_hit_flood(seed: int, n_objects: int = 500, n_requests: int = REQUESTS, window: int = 500,
                  flood_share: float = 0.8) -> SyntheticCase:
    """A Zipf(1.0) hot set; every other window of ``window`` requests is a flood where
    ``flood_share`` of the requests are one-hit wonders (fresh objects read once):
    quick demotion of new blocks (S3-FIFO, SIEVE) wins."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    objs = _objects(ids, rng, n_objects)
    hot = iter(_zipf(rng, n_objects, 1.0, n_requests))
    reqs = []
    for i in range(n_requests):
        flood = (i // window) % 2 == 1 and rng.random() < flood_share
        if flood:
            reqs.append(ids.take(int(rng.integers(4, 25))))
        else:
            reqs.append(objs[next(hot)] + ids.take(1))
    return SyntheticCase("one-hit-flood", f"{n_requests:,} requests: Zipf(1.0) over {n_objects} objects, "
                         f"floods of one-hit wonders ({flood_share:.0%} of every other {window}-request window)",
                         reqs, _caps(_footprint(objs)))


def conversation_tree(seed: int, branching: int = 2, n_conv: int = 400, n_requests: int = REQUESTS,
                      turn_blocks: int = 4, system_blocks: int = 4) -> SyntheticCase:
    """Conversations as trees with a fixed branching factor: every conversation starts from a
    shared system prompt; each request picks a conversation (Zipf 0.8) and a node of its tree
    with fewer than ``branching`` children (the newest such node with probability 1/2, else
    one at random: a retry or an edit), and extends it by a turn of ``turn_blocks`` blocks."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(system_blocks)
    trees: list[list[tuple[list[int], int]]] = [[] for _ in range(n_conv)]  # (path, children)
    reqs = []
    for c in _zipf(rng, n_conv, 0.8, n_requests):
        tree = trees[c]
        open_nodes = [k for k, (_, ch) in enumerate(tree) if ch < branching]
        if not tree:
            base = list(system)
        elif not open_nodes:
            base = list(system)  # the tree is full: a new root branch off the system prompt
        else:
            k = open_nodes[-1] if rng.random() < 0.5 else open_nodes[int(rng.integers(len(open_nodes)))]
            path, ch = tree[k]
            tree[k] = (path, ch + 1)
            base = path
        path = base + ids.take(turn_blocks)
        tree.append((path, 0))
        reqs.append(path + ids.take(1))
    fp = len({b for t in trees for p, _ in t for b in p})
    return SyntheticCase(f"conv-tree-b{branching}", f"{n_requests:,} requests in {n_conv} conversation trees "
                         f"(branching {branching}, {turn_blocks}-block turns)", reqs, _caps(fp))


def agent_sessions(seed: int, n_active: int = 40, n_requests: int = REQUESTS, turn_blocks: int = 4,
                   system_blocks: int = 4, p_tool: float = 0.75, p_end: float = 0.3, tool_gap_s: float = 8.0,
                   user_gap_s: float = 300.0, answer_s: float = 2.0, informative: bool = True) -> SyntheticCase:
    """Agent sessions as the WEKA Claude Code traces show them (docs/traces.md): ``n_active``
    sessions at a time, each from a shared system prompt; each request reads its session's
    whole context and adds a turn of ``turn_blocks`` blocks; its answer (``answer_s`` long)
    stops on a tool call with probability ``p_tool`` and the next request follows after an
    exponential gap of mean ``tool_gap_s``, or it ends the turn, and the session either ends
    (``p_end``; a new one starts) or its next request follows after a gap of mean
    ``user_gap_s``.  The requests carry their arrival, finish and finish reason;
    ``informative = False`` shuffles the reasons over the requests (the same times and
    shares, reasons that tell nothing)."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.take(system_blocks)
    ctx: dict[int, list[int]] = {}
    queue: list[tuple[float, int]] = []
    for s in range(n_active):
        ctx[s] = list(system)
        queue.append((float(rng.uniform(0.0, user_gap_s)), s))
    heapq.heapify(queue)
    nxt = n_active
    reqs: list[list[int]] = []
    arrival, reason = [], []
    while len(reqs) < n_requests:
        t, s = heapq.heappop(queue)
        ctx[s] = ctx[s] + ids.take(turn_blocks)
        reqs.append(list(ctx[s]))
        arrival.append(t)
        done = t + answer_s
        if rng.random() < p_tool:
            reason.append(FINISH_TOOL_CALL)
            heapq.heappush(queue, (done + float(rng.exponential(tool_gap_s)), s))
            continue
        reason.append(FINISH_END_TURN)
        if rng.random() < p_end:
            del ctx[s]
            s, nxt = nxt, nxt + 1
            ctx[s] = list(system)
        heapq.heappush(queue, (done + float(rng.exponential(user_gap_s)), s))
    a = np.array(arrival)
    why = np.array(reason, dtype=np.int8)
    if not informative:
        why = rng.permutation(why)
    # the live working set (sessions at a time x their mean context), not the footprint: an
    # ended session's blocks are never read again, so the footprint overstates what a tier needs
    ws = int(n_active * np.mean([len(r) for r in reqs]))
    name = "agent" if informative else "agent/shuffled"
    return SyntheticCase(name, f"{n_requests:,} requests of agent sessions, {n_active} at a time ({p_tool:.0%} of "
                         f"answers stop on a tool call{'' if informative else '; reasons shuffled'})", reqs,
                         (ws // 8, ws // 3, 9 * ws // 10), RequestFinishes(a, a + answer_s, why))


CASES: tuple[Callable[[int], SyntheticCase], ...] = (
    lambda s: zipf(0.6, s), lambda s: zipf(0.8, s), lambda s: zipf(1.0, s), lambda s: zipf(1.2, s),
    scan_hot, loop, shifting, one_hit_flood, conversation_tree, agent_sessions,
)


def suite(seed: int = 0) -> list[SyntheticCase]:
    """Every case of the suite, generated with ``seed`` (same seed, same traces)."""
    return [make(seed + k) for k, make in enumerate(CASES)]


def _named(name: str, case: SyntheticCase) -> SyntheticCase:
    return replace(case, name=name)


VARIANTS: tuple[Callable[[int], SyntheticCase], ...] = (
    lambda s: _named("zipf-0.9/1k", zipf(0.9, s, n_objects=1000)),
    lambda s: _named("zipf-1.1/4k", zipf(1.1, s, n_objects=4000)),
    lambda s: _named("scan+hot/40%", scan_hot(s, n_objects=800, scan_share=0.4, scan_len=24)),
    lambda s: _named("loop/600", loop(s, n_objects=600)),
    lambda s: _named("shifting/8", shifting(s, phases=8, n_objects=300, per_phase=REQUESTS // 8)),
    lambda s: _named("flood/200", one_hit_flood(s, n_objects=800, window=200, flood_share=0.6)),
    lambda s: conversation_tree(s, branching=3, n_conv=200),
    lambda s: agent_sessions(s, n_active=60, p_tool=0.6, informative=False),
)
"""The same generators with other parameters (docs/traces.md): a robustness check on traces
no setting was chosen on (``kvadvisor evaluate --synthetic --variants``; the switching
test's z was chosen on seeds 0–6,000, so seeds from 7,000 on are held out)."""


def variants(seed: int = 0) -> list[SyntheticCase]:
    """Every case of :data:`VARIANTS`, generated with ``seed`` (case k uses ``seed + k``)."""
    return [make(seed + k) for k, make in enumerate(VARIANTS)]


__all__ = ["CASES", "SyntheticCase", "VARIANTS", "agent_sessions", "conversation_tree", "loop", "one_hit_flood", "scan_hot",
           "shifting", "suite", "variants", "zipf"]
