"""Request routers of the engine demo: round-robin, and a KV-aware router on the indexer API.

The KV-aware rule is NVIDIA Dynamo's KV router (Dynamo docs: "KV Cache Routing" /
"Routing Concepts", cost calculation, and "Router Design": potential prefill blocks and
potential active blocks).  For each engine ``w`` and a prompt of ``B`` blocks::

    cost(w) = overlap_weight × prefill_blocks(w) + active_blocks(w)

    prefill_blocks(w) = queued_prefill(w) + (B − overlap(w))
    active_blocks(w)  = decode_blocks(w) + B

* ``queued_prefill(w)``: prefill work still queued on ``w``: the uncached prompt blocks
  (``B − overlap`` when it was routed) of the requests sent to ``w`` that have not produced
  their first token yet.  The router sees the first token in the response stream
  (:meth:`KvRouter.first_token`), as Dynamo's router updates its prompt-side load when the
  first output token signals that prefill is done.  So a short request is not sent behind a
  long prefill.
* ``decode_blocks(w)``: the prompt blocks of the requests in flight on ``w`` (sent and not
  finished): the KV they occupy while they decode.
* ``overlap(w)``: the leading prompt blocks ``w`` can use without computing them, from
  ``POST /query`` of the advisor's indexer API (docs/operations.md, "Indexer API"), which
  indexes each engine's KV events: vLLM's own (G1) and the connector's (G2, volumes;
  ``kvbm_runtime.tier_events``).  A block on a *shared* tier (``g3`` / ``g4``: a volume
  every engine loads from through the shared placement catalog) counts for every engine;
  the local tiers (``g1`` GPU, ``g2`` host memory) count for their own engine only::

      overlap(w) = max(score(w), max over engines v, shared tiers t of tiers[v][t])

  where ``score(w)`` is the index's score of ``w`` (leading blocks it holds on any tier)
  and ``tiers[v][t]`` its leading blocks on tier ``t``.

The lowest cost wins; ties go to the engine with fewer requests in flight, then to the next
one in round-robin order.

Requests that arrive together are routed together (:meth:`Router.choose_many`): their
queries run at once, then each is picked in arrival order, seeing the load of those before
it.  Dynamo's router holds its index in its own process and decides in microseconds; ours
asks the advisor over HTTP, and one query after the other would send a burst out over their
round trips (up to 370 ms for a burst of 10 on a loaded 2-core machine), so an engine starts a
step with the burst's first prompt while the rest wait behind it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

SHARED_TIERS = ("g3", "g4")
"""Tiers of the indexer's answer that every engine loads from (the shared volumes)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """Where one request went and why.

    Attributes:
        engine: index of the chosen engine.
        overlap_tokens: per engine, the prompt tokens it could use without computing them
            (empty for round-robin).
        ticket: the router's id of the request (KV-aware: its load is tracked by it).
        blocks: prompt blocks counted as the engine's decode load until it finishes.
        prefill_blocks: uncached prompt blocks counted as queued prefill until its first
            token.
    """

    engine: int
    overlap_tokens: tuple[int, ...] = ()
    ticket: int = 0
    blocks: int = 0
    prefill_blocks: int = 0


class Router(Protocol):
    """Picks an engine for a prompt and is told of its first token and when it ends."""

    name: str

    async def choose(self, tokens: Sequence[int]) -> Choice: ...

    async def choose_many(self, prompts: Sequence[Sequence[int]]) -> list[Choice]: ...

    def first_token(self, choice: Choice) -> None: ...

    def finished(self, choice: Choice, tokens: Sequence[int]) -> None: ...


@dataclass
class RouterStats:
    """What a router did: requests per engine, and requests sent where some overlap was.

    Attributes:
        per_engine: requests per engine index.
        with_overlap: requests some engine had an overlap for.
        with_shared_overlap: of those, requests with blocks on a shared tier.
        to_best_overlap: requests sent to an engine of the largest overlap.
        query_errors: ``/query`` calls that failed (routed by load alone).
    """

    per_engine: Counter[int] = field(default_factory=Counter)
    with_overlap: int = 0
    with_shared_overlap: int = 0
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

    async def choose_many(self, prompts: Sequence[Sequence[int]]) -> list[Choice]:
        """:meth:`choose` for each prompt, in order."""
        return [await self.choose(p) for p in prompts]

    def first_token(self, choice: Choice) -> None:
        """Nothing to track."""

    def finished(self, choice: Choice, tokens: Sequence[int]) -> None:
        """Nothing to track."""


def engine_overlaps(answer: Mapping[str, Any], instance_ids: Sequence[int],
                    shared_tiers: Collection[str] = SHARED_TIERS) -> tuple[list[int], int]:
    """Per engine, the prompt tokens it can use without computing them (module doc,
    ``overlap(w)``), from one ``POST /query`` answer.

    Args:
        answer: the ``/query`` body: ``scores`` (instance → dp rank → tokens) and ``tiers``
            (instance → dp rank → tier → tokens); missing parts count as 0.
        instance_ids: the engines' indexer instance ids, in engine order.
        shared_tiers: tiers whose blocks every engine can load.

    Returns:
        ``(tokens per engine, tokens on shared tiers)``; the second is the largest leading
        run on a shared tier of any instance in the answer.
    """
    scores = answer.get("scores") or {}
    tiers = answer.get("tiers") or {}
    shared = max((int(n) for ranks in tiers.values() for media in ranks.values()
                  for t, n in media.items() if t in shared_tiers), default=0)
    local = [int(max(scores.get(str(i), {}).values(), default=0)) for i in instance_ids]
    return [max(n, shared) for n in local], shared


class KvRouter:
    """Dynamo's KV-aware rule (module doc) over ``POST /query``.

    Args:
        http: client of the advisor's API (base URL and auth set).
        model_name: the index's model name (each engine registered under it).
        instance_ids: the indexer ``instance_id`` of each engine, in engine order.
        block_size: tokens per block.
        overlap_weight: weight of the prefill blocks against the active blocks (Dynamo's
            ``overlap_score_weight``, default 1.0).
        shared_tiers: tiers of the answer that every engine loads from.
    """

    name = "kv-aware"

    def __init__(self, http: httpx.AsyncClient, model_name: str, instance_ids: Sequence[int], block_size: int,
                 overlap_weight: float = 1.0, shared_tiers: Collection[str] = SHARED_TIERS) -> None:
        self.http = http
        self.model_name = model_name
        self.instance_ids = list(instance_ids)
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.shared_tiers = frozenset(shared_tiers)
        n = len(self.instance_ids)
        self.decode_blocks = [0] * n
        self.queued_prefill = [0] * n
        self.in_flight = [0] * n
        self._prefilling: set[int] = set()
        self._tickets = itertools.count(1)
        self._rr = 0
        self.stats = RouterStats()

    async def overlaps(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """:func:`engine_overlaps` of the index's answer for ``tokens`` (all 0 where no
        engine has published an event yet, or the query fails: counted in
        ``stats.query_errors``)."""
        zero = ([0] * len(self.instance_ids), 0)
        try:
            r = await self.http.post("/query", json={"token_ids": list(tokens), "model_name": self.model_name})
            if r.status_code == 404:  # no engine has published an event yet
                return zero
            r.raise_for_status()
            answer = r.json()
        except httpx.HTTPError:
            self.stats.query_errors += 1
            return zero
        return engine_overlaps(answer, self.instance_ids, self.shared_tiers)

    async def choose(self, tokens: Sequence[int]) -> Choice:
        """The engine of lowest cost (module doc) for ``tokens``, its load counted."""
        overlap, shared = await self.overlaps(tokens)
        return self.pick(len(tokens), overlap, shared)

    async def choose_many(self, prompts: Sequence[Sequence[int]]) -> list[Choice]:
        """Route requests that arrived together: every ``POST /query`` at once, then
        :meth:`pick` for each prompt in order (each sees the load of those before it).

        A router whose index lives in its process (Dynamo's) decides a burst in microseconds,
        so the requests of a burst reach their engines together.  One query after the other
        over HTTP would spread the burst by the queries' round trips, and an engine would
        start a step with the burst's first prompt alone while the rest wait for that step
        (docs/BENCHMARKS.md, the whole loop with vLLM).
        """
        answers = await asyncio.gather(*(self.overlaps(p) for p in prompts))
        return [self.pick(len(p), overlap, shared) for p, (overlap, shared) in zip(prompts, answers)]

    def pick(self, n_tokens: int, overlap: Sequence[int], shared: int = 0) -> Choice:
        """Choose for a prompt of ``n_tokens`` tokens given each engine's overlap in tokens
        (``shared``: of it, tokens on shared tiers, for the stats); counts the request's
        load on the chosen engine until :meth:`first_token` / :meth:`finished`."""
        n = len(self.instance_ids)
        blocks = -(-n_tokens // self.block_size)
        order = [(self._rr + k) % n for k in range(n)]

        def new_prefill(w: int) -> int:
            return blocks - min(blocks, overlap[w] // self.block_size)

        def cost(w: int) -> tuple[float, int, int]:
            prefill = self.queued_prefill[w] + new_prefill(w)
            active = self.decode_blocks[w] + blocks
            return (self.overlap_weight * prefill + active, self.in_flight[w], order.index(w))

        best = min(range(n), key=cost)
        self._rr = (best + 1) % n
        choice = Choice(best, tuple(overlap), next(self._tickets), blocks, new_prefill(best))
        self.decode_blocks[best] += blocks
        self.queued_prefill[best] += choice.prefill_blocks
        self.in_flight[best] += 1
        self._prefilling.add(choice.ticket)
        self.stats.per_engine[best] += 1
        if max(overlap, default=0) > 0:
            self.stats.with_overlap += 1
            self.stats.with_shared_overlap += int(shared > 0)
            self.stats.to_best_overlap += int(overlap[best] == max(overlap))
        return choice

    def first_token(self, choice: Choice) -> None:
        """The request's first token arrived: its prefill is no longer queued."""
        if choice.ticket in self._prefilling:
            self._prefilling.discard(choice.ticket)
            self.queued_prefill[choice.engine] -= choice.prefill_blocks

    def finished(self, choice: Choice, tokens: Sequence[int]) -> None:
        """The request left its engine (done or failed): none of its load counts."""
        self.first_token(choice)
        self.decode_blocks[choice.engine] -= choice.blocks
        self.in_flight[choice.engine] -= 1
