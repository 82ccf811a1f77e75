"""``kvadvisor check``: compare the index, the placement catalog and the volumes, and
optionally repair them (docs/operations.md, "Consistency check").

Three views of where blocks live must agree (docs/design.md §7):

* the **index**: a fresh fold of the journal from position 1 (never the running
  advisor's memory);
* the **catalog**: the placements of the advisor's namespaces on each configured volume;
* the **volumes**: the segment files / objects the placements point into.

Differences found (each names the volume and the block or segment):

``lost``
    a catalog placement whose segment is missing or too short to hold it (the block's
    bytes are gone);
``corrupt`` (``deep`` only)
    a placement whose bytes read back with another checksum;
``index_only``
    the index places a block on a volume, the catalog does not;
``catalog_only``
    the catalog places a block on a volume, the index does not;
``orphan_segment``
    a segment on a volume the catalog does not know (its bytes are unreachable).

``repair`` makes them agree without losing a readable block: lost and corrupt placements
are deleted from the catalog, orphan segments are deleted from the volume, and the
index is corrected by appending one batch of Store / Remove events (source
``kvadvisor-check``) to the journal, so every later fold (and the advisor at its next
start) sees the same placements as the catalog.  Run it while the advisor is stopped:
the working directory is locked (:mod:`kvadvisor.workdir_lock`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from advisor.index.prefix_index import PLACEMENT_KEYS, PrefixIndex
from advisor.ingest.journal import SqliteJournal
from advisor.settings import AdvisorSettings
from event_plane.codec import CodecError, encode_batch
from event_plane.schema import EventBatch, KVEvent, remove, store

CHECK_SOURCE = "kvadvisor-check"
"""Event source of the batches a repair appends to the journal."""


@dataclass(frozen=True, slots=True)
class Difference:
    """One disagreement.

    Attributes:
        kind: ``lost``, ``corrupt``, ``index_only``, ``catalog_only`` or ``orphan_segment``.
        volume: the volume id.
        sequence_hash: the block (``None`` for an orphan segment).
        segment_id: the segment involved, when known.
        reason: a sentence saying what was seen.
    """

    kind: str
    volume: str
    sequence_hash: int | None
    segment_id: int | None
    reason: str

    def line(self) -> str:
        """One human-readable line."""
        what = f"block {self.sequence_hash:#x}" if self.sequence_hash is not None else f"segment {self.segment_id}"
        return f"{self.kind}: {self.volume}: {what}: {self.reason}"


@dataclass
class CheckReport:
    """What :func:`check` found and, with ``repair``, what it changed."""

    differences: list[Difference] = field(default_factory=list)
    blocks_checked: int = 0
    journal_position: int = 0
    repaired: dict[str, int] = field(default_factory=dict)
    blocks_read: int = 0
    """``deep``: blocks read back and compared with their catalog checksum."""
    bytes_read: int = 0
    """``deep``: bytes those blocks hold."""
    other_namespaces: dict[str, int] = field(default_factory=dict)
    """Placements on the configured volumes in namespaces the settings leave out (namespace →
    blocks): neither checked nor managed by this advisor."""

    def lost_blocks(self) -> list[int]:
        """Sequence hashes of the lost or corrupt blocks."""
        return sorted({d.sequence_hash for d in self.differences
                       if d.kind in ("lost", "corrupt") and d.sequence_hash is not None})

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serialisable)."""
        return {
            "differences": len(self.differences),
            "blocks_checked": self.blocks_checked,
            "journal_position": self.journal_position,
            "lost_blocks": [f"{h:#x}" for h in self.lost_blocks()],
            "details": [d.line() for d in self.differences],
            "repaired": self.repaired,
            "blocks_read": self.blocks_read,
            "bytes_read": self.bytes_read,
            "other_namespaces": self.other_namespaces,
        }


