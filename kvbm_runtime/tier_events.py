"""What the connector holds beyond the engine's own cache (G1), as KV events for the
engine's own KV-event stream: ``BlockStored`` / ``BlockRemoved`` with a ``medium``.

Why.  A KV-aware router indexes each engine's KV events (NVIDIA Dynamo's KV router, or the
advisor's indexer API: docs/operations.md, "Indexer API").  An engine's own events say
what its G1 holds; with a small G1 a prefix is evicted from it long before it comes back,
while the connector still holds it in G2 or on a volume and would load it.  vLLM (≥ 0.32)
publishes a connector's events with its own: after folding a step's worker output
(``update_connector_output``) the scheduler calls the connector's ``take_events()`` and
publishes what it returns in the same batch, after the engine's own events of that step.

What the scheduler side learns, and the events it makes of it, in the order it learns it:

* the workers' residency reports (:mod:`kvbm_runtime.residency`): a block every rank now
  holds in G2 → Store(``CPU``); on a volume → Store(the volume's medium); a block no
  longer held there → Remove of the medium it was announced with;
* the placement catalog (shared volumes, :func:`kvbm_runtime.leader.shared_lookup`): at
  each prefix match the leader asks where blocks are now.  A block announced on a volume
  that the catalog now places on a volume of another medium (the advisor demoted it to
  S3) → Remove(old) + Store(new); one the catalog no longer holds (evicted, quarantined)
  → Remove; one of the blocks this engine saved that the catalog now places on a volume,
  not announced yet (stored there by another engine, or before this engine's report) →
  Store.

Media (the names vLLM's and SGLang's events use, and Dynamo's): ``CPU`` for G2; ``DISK``
for a POSIX volume; ``EXTERNAL`` for any other volume (S3).  The advisor's indexer maps them
to tiers ``g2``, ``g3``, ``g4``.

Identity.  Hashes are the engine's own block hashes (for vLLM the u64 its events carry), so
the blocks are the ones its G1 events name.  A Store carries the block's parent (the
previous block of the request that saved it; ``None`` for a first block), its token ids
(``block_size`` per hash) and LoRA name, so an index keyed by tokens chains it under the
same parent as the engine's own Store.  Consecutive Stores of one medium that form a chain
are one event, as the engine's are.

Quotas (both bound memory whatever the load; each overflow is counted in
:class:`TierEventStats`):

* ``max_blocks`` (default :data:`DEFAULT_MAX_BLOCKS`): blocks whose token ids, parent and
  announced media are remembered, least recently used first out (4 bytes per token; with
  the bookkeeping about 370 B per 32-token block, measured: 23 MiB at the default).  A
  block is remembered when the engine lists it for saving; its Store is announced only
  while it is remembered (else counted in ``unknown_tokens``).  A Remove of a forgotten block is still announced (for a volume
  whose medium is not known: once per volume medium in use; a receiver counts Removes of
  blocks it does not hold and drops nothing else).
* ``max_pending`` (default :data:`DEFAULT_MAX_PENDING`): blocks in events not taken yet.
  vLLM takes them once per engine step, so this fills only when one step's worker output
  changes more blocks than that; further events are dropped (``dropped_blocks``, logged
  once), which leaves a router's index short of a block or holding a stale one until the
  block changes again: the index is advisory, the engine's own lookups are not affected.

Thread-safe (one lock).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from storage_backends.types import VolumeKind

from .residency import HOST, REMOVED, STORED, Transition

logger = logging.getLogger(__name__)

MEDIUM_CPU = "CPU"
"""Medium of G2 (host memory) in KV events."""
MEDIUM_DISK = "DISK"
"""Medium of a POSIX volume in KV events."""
MEDIUM_EXTERNAL = "EXTERNAL"
"""Medium of any other volume (object storage) in KV events."""

DEFAULT_MAX_BLOCKS = 65_536
"""Blocks whose token ids are remembered for their Stores (module doc, "Quotas")."""
DEFAULT_MAX_PENDING = 16_384
"""Blocks in events waiting for the engine to take them (module doc, "Quotas")."""


def volume_medium(kind: VolumeKind | str) -> str:
    """The KV-event medium of a volume of ``kind``: ``DISK`` for POSIX, else ``EXTERNAL``."""
    return MEDIUM_DISK if VolumeKind(kind) == VolumeKind.POSIX else MEDIUM_EXTERNAL


@dataclass(slots=True)
class TierEvent:
    """One Store or Remove of consecutive blocks on one medium.

    Attributes:
        op: :data:`~kvbm_runtime.residency.STORED` or :data:`~kvbm_runtime.residency.REMOVED`.
        medium: ``CPU``, ``DISK`` or ``EXTERNAL``.
        hashes: the blocks' hashes (u64), in order; a Store's form a chain (block i's
            parent is block i - 1).
        parent: (Store) the first block's parent, ``None`` for a first block.
        token_ids: (Store) ``block_size`` token ids per hash, in order.
        lora_name: (Store) the LoRA adapter of the blocks, ``None`` for the base model.
    """

    op: str
    medium: str
    hashes: list[int]
    parent: int | None = None
    token_ids: list[int] = field(default_factory=list)
    lora_name: str | None = None


@dataclass(slots=True)
class TierEventStats:
    """Counters of a :class:`TierEventLog` (blocks).

    Attributes:
        stored_blocks / removed_blocks: blocks announced in Stores / Removes.
        unknown_tokens: Stores not announced: the block's token ids were forgotten (or
            never seen: saved before the engine started).
        dropped_blocks: blocks of events dropped over ``max_pending``.
    """

    stored_blocks: int = 0
    removed_blocks: int = 0
    unknown_tokens: int = 0
    dropped_blocks: int = 0


@dataclass(slots=True)
class _Known:
    """A block the engine saved: its parent, token ids, LoRA, and what was announced."""

    parent: int | None
    tokens: array
    lora: str | None
    cpu: bool = False
    storage: str | None = None  # the medium its volume copy was announced on


class TierEventLog:
    """The connector's Stores and Removes for the engine's KV-event stream (module doc).

    Args:
        block_size: tokens per block.
        volume_media: medium per volume id (:func:`volume_medium` of its kind); a volume
            not listed is announced as ``EXTERNAL``.
        max_blocks: blocks remembered (module doc, "Quotas").
        max_pending: blocks in events not taken yet (module doc, "Quotas").

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, block_size: int, volume_media: Mapping[str, str], *, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if block_size < 1 or max_blocks < 1 or max_pending < 1:
            raise ValueError(f"block_size, max_blocks and max_pending must be >= 1, got {block_size}, {max_blocks}, {max_pending}")
        self.block_size = block_size
        self.volume_media = dict(volume_media)
        self.max_blocks = max_blocks
        self.max_pending = max_pending
        self.stats = TierEventStats()
        self._known: OrderedDict[int, _Known] = OrderedDict()
        self._pending: list[TierEvent] = []
        self._pending_blocks = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ inputs
    def remember(self, hashes: Sequence[int], token_ids: Sequence[int], blocks: range,
                 lora_name: str | None = None) -> None:
        """Remember blocks ``blocks`` of a request the engine lists for saving.

        Args:
            hashes: the request's block hashes from its first block (at least up to
                ``blocks.stop``).
            token_ids: the request's token ids from its first token (at least
                ``blocks.stop × block_size``).
            blocks: the indexes of the blocks to remember.
            lora_name: the request's LoRA adapter.

        Raises:
            ValueError: fewer hashes or token ids than ``blocks`` needs.
        """
        bs = self.block_size
        if blocks.stop > len(hashes) or blocks.stop * bs > len(token_ids):
            raise ValueError(f"blocks up to {blocks.stop} need {blocks.stop} hashes and {blocks.stop * bs} tokens, "
                             f"got {len(hashes)} and {len(token_ids)}")
        with self._lock:
            known = self._known
            for i in blocks:
                h = hashes[i]
                rec = known.get(h)
                if rec is None:
                    known[h] = _Known(hashes[i - 1] if i else None, array("I", token_ids[i * bs : (i + 1) * bs]), lora_name)
                else:
                    known.move_to_end(h)
            while len(known) > self.max_blocks:
                known.popitem(last=False)

    def residency(self, transitions: Iterable[Transition]) -> None:
        """Announce the residency changes of a worker report, in their order
        (:meth:`kvbm_runtime.leader.KvbmLeader.apply_report`'s result)."""
        with self._lock:
            for op, tier, h in transitions:
                rec = self._touch(h)
                if tier == HOST:
                    self._host(op, h, rec)
                else:
                    self._storage(op, h, rec, self.volume_media.get(tier) if tier in self.volume_media
                                  else (MEDIUM_EXTERNAL if op == STORED else None))

    def catalog(self, hashes: Sequence[int], volumes: Sequence[str | None]) -> None:
        """What the placement catalog says now of ``hashes`` (per block, the volume holding
        it or ``None``): announce the changes of the blocks this engine saved."""
        with self._lock:
            for h, v in zip(hashes, volumes):
                rec = self._known.get(h)
                if rec is None:
                    continue
                new = None if v is None else self.volume_media.get(v, MEDIUM_EXTERNAL)
                if new != rec.storage:
                    self._known.move_to_end(h)
                    self._move(h, rec, new)

    def take(self) -> list[TierEvent]:
        """The events since the last call, in order (empties the log)."""
        with self._lock:
            out, self._pending, self._pending_blocks = self._pending, [], 0
        return out

    # ------------------------------------------------------------------ rules
    def _touch(self, h: int) -> _Known | None:
        rec = self._known.get(h)
        if rec is not None:
            self._known.move_to_end(h)
        return rec

    def _host(self, op: str, h: int, rec: _Known | None) -> None:
        if op == STORED:
            if rec is None:
                self.stats.unknown_tokens += 1
            elif not rec.cpu:
                rec.cpu = self._emit(STORED, MEDIUM_CPU, h, rec)
        elif rec is None or rec.cpu:
            if rec is not None:
                rec.cpu = False
            self._emit(REMOVED, MEDIUM_CPU, h, None)

    def _storage(self, op: str, h: int, rec: _Known | None, medium: str | None) -> None:
        if op == STORED:
            if rec is None:
                self.stats.unknown_tokens += 1
            elif medium != rec.storage:
                self._move(h, rec, medium)
        elif rec is not None:
            self._move(h, rec, None)
        else:  # forgotten: the medium of the volume, or of every volume when unknown
            for m in [medium] if medium is not None else sorted(set(self.volume_media.values())) or [MEDIUM_EXTERNAL]:
                self._emit(REMOVED, m, h, None)

    def _move(self, h: int, rec: _Known, new: str | None) -> None:
        """The block's volume copy is announced on ``new`` (``None``: on none) now."""
        if rec.storage is not None:
            self._emit(REMOVED, rec.storage, h, None)
        rec.storage = new if new is not None and self._emit(STORED, new, h, rec) else None

    def _emit(self, op: str, medium: str, h: int, rec: _Known | None) -> bool:
        """Append one block's event (to the last event when it continues it); ``False``
        when the pending quota dropped it."""
        if self._pending_blocks >= self.max_pending:
            if not self.stats.dropped_blocks:
                logger.warning("KV events of the connector's tiers: more than %d blocks pending, dropping events "
                               "(a router's index misses them until the blocks change again)", self.max_pending)
            self.stats.dropped_blocks += 1
            return False
        self._pending_blocks += 1
        last = self._pending[-1] if self._pending else None
        if op == STORED:
            assert rec is not None
            self.stats.stored_blocks += 1
            if (last is not None and last.op == STORED and last.medium == medium and last.lora_name == rec.lora
                    and rec.parent == last.hashes[-1]):
                last.hashes.append(h)
                last.token_ids.extend(rec.tokens)
            else:
                self._pending.append(TierEvent(STORED, medium, [h], rec.parent, list(rec.tokens), rec.lora))
        else:
            self.stats.removed_blocks += 1
            if last is not None and last.op == REMOVED and last.medium == medium:
                last.hashes.append(h)
            else:
                self._pending.append(TierEvent(REMOVED, medium, [h]))
        return True
