"""Which workers hold which prefix, for one (model_name, tenant_id): the index behind the
indexer-compatible routes (:mod:`api.indexer`, docs/operations.md "Indexer API").

Blocks are keyed by their token chain hash (:mod:`api.token_hashes`), so a walk over the
chain hashes of a query is a walk down a radix tree of token blocks: the walk stops at the
first block no worker holds, and a worker's score is the number of leading blocks it holds
(contiguously from the first), times ``block_size`` tokens.

Per worker ``(instance_id, dp_rank)`` the index keeps the worker's own block hashes (the
ones its events name, e.g. vLLM's) mapped to chain hashes, so Removes and parents resolve;
copies are refcounted per medium (a worker may send one ``BlockRemoved`` per physical copy),
and a block leaves a worker only when its last copy does. A Store whose parent the worker
never stored is refused (counted in ``parent_unknown``), as Dynamo's indexer does.

Thread-safe: one lock per index; every method takes it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from api.token_hashes import chain_hash, chain_hashes

WorkerKey = tuple[int, int]
"""``(instance_id, dp_rank)``."""


@dataclass
class _Block:
    """One block of one worker: chain hash, local hash, parent (worker's hash), copies per medium."""

    chain: int
    local: int
    parent: int | None
    copies: dict[str, int] = field(default_factory=dict)


@dataclass
class IndexCounters:
    """Anomalies and work done by one index (all monotonic counts)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    parent_unknown: int = 0
    unknown_removes: int = 0
    bad_block_size: int = 0
    queries: int = 0


class BlockBudget:
    """The block quotas of a registry's indexes: at most ``max_worker_blocks`` entries per
    worker of one index and ``max_blocks`` in all the indexes sharing the budget. An entry is
    one block on one medium (a block held on several media counts once per medium: what the
    index keeps grows with each). Thread-safe.

    Attributes:
        held: entries held in all the indexes.
        refused: blocks refused, per reason (``worker_blocks``, ``blocks``).
    """

    def __init__(self, max_worker_blocks: int = 1 << 17, max_blocks: int = 1 << 21) -> None:
        self.max_worker_blocks = max_worker_blocks
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self.held = 0
        self.refused = {"worker_blocks": 0, "blocks": 0}

    def take(self, worker_held: int) -> str | None:
        """Take one entry for a worker holding ``worker_held``; the reason when refused."""
        with self._lock:
            if worker_held >= self.max_worker_blocks:
                self.refused["worker_blocks"] += 1
                return "worker_blocks"
            if self.held >= self.max_blocks:
                self.refused["blocks"] += 1
                return "blocks"
            self.held += 1
            return None

    def give(self, n: int) -> None:
        """Give ``n`` entries back."""
        with self._lock:
            self.held -= n

    def refuse(self, reason: str, n: int) -> None:
        """Count ``n`` more blocks refused for ``reason`` (the rest of a refused Store)."""
        with self._lock:
            self.refused[reason] += n

    def as_dict(self) -> dict[str, object]:
        """``{"blocks": held, "max_worker_blocks", "max_blocks", "refused_blocks": {reason: n}}``."""
        with self._lock:
            return {"blocks": self.held, "max_worker_blocks": self.max_worker_blocks, "max_blocks": self.max_blocks,
                    "refused_blocks": dict(self.refused)}


@dataclass(frozen=True)
class Overlap:
    """Answer to a query: per worker, matched blocks; per depth, holders.

    Attributes:
        blocks: ``{(instance_id, dp_rank): leading blocks held}``, only workers with ≥ 1.
        frequencies: for each matched depth, how many workers hold that block.
        tiers: ``{(instance_id, dp_rank): {medium: leading blocks held on that medium}}``.
    """

    blocks: dict[WorkerKey, int]
    frequencies: list[int]
    tiers: dict[WorkerKey, dict[str, int]]


class WorkerIndex:
    """The prefix index of one (model_name, tenant_id).

    Args:
        block_size: tokens per block, fixed for the index.
        budget: the block quotas (:class:`BlockBudget`), shared by a registry's indexes;
            by default one of its own at the default limits.
    """

    def __init__(self, block_size: int, budget: BlockBudget | None = None) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.budget = budget if budget is not None else BlockBudget()
        self._lock = threading.Lock()
        self._workers: dict[WorkerKey, dict[int, _Block]] = {}
        self._entries: dict[WorkerKey, int] = {}  # worker -> (block, medium) entries it holds
        self._holders: dict[int, dict[WorkerKey, dict[str, int]]] = {}
        self.counters = IndexCounters()

    # ------------------------------------------------------------------ events
    def stored(
        self,
        worker: WorkerKey,
        block_hashes: Sequence[int],
        parent: int | None,
        local_hashes: Sequence[int],
        medium: str = "GPU",
        chains: Sequence[int] | None = None,
        copies: int = 1,
    ) -> int:
        """Apply one Store of consecutive blocks (``copies`` physical copies of each at once:
        the work is one step per block, whatever ``copies``).

        Args:
            worker: ``(instance_id, dp_rank)``.
            block_hashes: the worker's hashes of the blocks (u64), first block first.
            parent: the worker's hash of the block before the first, ``None`` at a prefix start.
            local_hashes: local (tokens) hash of each block, same length as ``block_hashes``.
            medium: where the copy lives (``GPU``, ``CPU``, ``DISK``...).
            chains: chain hashes of the blocks when already known (a dump being loaded);
                then ``parent`` need not be indexed.

        Returns:
            Blocks applied (0 when the parent is unknown or the lengths differ). A block
            new on ``medium`` beyond the quotas (:class:`BlockBudget`) is refused with the
            rest of the Store (they would chain to it), counted in the budget.
        """
        if len(block_hashes) != len(local_hashes) or (chains is not None and len(chains) != len(block_hashes)):
            return 0
        with self._lock:
            created = worker not in self._workers
            blocks = self._workers.setdefault(worker, {})
            parent_chain: int | None = None
            if chains is None and parent is not None:
                rec = blocks.get(parent)
                if rec is None:
                    self.counters.parent_unknown += 1
                    return 0
                parent_chain = rec.chain
            prev = parent
            n = len(block_hashes)
            for i, (h, local) in enumerate(zip(block_hashes, local_hashes)):
                rec = blocks.get(h)
                if rec is None or medium not in rec.copies:
                    refused = self.budget.take(self._entries.get(worker, 0))
                    if refused is not None:
                        self.budget.refuse(refused, n - i - 1)
                        n = i
                        break
                    self._entries[worker] = self._entries.get(worker, 0) + 1
                if rec is None:
                    c = chains[i] if chains is not None else chain_hash(parent_chain, local)
                    rec = _Block(c, local, prev)
                    blocks[h] = rec
                rec.copies[medium] = rec.copies.get(medium, 0) + copies
                media = self._holders.setdefault(rec.chain, {}).setdefault(worker, {})
                media[medium] = media.get(medium, 0) + copies
                parent_chain, prev = rec.chain, h
            if created and not blocks:
                del self._workers[worker]  # refused whole: no empty worker left behind
            self.counters.stored_blocks += n
            return n

    def removed(self, worker: WorkerKey, block_hashes: Iterable[int], medium: str = "GPU") -> int:
        """Drop one copy of each block on ``medium``; returns copies dropped (unknown ones are counted)."""
        n = 0
        with self._lock:
            blocks = self._workers.get(worker, {})
            for h in block_hashes:
                rec = blocks.get(h)
                if rec is None or medium not in rec.copies:
                    self.counters.unknown_removes += 1
                    continue
                self._drop_copy(worker, blocks, h, rec, medium)
                n += 1
            self.counters.removed_blocks += n
        return n

    def cleared(self, worker: WorkerKey, medium: str | None = None) -> None:
        """The worker emptied its cache (``AllBlocksCleared``): forget its copies on
        ``medium`` (vLLM's reset of its prefix cache clears ``g1``; its G2 and volume
        copies, published by an offloading connector, stay), or all its blocks (``None``)."""
        with self._lock:
            if medium is None:
                self._forget(worker)
            else:
                blocks = self._workers.get(worker, {})
                for h, rec in list(blocks.items()):
                    if medium in rec.copies:
                        self._drop_copy(worker, blocks, h, rec, medium, rec.copies[medium])
            self.counters.cleared += 1

    def remove_worker(self, worker: WorkerKey) -> None:
        """Forget every block of ``worker`` and the worker itself."""
        with self._lock:
            self._forget(worker)
            self._workers.pop(worker, None)

    def _forget(self, worker: WorkerKey) -> None:
        self.budget.give(self._entries.pop(worker, 0))
        for rec in self._workers.get(worker, {}).values():
            holders = self._holders.get(rec.chain)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self._holders[rec.chain]
        if worker in self._workers:
            self._workers[worker] = {}

    def _drop_copy(self, worker: WorkerKey, blocks: dict[int, _Block], h: int, rec: _Block, medium: str,
                   count: int = 1) -> None:
        """Drop ``count`` copies of block ``h`` on ``medium`` (at most the ones held)."""
        left = rec.copies[medium] - count
        if left > 0:
            rec.copies[medium] = left
        else:
            del rec.copies[medium]
            self._entries[worker] -= 1
            self.budget.give(1)
        holders = self._holders.get(rec.chain, {})
        media = holders.get(worker, {})
        if media.get(medium, 0) > count:
            media[medium] -= count
        else:
            media.pop(medium, None)
        if not media:
            holders.pop(worker, None)
        if not holders:
            self._holders.pop(rec.chain, None)
        if not rec.copies:
            del blocks[h]

    # ------------------------------------------------------------------ queries
    def overlap(self, local_hashes: Sequence[int]) -> Overlap:
        """Workers' leading blocks of the prefix whose local hashes are given (first block first)."""
        scores: dict[WorkerKey, int] = {}
        tiers: dict[WorkerKey, dict[str, int]] = {}
        freqs: list[int] = []
        chains = chain_hashes(local_hashes)
        depth = 0
        with self._lock:
            self.counters.queries += 1
            hget = self._holders.get
            # worker -> media it has held at every depth so far
            active: dict[WorkerKey, set[str]] | None = None
            for c in chains:
                holders = hget(c)
                if not holders:
                    break
                if active is None:
                    active = {w: set(m) for w, m in holders.items()}
                else:
                    for w in list(active):
                        media = holders.get(w)
                        live = active[w]
                        if media is None:  # the worker's prefix ends here
                            scores[w] = depth
                            tiers[w] = dict.fromkeys(live, depth)
                            del active[w]
                        elif not live <= media.keys():  # a medium's prefix ends here
                            wt = tiers.setdefault(w, {})
                            for m in live - media.keys():
                                wt[m] = depth
                            live &= media.keys()
                    if not active:
                        break
                freqs.append(len(holders))
                depth += 1
            for w, live in (active or {}).items():
                scores[w] = depth
                tiers.setdefault(w, {}).update(dict.fromkeys(live, depth))
        return Overlap(scores, freqs, tiers)

    def tree_sizes(self) -> dict[WorkerKey, int]:
        """Blocks per worker."""
        with self._lock:
            return {w: len(b) for w, b in self._workers.items()}

    def workers(self) -> list[WorkerKey]:
        """Workers that have sent at least one event or were loaded."""
        with self._lock:
            return list(self._workers)

    def dump(self) -> list[dict[str, Any]]:
        """Every block as a Store event, parents before children per worker.

        Shape of each event: ``{"instance_id", "dp_rank", "event": {"stored": {"parent_hash",
        "medium", "copies", "blocks": [{"block_hash", "tokens_hash", "sequence_hash"}]}}}``,
        hashes as u64 ints. :meth:`load` applies it back.
        """
        out: list[dict[str, Any]] = []
        with self._lock:
            for (inst, dp), blocks in self._workers.items():
                for h, rec in blocks.items():
                    for medium, n in rec.copies.items():
                        out.append({
                            "instance_id": inst,
                            "dp_rank": dp,
                            "event": {"stored": {
                                "parent_hash": rec.parent, "medium": medium, "copies": n,
                                "blocks": [{"block_hash": h, "tokens_hash": rec.local, "sequence_hash": rec.chain}],
                            }},
                        })
        return out

    def load(self, events: Iterable[Mapping[str, Any]]) -> int:
        """Apply events in :meth:`dump`'s shape; returns blocks applied.

        Raises:
            KeyError, TypeError, ValueError: an event not in that shape (nothing after it is applied).
        """
        n = 0
        for ev in events:
            st = ev["event"]["stored"]
            worker = (int(ev["instance_id"]), int(ev["dp_rank"]))
            blocks = st["blocks"]
            for _ in range(int(st.get("copies", 1))):
                n += self.stored(
                    worker, [int(b["block_hash"]) for b in blocks], st.get("parent_hash"),
                    [int(b["tokens_hash"]) for b in blocks], str(st.get("medium", "GPU")),
                    chains=[int(b["sequence_hash"]) for b in blocks],
                )
        return n