def fold_journal(journal: SqliteJournal) -> tuple[PrefixIndex, int]:
    """A fresh index: every journal entry from position 1 folded in order (entries that do
    not decode are skipped, as the advisor's replay does). Returns ``(index, position)``."""
    index = PrefixIndex()
    pos = 0
    for pos, payload in journal.read_raw(0):
        try:
            index.apply_payload(payload)
        except CodecError:
            pass
    return index, pos


def _read_checksums(vol: Any, placements: list[Any]) -> list[int]:
    """Checksums of the bytes the placements point at, read through the volume."""
    from storage_backends.checksum import checksum

    items = [(p.segment_id, p.offset, p.length) for p in placements]
    with vol.engine.lock:
        buf = vol.engine.staging(vol.read_buffer_bytes(items), vol.buffer_alignment)
        return [checksum(v) for v in vol.read_many(items, buf)]


def check(settings: AdvisorSettings, *, repair: bool = False, deep: bool = False) -> CheckReport:
    """Compare index (fresh fold of the journal), catalog and volumes; optionally repair.

    Args:
        settings: the advisor's settings (``log=sqlite``, with ``catalog_path``).
        repair: make them agree (see the module docstring); the caller must make sure no
            advisor runs on this journal (:func:`kvadvisor.workdir_lock.workdir_lock`).
        deep: also read every block and compare its checksum with the catalog's.

    Returns:
        The report: with ``repair``, the differences found before repairing and the
        counts of what was changed (``repaired``).

    Raises:
        ValueError: the settings have no catalog or use ``log=jetstream``.
        OwnedError: ``repair`` while another process (an advisor) owns the journal.
        StorageError / JournalError: a volume, the catalog or the journal cannot be opened.
    """
    if settings.catalog_path is None:
        raise ValueError("the advisor config has no catalog_path: nothing to check")
    if settings.log != "sqlite":
        raise ValueError("kvadvisor check reads the SQLite journal (log=sqlite); this config uses log=jetstream")
    report = CheckReport()
    owner = None
    if repair:  # appends to the journal: no advisor may be running on it
        from advisor.embedded.owner_lock import OwnerLock

        owner = OwnerLock(f"{settings.journal_path}.lock", f"journal {settings.journal_path}", "kvadvisor check --repair")
        owner.acquire()
    try:
        return _check(settings, report, repair, deep)
    finally:
        if owner is not None:
            owner.release()


