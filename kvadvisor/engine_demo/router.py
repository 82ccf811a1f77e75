"""Request routers of the engine demo: round-robin, and a KV-aware router on the indexer API.

The KV-aware rule is NVIDIA Dynamo's KV router (docs: "KV Cache Routing", cost function):
for each worker ``w``::

    cost(w) = overlap_weight × prefill_blocks(w) + active_blocks(w)

where ``prefill_blocks(w)`` is the blocks of the prompt that ``w`` would still compute (its
prompt blocks minus the leading blocks the index says ``w`` holds) and ``active_blocks(w)``
is the blocks of the requests ``w`` is serving now (the router's own count: prompt blocks of
the requests it sent there and that have not finished).  The lowest cost wins; ties go to
the worker with fewer requests in flight, then to the next one in round-robin order.
The overlap comes from ``POST /query`` of the advisor's indexer-compatible API
(docs/operations.md, "Indexer API"), which indexes each engine's own KV events.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one request went and why.

    Attributes:
        engine: index of the chosen engine.
        overlap_tokens: per engine, the prompt tokens the index says it holds (empty for
            round-robin).
    """

    engine: int
    overlap_tokens: tuple[int, ...] = ()


class Router(Protocol):
    """Picks an engine for a prompt and is told when the request ends."""

    name: str

    async def choose(self, tokens: Sequence[int]) -> Choice: ...

    def finished(self, choice: Choice, tokens: Sequence[int]) -> None: ...


@dataclass
class RouterStats:
    """What a router did: requests per engine, and requests sent where some overlap was."""

    per_engine: Counter[int] = field(default_factory=Counter)
    with_overlap: int = 0
    to_best_overlap: int = 0
    query_errors: int = 0


class RoundRobinRouter:
    """Engine ``i mod n`` for the ``i``-th request."""

    name = "round-robin"

    def __init__(self, engines: int) -> None:
        self._next = itertools.cycle(range(engines))
        self.stats = RouterStats()

    async def choose(self, tokens: Sequence[int]) -> Choice:
        c = Choice(next(self._next))
        self.stats.per_engine[c.engine] += 1
        return c

    def finished(self, choice: Choice, tokens: Sequence[int]) -> None:
        """Nothing to track."""


class KvRouter:
    """Dynamo's KV-aware rule (module doc) over ``POST /query``.

    Args:
        http: client of the advisor's API (base URL and auth set).
        model_name: the index's model name (each engine registered under it).
        instance_ids: the indexer ``instance_id`` of each engine, in engine order.
        block_size: tokens per block.
        overlap_weight: weight of the prefill blocks against the active blocks (Dynamo's
            ``overlap_score_weight``, default 1.0).
    """

    name = "kv-aware"

    def __init__(self, http: httpx.AsyncClient, model_name: str, instance_ids: Sequence[int], block_size: int,
                 overlap_weight: float = 1.0) -> None:
        self.http = http
        self.model_name = model_name
        self.instance_ids = list(instance_ids)
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.active_blocks = [0] * len(self.instance_ids)
        self.in_flight = [0] * len(self.instance_ids)
        self._rr = 0
        self.stats = RouterStats()

    async def overlaps(self, tokens: Sequence[int]) -> list[int]:
        """Per engine, leading prompt tokens held (0 where the index knows nothing or the
        query fails; a failed query is counted in ``stats.query_errors``)."""
        try:
            r = await self.http.post("/query", json={"token_ids": list(tokens), "model_name": self.model_name})
            if r.status_code == 404:  # no engine has published an event yet
                return [0] * len(self.instance_ids)
            r.raise_for_status()
            scores = r.json().get("scores", {})
        except httpx.HTTPError:
            self.stats.query_errors += 1
            return [0] * len(self.instance_ids)
        return [int(max(scores.get(str(i), {}).values(), default=0)) for i in self.instance_ids]

    async def choose(self, tokens: Sequence[int]) -> Choice:
        """The engine of lowest cost (module doc)."""
        n = len(self.instance_ids)
        overlap = await self.overlaps(tokens)
        blocks = -(-len(tokens) // self.block_size)
        order = [(self._rr + k) % n for k in range(n)]

        def cost(w: int) -> tuple[float, int, int]:
            prefill = blocks - min(blocks, overlap[w] // self.block_size)
            return (self.overlap_weight * prefill + self.active_blocks[w], self.in_flight[w], order.index(w))

        best = min(range(n), key=cost)
        self._rr = (best + 1) % n
        self.active_blocks[best] += blocks
        self.in_flight[best] += 1
        self.stats.per_engine[best] += 1
        if max(overlap) > 0:
            self.stats.with_overlap += 1
            self.stats.to_best_overlap += int(overlap[best] == max(overlap))
        return Choice(best, tuple(overlap))

    def finished(self, choice: Choice, tokens: Sequence[int]) -> None:
        """The request left its engine: its blocks no longer count as load."""
        self.active_blocks[choice.engine] -= -(-len(tokens) // self.block_size)
        self.in_flight[choice.engine] -= 1
