"""Hit rates and savings of lookups, per tier and per worker, in total and over rolling
windows (1 min, 1 h) (docs/operations.md, "Hit rates").

A *lookup* is one ``POST /v1/lookup`` (kind ``lookup``) or one ``POST /query`` /
``/query_by_hash`` (kind ``query``). For each key (a tier ``G1``..``G4`` or ``g1``..``g4``,
or a worker) a lookup is a *hit* when that key would serve at least one leading block;
*blocks* sums those blocks. A worker serves the leading blocks it holds; a ``/v1/lookup``
tier serves the blocks the best-placed worker would read from it, each block from its
fastest tier (:func:`served_per_tier`; scaled mode, whose index is partitioned: the leading
blocks the tier holds at one location); an indexer tier ``g1``..``g4``, the leading blocks
it holds; *tokens* sums those blocks × tokens per block, the prompt
tokens that did not need recomputing there (known only when the block size is: token-id
lookups, and every indexer query). ``hit_rate`` = hits / lookups of that kind.

Windows are kept as one-second buckets (the last 3,600), so a window's figures are exact to
the second; the totals never reset. Thread-safe.

Worker names come from events and indexer registrations, so they churn without bound. Each
tally (the totals, each bucket, each window's sum) keeps at most ``max_worker_keys``
workers: past that, the half with the fewest hits is folded into one worker key,
:data:`OTHER` (hits, blocks and tokens summed), the way Prometheus exporters cap a label's
cardinality. A folded worker that comes back starts a new key. Folding halves the keys, so
its cost is O(log n) per new worker, amortised.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TIER_ORDER = ("G1", "G2", "G3", "G4")
"""Fastest first: the order a runtime onboards from (kvbm_runtime.manager)."""


def served_per_tier(prefix_locations: Iterable[Iterable[str]],
                    tier_of: Callable[[str], tuple[str, str | None]]) -> tuple[str | None, dict[str, int]]:
    """Which tier would serve each leading block of a request, on the worker best placed for it.

    A worker reads its own G1/G2 and the shared volumes (G3, G4), each block from the fastest
    tier that holds it, and stops at the first block it can reach nowhere, as
    ``kvbm_runtime.BlockManager.serve`` does.  The worker with the longest such prefix wins
    (ties: more blocks from faster tiers), as a KV-aware router would pick it.

    Args:
        prefix_locations: per leading block (first block first), the index locations holding it.
        tier_of: location → ``(tier "G1".."G4", worker or None)``.

    Returns:
        ``(worker or None, {tier: blocks it serves})``; tiers serving nothing are absent.
    """
    rows = [[tier_of(loc) for loc in locs] for locs in prefix_locations]
    workers = {w for row in rows for _, w in row if w is not None}
    best: tuple[tuple[int, ...], str | None, dict[str, int]] = ((0,), None, {})
    for w in [None, *sorted(workers)]:
        counts = dict.fromkeys(TIER_ORDER, 0)
        for row in rows:
            usable = [t for t, owner in row if owner is None or owner == w]
            if not usable:
                break
            counts[min(usable, key=lambda t: TIER_ORDER.index(t) if t in TIER_ORDER else len(TIER_ORDER))] += 1
        key = (sum(counts.values()), *(counts[t] for t in TIER_ORDER))
        if key > best[0]:
            best = (key, w, {t: n for t, n in counts.items() if n})
    return best[1], best[2]


WINDOWS: dict[str, int] = {"1m": 60, "1h": 3600}
"""Window name → seconds."""

Key = tuple[str, str]
"""``("tier", "G1")`` or ``("worker", "w0")``."""

OTHER = "(other)"
"""The worker key the least-hit workers are folded into past ``max_worker_keys``."""
MAX_WORKER_KEYS = 1024
"""Default cap on worker keys per tally (module docstring)."""


class _Bucket:
    __slots__ = ("second", "lookups", "keys")

    def __init__(self, second: int) -> None:
        self.second = second
        self.lookups = 0
        self.keys: dict[Key, list[int]] = {}  # key -> [hits, blocks, tokens]


def _add(into: dict[Key, list[int]], key: Key, blocks: int, tokens: int, max_workers: int) -> None:
    v = into.get(key)
    if v is None:
        into[key] = [1, blocks, tokens]
        # a cheap bound first: the keys beside the workers are at most the tiers (G1..G4 and
        # the indexer's g1..g4) and OTHER; _fold counts the workers exactly
        if key[0] == "worker" and len(into) > max_workers + len(TIER_ORDER) * 2:
            _fold(into, max_workers)
    else:
        v[0] += 1
        v[1] += blocks
        v[2] += tokens


def _fold(keys: dict[Key, list[int]], max_workers: int) -> None:
    """Fold the least-hit half of the worker keys into :data:`OTHER` once there are more
    than ``max_workers`` of them (module docstring)."""
    workers = [k for k in keys if k[0] == "worker" and k[1] != OTHER]
    if len(workers) <= max_workers:
        return
    workers.sort(key=lambda k: (keys[k][0], keys[k][1]))
    other = keys.setdefault(("worker", OTHER), [0, 0, 0])
    for k in workers[: len(workers) - max_workers // 2]:
        h, bl, tk = keys.pop(k)
        other[0] += h
        other[1] += bl
        other[2] += tk


class HitRates:
    """Hit-rate tally of one kind of lookup.

    Args:
        kind: ``"lookup"`` or ``"query"`` (the label of its metrics).
        clock: seconds source (``time.monotonic`` by default).
        max_worker_keys: workers kept per tally before the least-hit half is folded into
            :data:`OTHER` (module docstring).

    Raises:
        ValueError: ``max_worker_keys`` < 2.
    """

    def __init__(self, kind: str, clock: Any = time.monotonic, max_worker_keys: int = MAX_WORKER_KEYS) -> None:
        if max_worker_keys < 2:
            raise ValueError(f"need max_worker_keys >= 2, got {max_worker_keys}")
        self.kind = kind
        self._clock = clock
        self._max_workers = max_worker_keys
        self._lock = threading.Lock()
        self._buckets: deque[_Bucket] = deque()
        self._lookups = 0
        self._totals: dict[Key, list[int]] = {}

    def record(self, tiers: Mapping[str, int], workers: Mapping[str, int], block_tokens: int | None) -> None:
        """Count one lookup.

        Args:
            tiers: tier → leading blocks held there (0 or absent: a miss).
            workers: worker → leading blocks it held.
            block_tokens: tokens per block, or ``None`` when unknown (tokens then count 0).
        """
        bt = block_tokens or 0
        hits = [(("tier", t), n) for t, n in tiers.items() if n > 0] + [(("worker", w), n) for w, n in workers.items() if n > 0]
        second = int(self._clock())
        with self._lock:
            b = self._buckets[-1] if self._buckets else None
            if b is None or b.second != second:
                b = _Bucket(second)
                self._buckets.append(b)
                while self._buckets and self._buckets[0].second <= second - max(WINDOWS.values()):
                    self._buckets.popleft()
            b.lookups += 1
            self._lookups += 1
            for key, n in hits:
                _add(b.keys, key, n, n * bt, self._max_workers)
                _add(self._totals, key, n, n * bt, self._max_workers)

    def snapshot(self) -> dict[str, Any]:
        """``{"total": figures, "1m": figures, "1h": figures}``; figures = ``{"lookups": n,
        "tiers": {tier: {"hits", "blocks", "tokens", "hit_rate"}}, "workers": {...}}``."""
        now = int(self._clock())
        with self._lock:
            out = {"total": _figures(self._lookups, self._totals)}
            buckets = list(self._buckets)
        for name, seconds in WINDOWS.items():
            lookups, keys = 0, {}
            for b in buckets:
                if b.second > now - seconds:
                    lookups += b.lookups
                    for key, (h, bl, tk) in b.keys.items():
                        v = keys.setdefault(key, [0, 0, 0])
                        v[0] += h
                        v[1] += bl
                        v[2] += tk
            _fold(keys, self._max_workers)
            out[name] = _figures(lookups, keys)
        return out


def _figures(lookups: int, keys: Mapping[Key, list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {"lookups": lookups, "tiers": {}, "workers": {}}
    for (scope, name), (h, bl, tk) in sorted(keys.items()):
        out["tiers" if scope == "tier" else "workers"][name] = {
            "hits": h, "blocks": bl, "tokens": tk, "hit_rate": h / lookups if lookups else 0.0}
    return out


class HitRateCollector(Collector):
    """Prometheus view of several :class:`HitRates`: ``kvadvisor_api_lookups_total{kind}``,
    ``kvadvisor_api_lookup_{hits,blocks,tokens}_total{kind,scope,key}`` and
    ``kvadvisor_api_hit_rate{kind,scope,key,window}``.

    Worker keys come from events, so at most ``max_keys`` worker series per kind are shown
    (the busiest); the tiers are always there.
    """

    def __init__(self, tallies: Iterable[HitRates], max_keys: int = 64) -> None:
        self._tallies = list(tallies)
        self._max = max_keys

    def collect(self) -> Iterable[Any]:
        lookups = CounterMetricFamily("kvadvisor_api_lookups", "lookups answered", labels=["kind"])
        fams = {f: CounterMetricFamily(f"kvadvisor_api_lookup_{f}", f"lookup {f} per tier / worker",
                                       labels=["kind", "scope", "key"]) for f in ("hits", "blocks", "tokens")}
        rate = GaugeMetricFamily("kvadvisor_api_hit_rate", "hits / lookups over a window",
                                 labels=["kind", "scope", "key", "window"])
        for t in self._tallies:
            snap = t.snapshot()
            lookups.add_metric([t.kind], snap["total"]["lookups"])
            for window, fig in snap.items():
                for scope in ("tiers", "workers"):
                    items = sorted(fig[scope].items(), key=lambda kv: -kv[1]["hits"])
                    if scope == "workers":
                        items = items[: self._max]
                    for key, v in items:
                        labels = [t.kind, scope[:-1], key]
                        if window == "total":
                            for f, fam in fams.items():
                                fam.add_metric(labels, v[f])
                        else:
                            rate.add_metric([*labels, window], v["hit_rate"])
        yield lookups
        yield from fams.values()
        yield rate