def _check(settings: AdvisorSettings, report: CheckReport, repair: bool, deep: bool) -> CheckReport:
    from storage_backends import BlockKey, SqliteCatalog, StorageAgent

    journal = SqliteJournal(settings.journal_path)
    catalog = SqliteCatalog(settings.catalog_path)
    agent = StorageAgent(catalog, name=f"kvadvisor-check-{time.time_ns()}", allowed_roots=settings.allowed_volume_roots())
    try:
        vols = {v.id: agent.register_volume(v.to_descriptor()) for v in settings.volumes}
        index, report.journal_position = fold_journal(journal)
        # the namespaces the advisor manages with this catalog (configured, then followed)
        namespaces = set(settings.managed_namespaces(
            {ns: sum(v.values()) for ns, v in catalog.namespace_counts().items()})[0])
        bad: list[Any] = []  # placements whose bytes are gone or wrong
        orphans: list[tuple[str, int]] = []
        for vid, vol in vols.items():
            placements = []
            for p in catalog.iter_volume(vid):
                if p.key.namespace in namespaces:
                    placements.append(p)
                else:
                    report.other_namespaces[p.key.namespace] = report.other_namespaces.get(p.key.namespace, 0) + 1
            report.blocks_checked += len(placements)
            sizes: dict[int, int | None] = {}
            by_segment: dict[int, list[Any]] = {}
            for p in placements:
                if p.segment_id not in sizes:
                    sizes[p.segment_id] = vol.segment_size(p.segment_id)
                size = sizes[p.segment_id]
                if size is None:
                    reason = f"segment {p.segment_id} is missing"
                elif p.offset + p.length > size:
                    reason = f"segment {p.segment_id} holds {size} bytes, the block ends at {p.offset + p.length}"
                else:
                    by_segment.setdefault(p.segment_id, []).append(p)
                    continue
                bad.append(p)
                report.differences.append(Difference("lost", vid, p.key.sequence_hash, p.segment_id, reason))
            if deep:
                for seg, ps in sorted(by_segment.items()):
                    for p, ck in zip(ps, _read_checksums(vol, ps)):
                        report.blocks_read += 1
                        report.bytes_read += p.length
                        if ck != p.checksum:
                            bad.append(p)
                            report.differences.append(Difference(
                                "corrupt", vid, p.key.sequence_hash, seg,
                                f"reads back with checksum {ck:#x}, the catalog holds {p.checksum:#x}"))
            known = {s.segment_id for s in catalog.segments(vid)}
            for seg in vol.list_segments():
                if seg not in known:
                    orphans.append((vid, seg))
                    report.differences.append(Difference("orphan_segment", vid, None, seg,
                                                         "on the volume, unknown to the catalog"))
            in_catalog = {p.key.sequence_hash for p in placements}
            in_index = index.blocks_at(vid)
            for h in sorted(in_index - in_catalog):
                report.differences.append(Difference("index_only", vid, h, None, "indexed here, not in the catalog"))
            for h in sorted(in_catalog - in_index):
                report.differences.append(Difference("catalog_only", vid, h, None, "in the catalog, not indexed here"))
        if repair and report.differences:
            report.repaired = _repair(settings, journal, catalog, agent, vols, index, bad, orphans, BlockKey)
    finally:
        agent.close()
        catalog.close()
        journal.close()
    return report


def _repair(settings: AdvisorSettings, journal: SqliteJournal, catalog: Any, agent: Any, vols: dict[str, Any],
            index: PrefixIndex, bad: list[Any], orphans: list[tuple[str, int]], key_factory: Any) -> dict[str, int]:
    """Delete bad placements and orphan segments, then journal the events that make the
    index equal to the catalog. Returns counts per action."""
    out = {"placements_deleted": 0, "orphan_segments_deleted": 0, "events_journaled": 0}
    if bad:
        out["placements_deleted"] = agent.delete([p.key for p in bad])
    for vid, seg in orphans:
        vols[vid].delete_segment(seg)
        out["orphan_segments_deleted"] += 1
    namespaces = set(settings.managed_namespaces(
        {ns: sum(v.values()) for ns, v in catalog.namespace_counts().items()})[0])
    events: list[KVEvent] = []
    for vid in vols:
        placed = {p.key.sequence_hash: p for p in catalog.iter_volume(vid) if p.key.namespace in namespaces}
        in_index = index.blocks_at(vid)
        for h in sorted(in_index - placed.keys()):
            info = index.block(h)
            if info is not None:
                events.append(remove(h, info.prefix_hash, info.parent, info.size, vid))
        for h in sorted(placed.keys() - in_index):
            info = index.block(h)
            prefix, parent = (info.prefix_hash, info.parent) if info is not None else (h, None)
            events.append(store(h, prefix, parent, placed[h].length, vid, {PLACEMENT_KEYS[1]: True}))
    if events:
        batch = EventBatch(1, CHECK_SOURCE, time.time_ns(), 0, time.time_ns(), events)
        if journal.append(encode_batch(batch), batch, verify=False) is not None:
            out["events_journaled"] = len(events)
    return out


def load_settings(workdir: Path | None, config: Path | None) -> AdvisorSettings:
    """The advisor settings of a demo working directory (``<workdir>/advisor.json``) or of
    a config file.

    Raises:
        SettingsError: unreadable or invalid config; ValueError: neither given.
    """
    if config is None:
        if workdir is None:
            raise ValueError("give --workdir (a demo working directory) or --config (an advisor config file)")
        config = workdir / "advisor.json"
    return AdvisorSettings.from_json_file(config)
