"""Tiering policies: hot promotion, cold demotion, compaction of sparse segments.

Each policy is a pure function of its settings, a :class:`PolicyInput` (volume usage and
catalog facts gathered by the service) and the :class:`~advisor.index.prefix_index.PrefixIndex`
(block hits, last access and lineage).  It returns :class:`~advisor.policy.plan.PlanItem` s,
each with a ``reason``; the planner then applies rate limits and the mover executes them.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from pydantic import BaseModel, Field, model_validator

from advisor.policy.eviction.experts import EXPERTS, SelectorSettings
from advisor.policy.eviction.live_scoring import BlockFacts, FinishView, LiveScorer, expert_rank
from advisor.policy.eviction.prefix_value import PrefixValueSettings
from advisor.index.prefix_index import PrefixIndex
from advisor.policy.plan import PlanItem, PlanKind


class SegmentLike(Protocol):
    """What compaction reads of a segment (``storage_backends.SegmentInfo``)."""

    segment_id: int
    volume_id: str
    size_bytes: int
    live_bytes: int
    live_blocks: int


class PlacementLike(Protocol):
    """What demotion reads of a placement (``storage_backends.Placement``)."""

    @property
    def key(self) -> object: ...  # BlockKey(namespace, sequence_hash)

    volume_id: str
    segment_id: int
    length: int


class PromotionSettings(BaseModel):
    """Hot promotion, one tier up: slow → fast, and archive → slow.

    Attributes:
        enabled: run this policy.
        min_hits: a block qualifies at ``hits >= min_hits``.
        max_fill: never promote a volume past this fraction of its capacity; the demotion
            ``high_watermark`` caps it as well (a promotion never fills a tier above its
            demotion watermark, so the next round does not demote what this one promoted).
        from_archive: also promote hot blocks from the archive (S3) volume to the first
            slow volume (one tier up, under the slow volume's watermark).
        max_swaps: when the fast volume has no room left under its limit, up to this many
            qualifying blocks per round replace fast leaves that rank lower (one demotion to
            the slow tier per promotion; :func:`plan_swaps`), so a full fast volume does not
            freeze with its first promotions; ``0`` = never.
    """

    enabled: bool = True
    min_hits: int = Field(2, ge=1)
    max_fill: float = Field(0.8, gt=0.0, le=1.0)
    from_archive: bool = True
    max_swaps: int = Field(32, ge=0)


class DemotionSettings(BaseModel):
    """Cold demotion, one tier down: a fast volume above ``high_watermark`` → the first slow
    volume with room (else the archive); a slow volume above it → the archive.

    Attributes:
        enabled: run this policy.
        high_watermark: fraction of capacity (used bytes) that triggers demotion.
        low_watermark: demote cold blocks until live bytes fall to this fraction of
            capacity; hot blocks (``hits >= promotion.min_hits``) only until live bytes
            fall to ``high_watermark``.
    """

    enabled: bool = True
    high_watermark: float = Field(0.8, gt=0.0, le=1.0)
    low_watermark: float = Field(0.6, ge=0.0, lt=1.0)
    scoring: Literal["experts", "lru", "prefix_value"] = "experts"
    """Order of the leaves: the default policy (``experts``: the order of the expert the
    selector leads with, :class:`advisor.policy.eviction.experts.LiveSelector` and
    :func:`advisor.policy.eviction.live_scoring.expert_rank`; the first leader while no selector
    runs), one expert alone (``prefix_value``, the evaluator's rule and settings), or least
    recently used (``lru``, the evaluator's baseline)."""
    horizon_s: float = Field(600.0, gt=0.0)
    """Horizon of the ranks (``prefix_value``'s priority, the experts' frequency credit), seconds."""

    @model_validator(mode="after")
    def _order(self) -> DemotionSettings:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"demotion low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        return self


class CompactionSettings(BaseModel):
    """Compaction: rewrite segments whose live fraction fell under ``live_fraction``.

    Attributes:
        enabled: run this policy.
        live_fraction: a segment with ``live_bytes / size_bytes`` below this is compacted.
        min_dead_bytes: ignore segments with fewer dead bytes than this.
    """

    enabled: bool = True
    live_fraction: float = Field(0.5, gt=0.0, le=1.0)
    min_dead_bytes: int = Field(0, ge=0)


class PlannerSettings(BaseModel):
    """Rate limits of one policy round.

    Attributes:
        max_moves_per_round: block moves (promotions + demotions) per round.
        max_bytes_per_round: bytes copied per round (moves + compactions).
        max_compactions_per_round: segments compacted per round.
        max_bytes_per_s / burst_bytes: token bucket on bytes copied (all rounds).
        max_concurrent_moves: items in flight at once (all rounds).
    """

    max_moves_per_round: int = Field(256, ge=0)
    max_bytes_per_round: int = Field(1 << 30, ge=0)
    max_compactions_per_round: int = Field(8, ge=0)
    max_bytes_per_s: float = Field(0.0, ge=0.0)
    """Token bucket on copied bytes across rounds (bytes per second); ``0`` = unlimited."""
    burst_bytes: int = Field(0, ge=0)
    """Bucket depth in bytes; ``0`` = one second of ``max_bytes_per_s``."""
    max_concurrent_moves: int = Field(0, ge=0)
    """Items (moves + compactions) planned but not yet finished, over all rounds and
    callers; ``0`` = unlimited."""
    min_move_interval_s: float = Field(600.0, ge=0.0)
    """A block moved less than this many seconds ago is not moved again unless new events
    touched it (its last access changed); ``0`` = no limit (:mod:`advisor.moves.move_guard`)."""


class SelectorLiveSettings(BaseModel):
    """The live advisor's expert selection (:class:`advisor.policy.eviction.experts.LiveSelector`;
    its switching rule is the evaluator's, :class:`advisor.policy.eviction.experts.SelectorSettings`).

    Attributes:
        sample_rate: fraction of prefixes (by root hash) the shadow caches replay; the
            shadow caches hold ``sample_rate`` × the fast tier's capacity.
        max_window_refs: block references of the newest requests kept for the replay
            (the quota of the selector's state: 8 bytes each).
        min_new_refs: new references observed before the next replay.
        max_finish_hints: routers' finish hints kept (``POST /v1/finished``; past it the
            oldest hint of the API token holding the most is dropped; 0 = none taken).
        finish_reason_sources: publishers (``source``) whose Stores may carry a request's
            ``finish_reason`` in ``extra_metadata``; the others' is ignored (default none:
            a publisher could mark its own prefixes ``tool_calls`` to keep them cached).
    """

    sample_rate: float = Field(1.0, gt=0.0, le=1.0)
    max_window_refs: int = Field(1 << 20, ge=1)
    min_new_refs: int = Field(1, ge=1)
    max_finish_hints: int = Field(1 << 16, ge=0)
    finish_reason_sources: list[str] = Field(default_factory=list, max_length=4096)


class PolicySettings(BaseModel):
    """All policy knobs (nested in ``AdvisorSettings.policy``)."""

    promotion: PromotionSettings = Field(default_factory=PromotionSettings)
    demotion: DemotionSettings = Field(default_factory=DemotionSettings)
    compaction: CompactionSettings = Field(default_factory=CompactionSettings)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    prefix_value: PrefixValueSettings = Field(default_factory=PrefixValueSettings)
    """The ``prefix_value`` expert's settings, shared with ``kvadvisor evaluate``
    (:class:`advisor.policy.eviction.prefix_value.PrefixValueSettings`)."""
    selector: SelectorLiveSettings = Field(default_factory=SelectorLiveSettings)
    """The live expert selection (:class:`advisor.policy.eviction.experts.LiveSelector`)."""


@dataclass
class VolumeUsage:
    """Capacity and usage of one volume, in bytes."""

    capacity_bytes: int
    used_bytes: int
    live_bytes: int


@dataclass
class PolicyInput:
    """Facts the policies need besides the index, gathered before a round.

    Attributes:
        fast_volume: id of the fast volume (promotion target, demotion source).
        slow_volumes: ids of slow volumes (promotion sources).
        archive_volume: id of the archive (S3) volume (demotion target).
        usage: per volume id, capacity / used / live bytes.
        fast_placements: the catalog's placements on the fast volume.
        segments: per volume id, its segments.
        placements: the catalog's placements on each slow volume (demotion to the archive).
        movable: ``movable(sequence_hash)`` -> whether this planner may move the block
            (``None``: any).  Promotions and swaps take their candidates from the index,
            which may hold blocks that another planner moves (scaled mode: a trunk block
            is in every partition's index, moved by partition ``sequence_hash % P`` only);
            those are never planned here.  Demotions and compactions work from the
            placements and segments given, which the caller filters itself.
        held: ``held(sequence_hash)`` -> whether the move guard would hold back a move of
            the block now (``None``: none held; :meth:`advisor.moves.move_guard.MoveGuard.view`).
            A held block is neither a candidate nor a victim of any policy: promotions,
            demotions and swaps take the next best blocks instead, and a held leaf keeps
            its ancestors where they are (a prefix is never cut under it).
        superseded: sequence hashes the live selector's ``prefix_value`` replay ranks below
            every other block (:attr:`advisor.policy.eviction.experts.LiveSelector.superseded`);
            used while the ranking follows ``prefix_value`` (:func:`make_scorer`).
        finish: the live selector's ``finish_aware`` verdict (block states, learned gaps),
            used while the ranking follows ``finish_aware``; ``None``: prefix-LRU's order.
    """

    fast_volume: str | None
    slow_volumes: Sequence[str]
    archive_volume: str | None
    usage: dict[str, VolumeUsage] = field(default_factory=dict)
    fast_placements: Sequence[PlacementLike] = ()
    segments: dict[str, Sequence[SegmentLike]] = field(default_factory=dict)
    placements: dict[str, Sequence[PlacementLike]] = field(default_factory=dict)
    movable: Callable[[int], bool] | None = None
    held: Callable[[int], bool] | None = None
    superseded: Container[int] = frozenset()
    finish: FinishView | None = None

    def is_held(self, h: int) -> bool:
        """Whether the move guard holds block ``h`` (see ``held``)."""
        return self.held is not None and self.held(h)


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def make_scorer(settings: PolicySettings, index: PrefixIndex, hashes: Iterable[int],
                leader: str | None = None, superseded: Container[int] = frozenset(),
                finish: FinishView | None = None) -> Callable[[int], float]:
    """The ranking of blocks that promotion and demotion use (higher = hotter).

    With ``demotion.scoring = "experts"`` (default): the order of the expert ``leader``
    (the live selector's leader, :func:`~advisor.policy.eviction.live_scoring.expert_rank`;
    ``None`` = the selector's first leader, :attr:`~advisor.policy.eviction.experts.SelectorSettings.initial`);
    with ``"prefix_value"``: that
    expert alone (:class:`~advisor.policy.eviction.live_scoring.LiveScorer` with
    ``settings.prefix_value`` and ``demotion.horizon_s``), its class counts learned from the
    blocks ``hashes``; with ``"lru"``: the last access time (ns).  A block the index does not
    know scores 0.  Under ``prefix_value`` a block in ``superseded`` (the live selector's
    verdict, :attr:`PolicyInput.superseded`) ranks below every other block
    (:mod:`advisor.policy.eviction.live_scoring`, "Superseded first").  Under
    ``finish_aware`` each block ranks by its session's expected return (``finish``, the
    live selector's verdict; ranked now, wall clock).

    Raises:
        ValueError: ``leader`` is not an expert.
    """
    if settings.demotion.scoring == "lru":
        def lru(h: int) -> float:
            info = index.block(h)
            return float(info.last_access_ns) if info is not None else 0.0
        return lru
    expert = (leader or SelectorSettings().initial) if settings.demotion.scoring == "experts" else "prefix_value"
    if expert not in EXPERTS:
        raise ValueError(f"unknown expert {expert!r} (one of {', '.join(EXPERTS)})")
    scorer = LiveScorer(settings.prefix_value, settings.demotion.horizon_s)
    sup = superseded if expert == "prefix_value" else frozenset()
    facts: dict[int, BlockFacts] = {}
    for h in hashes:
        info = index.block(h)
        if info is not None and h not in facts:
            leaf = not any(c != h for c in index.children(h))
            facts[h] = BlockFacts(info.last_access_ns, info.hits, leaf, info.parent is not None)
    if expert == "prefix_value":
        scorer.learn(facts.values())  # the class counts: superseded blocks were referenced as any other

    view = finish if expert == "finish_aware" else None
    now_s = view.now_s if view is not None and view.now_s is not None else time.time()

    def score(h: int) -> float:
        f = facts.get(h)
        if f is None:
            info = index.block(h)
            if info is None:
                return 0.0
            f = BlockFacts(info.last_access_ns, info.hits, True, info.parent is not None)
        if h in sup:
            f = replace(f, superseded=True)
        if view is not None:
            f = replace(f, residual_s=view.residual_s(h, f.last_access_ns, now_s))
        return expert_rank(expert, f, scorer)
    score.expert = expert  # type: ignore[attr-defined]  # names the order in plan reasons
    score.superseded = sup  # type: ignore[attr-defined]
    return score


def _fill_budget(usage: VolumeUsage | None, max_fill: float) -> float:
    if usage is None:
        return float("inf")
    return max_fill * usage.capacity_bytes - usage.used_bytes


def _promote_level(settings: PromotionSettings, sources: Sequence[str], dst: str, budget: float,
                   index: PrefixIndex, score: Callable[[int], float] | None, skip: Callable[[int], bool],
                   max_fill: float) -> list[PlanItem]:
    """Hot blocks of ``sources`` (not held by ``dst``, not ``skip``-ped and not of a superseded
    branch, ``score.superseded``) up to ``dst``, hottest first, ancestors first, while
    ``budget`` bytes last."""
    if budget <= 0:
        return []
    cand: dict[int, tuple[str, int, float, int]] = {}  # h -> (src, hits, rank, size)
    superseded = getattr(score, "superseded", ())  # the ranking would demote them first: never promoted
    for src in sources:
        for h in index.blocks_at(src):
            if h in cand or index.holds(h, dst) or skip(h) or h in superseded:
                continue
            info = index.block(h)
            if info is not None and info.hits >= settings.min_hits:
                rank = score(h) if score is not None else float(info.last_access_ns)
                cand[h] = (src, info.hits, rank, info.size)
    if score is None:
        order = sorted(cand, key=lambda h: (-cand[h][1], -cand[h][2], h))
    else:
        order = sorted(cand, key=lambda h: (-cand[h][2], -cand[h][1], h))
    planned: set[int] = set()
    items: list[PlanItem] = []
    used = 0.0

    def emit(h: int) -> bool:
        nonlocal used
        src, hits, _rank, size = cand[h]
        if used + size > budget:
            return False
        used += size
        planned.add(h)
        items.append(
            PlanItem(
                PlanKind.PROMOTE,
                f"hits={hits} >= min_hits={settings.min_hits} on slow volume '{src}'; "
                f"volume '{dst}' stays under {_pct(max_fill)}",
                src,
                dst,
                sequence_hash=h,
                bytes=size,
            )
        )
        return True

    for h in order:
        if h in planned:
            continue
        # ancestors that also qualify go first (a prefix is only useful with its head)
        chain = [h]
        info = index.block(h)
        seen = {h}
        while info is not None and info.parent is not None and info.parent in cand and info.parent not in planned:
            if info.parent in seen:
                break
            seen.add(info.parent)
            chain.append(info.parent)
            info = index.block(info.parent)
        for x in reversed(chain):
            if not emit(x):
                return items
    return items


def plan_promotions(settings: PromotionSettings, inp: PolicyInput, index: PrefixIndex,
                    high_watermark: float = 1.0, score: Callable[[int], float] | None = None) -> list[PlanItem]:
    """Blocks with ``hits >= min_hits`` promoted one tier up: slow → fast, and (with
    ``from_archive``) archive → the first slow volume.

    Hottest first (``score`` descending when given, else hits then most recent access);
    an ancestor that also qualifies is always planned before its descendants, so a
    promoted prefix is never missing its head.  Stops when the target would pass
    ``min(max_fill, high_watermark)`` of its capacity, so a promotion never triggers the
    next round's demotion.
    """
    fast = inp.fast_volume
    if not settings.enabled:
        return []
    limit = min(settings.max_fill, high_watermark)
    items: list[PlanItem] = []
    movable = inp.movable

    def foreign(h: int) -> bool:
        return (movable is not None and not movable(h)) or inp.is_held(h)

    if fast is not None and inp.slow_volumes:
        budget = _fill_budget(inp.usage.get(fast), limit)
        items += _promote_level(settings, list(inp.slow_volumes), fast, budget, index, score, foreign, limit)
    if settings.from_archive and inp.archive_volume and inp.slow_volumes:
        slow = inp.slow_volumes[0]
        budget = _fill_budget(inp.usage.get(slow), limit)

        def on_faster(h: int) -> bool:
            return ((fast is not None and index.holds(h, fast)) or any(index.holds(h, v) for v in inp.slow_volumes)
                    or foreign(h))

        items += _promote_level(settings, [inp.archive_volume], slow, budget, index, score, on_faster, limit)
    elif settings.from_archive and inp.archive_volume and fast is not None and not inp.slow_volumes:
        budget = _fill_budget(inp.usage.get(fast), limit)
        items += _promote_level(settings, [inp.archive_volume], fast, budget, index, score, foreign, limit)
    return items


def _leaves_first(on_fast: dict[int, PlacementLike], index: PrefixIndex,
                  score: Callable[[int], float] | None = None,
                  pinned: Callable[[int], bool] | None = None) -> Iterator[tuple[float, int]]:
    """Yield ``(last_access_ns, h)`` for the blocks of ``on_fast``, least recently used leaf first.

    A block is yielded only after every child of it that is in ``on_fast`` was yielded,
    so taking any prefix of this order never leaves a child without its parent.  A
    ``pinned`` block (one the move guard holds) is never yielded, nor are its ancestors.
    """
    pending_children: dict[int, int] = {}
    heap: list[tuple[float, int]] = []
    for h in on_fast:
        n = sum(1 for c in index.children(h) if c in on_fast and c != h)
        if pinned is not None and pinned(h):
            n += 1  # never reaches 0: neither it nor (through it) its ancestors are yielded
        pending_children[h] = n
        if n == 0:
            info = index.block(h)
            heapq.heappush(heap, (score(h) if score else (info.last_access_ns if info else 0), h))
    while heap:
        last, h = heapq.heappop(heap)
        yield last, h
        info = index.block(h)
        parent = info.parent if info else None
        if parent is not None and parent in pending_children:
            pending_children[parent] -= 1
            if pending_children[parent] == 0:
                pinfo = index.block(parent)
                heapq.heappush(heap, (score(parent) if score else (pinfo.last_access_ns if pinfo else 0), parent))


def _demotion_target(inp: PolicyInput, high_watermark: float) -> str | None:
    """One tier down from the fast volume: the first slow volume under its high watermark
    (or whose usage is unknown), else the archive."""
    for v in inp.slow_volumes:
        u = inp.usage.get(v)
        if u is None or u.capacity_bytes <= 0 or u.used_bytes / u.capacity_bytes < high_watermark:
            return v
    return inp.archive_volume


def _demote_level(settings: DemotionSettings, src: str, dst: str, usage: VolumeUsage | None,
                  placements: Sequence[PlacementLike], segments: Sequence[SegmentLike], index: PrefixIndex,
                  compact_below: float, score: Callable[[int], float] | None, hot_hits: int | None,
                  held: Callable[[int], bool] | None = None) -> list[PlanItem]:
    """Demotions of one volume (``src``) one tier down (``dst``), never of a ``held`` block
    (nor of its ancestors); see :func:`plan_demotions`."""
    if usage is None or usage.capacity_bytes <= 0:
        return []
    fill = usage.used_bytes / usage.capacity_bytes
    if fill <= settings.high_watermark:
        return []
    on_src: dict[int, PlacementLike] = {}
    for p in placements:
        on_src.setdefault(p.key.sequence_hash, p)  # type: ignore[attr-defined]
    head = f"volume '{src}' at {_pct(fill)} > high watermark {_pct(settings.high_watermark)}; "

    def item(h: int, reason: str) -> PlanItem:
        p = on_src[h]
        return PlanItem(PlanKind.DEMOTE, head + reason, src, dst, sequence_hash=h,
                        namespace=p.key.namespace, bytes=p.length)  # type: ignore[attr-defined]

    need = usage.live_bytes - settings.low_watermark * usage.capacity_bytes
    need_hot = usage.live_bytes - settings.high_watermark * usage.capacity_bytes
    items: list[PlanItem] = []
    if need > 0:
        freed = 0
        rank_name = str(getattr(score, "expert", "ranked")).replace("_", "-")
        for last, h in _leaves_first(on_src, index, score, held):
            if freed >= need:
                break
            info = index.block(h)
            superseded = h in getattr(score, "superseded", ())
            if (hot_hits is not None and info is not None and info.hits >= hot_hits and freed >= need_hot
                    and not superseded):
                continue  # hot: demoted only as far as the high watermark (a superseded branch is not hot)
            freed += on_src[h].length
            sup = " of a superseded branch" if superseded else ""
            what = f"{rank_name} leaf{sup} (score {last:.0f})" if score else f"LRU leaf (last access ts {last})"
            items.append(item(h, f"{what} moved to '{dst}' until {_pct(settings.low_watermark)} live"))
        return items
    # the excess is dead space: compaction reclaims it if a sparse segment fits in the free space
    free = usage.capacity_bytes - usage.used_bytes
    segs = [s for s in segments if getattr(s, "sealed", True) and s.live_blocks > 0 and s.size_bytes > s.live_bytes]
    if not segs or any(s.live_bytes <= free and s.live_bytes < compact_below * s.size_bytes for s in segs):
        return []
    holding = {p.segment_id for h, p in on_src.items() if held is not None and held(h)}  # type: ignore[attr-defined]
    # a segment holding a guarded block could not be emptied now: the sparsest other one goes
    victim = min(segs, key=lambda s: (s.segment_id in holding, s.live_bytes / s.size_bytes, s.live_bytes,
                                      s.segment_id))
    members = {h: p for h, p in on_src.items() if p.segment_id == victim.segment_id}  # type: ignore[attr-defined]
    why = (f"no room to compact (free {free} B < live bytes of every sparse segment): evacuating segment "
           f"{victim.segment_id} ({_pct(victim.live_bytes / victim.size_bytes)} live) to '{dst}'")
    return [item(h, why) for _, h in _leaves_first(members, index, pinned=held)]


def plan_demotions(
    settings: DemotionSettings, inp: PolicyInput, index: PrefixIndex, compact_below: float = 0.5,
    score: Callable[[int], float] | None = None, hot_hits: int | None = None,
) -> list[PlanItem]:
    """Lowest-ranked *leaves* of a full volume, moved one tier down.

    The fast volume demotes to the first slow volume under its high watermark (the archive
    only when every slow volume is above it); each slow volume demotes to the archive.  A
    volume demotes when its used bytes exceed ``high_watermark`` × capacity, until its live
    bytes would be at most ``low_watermark`` × capacity; a hot block (``hits >= hot_hits``)
    only while live bytes are above ``high_watermark`` × capacity.  Order: ``score``
    ascending (default: last access, least recent first); blocks the index does not know
    go first.  A block becomes a candidate only once none of its children remain on the
    volume (leaves first), so a cached prefix is never cut in the middle.

    When live bytes are already at the low watermark, the excess is dead space, which
    compaction reclaims.  If no sparse segment (live fraction < ``compact_below``) can be
    compacted because its live bytes do not fit in the free space, the volume would stay
    over its watermark forever; then the sparsest segment is *evacuated*: all its live
    blocks are demoted (leaves first), and the agent drops the emptied segment.
    """
    if not settings.enabled:
        return []
    if score is None and settings.scoring != "lru":
        pol = PolicySettings(demotion=settings)
        hashes = [p.key.sequence_hash for p in inp.fast_placements]  # type: ignore[attr-defined]
        for ps in inp.placements.values():
            hashes += [p.key.sequence_hash for p in ps]  # type: ignore[attr-defined]
        score = make_scorer(pol, index, hashes)
    items: list[PlanItem] = []
    fast = inp.fast_volume
    if fast is not None:
        dst = _demotion_target(inp, settings.high_watermark)
        if dst is not None:
            items += _demote_level(settings, fast, dst, inp.usage.get(fast), inp.fast_placements,
                                   inp.segments.get(fast, ()), index, compact_below, score, hot_hits, inp.held)
    if inp.archive_volume is not None:
        for v in inp.slow_volumes:
            items += _demote_level(settings, v, inp.archive_volume, inp.usage.get(v), inp.placements.get(v, ()),
                                   inp.segments.get(v, ()), index, compact_below, score, hot_hits, inp.held)
    return items


def plan_compactions(settings: CompactionSettings, inp: PolicyInput) -> list[PlanItem]:
    """Segments whose live fraction is below ``live_fraction`` (sparsest first).

    A compaction writes the live blocks to a new segment before the old one is dropped,
    so a segment is planned only if its live bytes fit in the volume's free space
    (capacity - used, when ``inp.usage`` knows the volume); each planned compaction then
    frees ``size - live`` bytes for the next.  Empty segments are left to the storage
    agent (it deletes them itself), unsealed ones to their writer.
    """
    if not settings.enabled:
        return []
    found: list[tuple[float, str, int, PlanItem]] = []
    for vol, segs in sorted(inp.segments.items()):
        usage = inp.usage.get(vol)
        free = float(usage.capacity_bytes - usage.used_bytes) if usage is not None else float("inf")
        sparse = []
        for s in segs:
            if s.size_bytes <= 0 or s.live_blocks <= 0 or not getattr(s, "sealed", True):
                continue  # empty segments are the agent's; unsealed ones are still being written
            frac = s.live_bytes / s.size_bytes
            dead = s.size_bytes - s.live_bytes
            if frac >= settings.live_fraction or dead < settings.min_dead_bytes:
                continue
            sparse.append((frac, s))
        for frac, s in sorted(sparse, key=lambda t: (t[0], t[1].segment_id)):
            if s.live_bytes > free:
                continue  # no room to rewrite it yet (demotion or other compactions free space)
            free += s.size_bytes - s.live_bytes
            dead = s.size_bytes - s.live_bytes
            item = PlanItem(
                PlanKind.COMPACT,
                f"segment {s.segment_id} of '{vol}' is {_pct(frac)} live < {_pct(settings.live_fraction)} "
                f"({s.live_blocks} live blocks, {dead} dead bytes)",
                vol,
                None,
                segment_id=s.segment_id,
                bytes=s.live_bytes,
            )
            found.append((frac, vol, s.segment_id, item))
    found.sort(key=lambda t: t[:3])  # keeps each volume's own order, so its free-space accounting holds
    return [t[3] for t in found]


def plan_swaps(settings: PromotionSettings, inp: PolicyInput, index: PrefixIndex, score: Callable[[int], float],
               busy: set[int], budget: float = 0.0, victim_dst: str | None = None) -> list[PlanItem]:
    """Hot blocks of the slow volumes that rank above the lowest fast leaves take their place.

    Candidates: blocks with ``hits >= min_hits`` on a slow volume, not on the fast volume,
    hottest first.  Victims: the
    fast volume's leaves, lowest-ranked first (:func:`_leaves_first`), never the parent of
    a candidate.  While the candidate ranks strictly above the victim and is no larger (at
    most ``max_swaps`` pairs), the victim is demoted to ``victim_dst`` (one tier down: the
    first slow volume under its watermark, else the archive; default the candidate's slow
    volume), and the
    candidate promoted if ``budget`` (bytes the fast volume may still take under its limit)
    holds it and its parent is on the fast volume (or promoted here, or it has none): a
    demotion frees no used bytes until compaction rewrites the segment, so the promotion
    otherwise waits for a later round (:func:`plan_promotions` then picks the hottest,
    ancestors first).  Each swap raises the ranks on the fast volume, so rounds without new events
    stop swapping.  Blocks in ``busy`` (already in this round's plan) are left alone.
    """
    fast = inp.fast_volume
    if not settings.enabled or settings.max_swaps <= 0 or fast is None or not inp.slow_volumes:
        return []
    movable = inp.movable
    return _swap_level(settings, fast, list(inp.slow_volumes), inp.fast_placements, index, score, busy, budget,
                       victim_dst, lambda h: (movable is not None and not movable(h)) or inp.is_held(h), inp.held)


def _swap_level(settings: PromotionSettings, upper: str, sources: list[str], upper_placements: Sequence[PlacementLike],
                index: PrefixIndex, score: Callable[[int], float], busy: set[int], budget: float,
                victim_dst: str | None, skip: Callable[[int], bool],
                held: Callable[[int], bool] | None = None) -> list[PlanItem]:
    """Swaps onto ``upper`` from ``sources`` (see :func:`plan_swaps`); ``skip``: blocks
    never candidates (foreign, held by the move guard, or already on a faster tier);
    ``held``: blocks of ``upper`` never victims (the next lowest-ranked leaves are)."""
    cand: list[tuple[float, int, str, int]] = []
    seen: set[int] = set()
    for src in sources:
        for h in index.blocks_at(src):
            if h in seen or h in busy or index.holds(h, upper) or skip(h):
                continue
            seen.add(h)
            info = index.block(h)
            if info is None or info.hits < settings.min_hits:
                continue
            cand.append((score(h), h, src, info.size))
    if not cand:
        return []
    on_fast: dict[int, PlacementLike] = {}
    for p in upper_placements:
        on_fast.setdefault(p.key.sequence_hash, p)  # type: ignore[attr-defined]
    cand = sorted((c for c in cand if c[1] not in on_fast), key=lambda t: (-t[0], t[1]))
    if not cand:
        return []
    parents = {index.block(h).parent for _, h, _, _ in cand}  # type: ignore[union-attr]
    victims = [(v, h) for v, h in _leaves_first(on_fast, index, score, held) if h not in busy and h not in parents]
    items: list[PlanItem] = []
    promoted: set[int] = set()
    vi = 0
    for rank, h, src, size in cand:
        if vi >= settings.max_swaps or vi >= len(victims):
            break
        vrank, v = victims[vi]
        if not rank > vrank:
            break  # candidates only get colder, victims only warmer
        p = on_fast[v]
        if size > p.length:
            continue
        vi += 1
        why = f"swap: rank {rank:.0f} of block {h} on '{src}' > rank {vrank:.0f} of leaf {v} on '{upper}'"
        items.append(PlanItem(PlanKind.DEMOTE, why, upper, victim_dst or src, sequence_hash=v,
                              namespace=p.key.namespace,  # type: ignore[attr-defined]
                              bytes=p.length))
        parent = index.block(h).parent  # type: ignore[union-attr]
        if size <= budget and (parent is None or parent in on_fast or parent in promoted):
            budget -= size
            promoted.add(h)
            items.append(PlanItem(PlanKind.PROMOTE, why, src, upper, sequence_hash=h, bytes=size))
    return items


def plan_all(settings: PolicySettings, inp: PolicyInput, index: PrefixIndex,
             leader: str | None = None) -> list[PlanItem]:
    """Demotions first (they make room), then promotions, then compactions.

    Promotion and demotion rank blocks with one scorer (:func:`make_scorer`: the order of
    the expert ``leader``, the live selector's choice, by default; ``None`` = the selector's
    first leader, :attr:`advisor.policy.eviction.experts.SelectorSettings.initial`); promotions stop at the demotion
    high watermark, and hot blocks (``hits >= promotion.min_hits``) are demoted only as far
    as that watermark.  When the fast volume has neither demotions of its own nor room for a
    promotion, :func:`plan_swaps` replaces its lowest-ranked leaves by hotter blocks (also
    while a slow volume demotes to the archive).
    """
    hashes = [p.key.sequence_hash for p in inp.fast_placements]  # type: ignore[attr-defined]
    for ps in inp.placements.values():
        hashes += [p.key.sequence_hash for p in ps]  # type: ignore[attr-defined]
    for v in list(inp.slow_volumes) + ([inp.archive_volume] if inp.archive_volume else []):
        hashes += list(index.blocks_at(v))
    score = (make_scorer(settings, index, hashes, leader, inp.superseded, inp.finish)
             if settings.demotion.scoring != "lru" else None)
    hot = settings.promotion.min_hits if settings.promotion.enabled else None
    demotions = plan_demotions(settings.demotion, inp, index, settings.compaction.live_fraction, score, hot)
    promotions = plan_promotions(settings.promotion, inp, index, settings.demotion.high_watermark, score)
    swaps: list[PlanItem] = []
    # only the fast volume's own demotions make room on it: a slow volume demoting to the
    # archive must not hold the swaps back (fast would sit at its promotion limit, below its
    # demotion watermark, and a hot block on slow never displace a colder one on fast)
    fast_demotes = any(i.src_volume == inp.fast_volume for i in demotions)
    if not fast_demotes and not any(i.dst_volume == inp.fast_volume for i in promotions):
        busy = {i.sequence_hash for i in demotions + promotions if i.sequence_hash is not None}
        limit = min(settings.promotion.max_fill, settings.demotion.high_watermark)
        budget = max(0.0, _fill_budget(inp.usage.get(inp.fast_volume), limit)) if inp.fast_volume else 0.0
        swaps = plan_swaps(settings.promotion, inp, index, score or make_scorer(
            PolicySettings(demotion=settings.demotion.model_copy(update={"scoring": "lru"})), index, ()), busy,
            budget, _demotion_target(inp, settings.demotion.high_watermark))
    swaps += _archive_swaps(settings, inp, index, score, demotions + promotions + swaps)
    return demotions + promotions + swaps + plan_compactions(settings.compaction, inp)


def _archive_swaps(settings: PolicySettings, inp: PolicyInput, index: PrefixIndex,
                   score: Callable[[int], float] | None, planned: list[PlanItem]) -> list[PlanItem]:
    """The same swaps one tier lower: hot blocks of the archive displace the first slow
    volume's lowest-ranked leaves (to the archive) when that volume has no demotions of its
    own and no room for a promotion from the archive, so a slow volume full of cold blocks
    below its watermark does not keep the archive's hot blocks out."""
    pr = settings.promotion
    if (not pr.enabled or not pr.from_archive or pr.max_swaps <= 0 or not inp.archive_volume
            or not inp.slow_volumes):
        return []
    slow, archive, fast = inp.slow_volumes[0], inp.archive_volume, inp.fast_volume
    if any(i.src_volume == slow and i.kind is PlanKind.DEMOTE for i in planned) or any(
            i.dst_volume == slow and i.src_volume == archive for i in planned):
        return []
    limit = min(pr.max_fill, settings.demotion.high_watermark)
    budget = max(0.0, _fill_budget(inp.usage.get(slow), limit))
    busy = {i.sequence_hash for i in planned if i.sequence_hash is not None}
    movable = inp.movable

    def faster_or_foreign(h: int) -> bool:
        return ((fast is not None and index.holds(h, fast)) or any(index.holds(h, v) for v in inp.slow_volumes)
                or (movable is not None and not movable(h)) or inp.is_held(h))

    rank = score or make_scorer(PolicySettings(demotion=settings.demotion.model_copy(update={"scoring": "lru"})),
                                index, ())
    return _swap_level(pr, slow, [archive], inp.placements.get(slow, ()), index, rank, busy, budget, archive,
                       faster_or_foreign, inp.held)
