"""Fuzz target: the advisor's journal replay ("any input accepted live is replayable").

Input: a record stream (``_fuzzlib.split_records``); each record is one wire payload as a
subscriber receives it. The flags byte picks how the advisor runs:

* bit 0: the subscriber's path, ``ingest(batch, verify=False)`` (the journal gets the
  batch re-encoded), else ``ingest(batch, payload)`` (the journal gets the received bytes,
  checked against the batch);
* bit 1: a SQLite snapshot store, a snapshot every 2 batches (the restart loads the newest
  one and replays the rest), else no snapshots (the restart replays the whole journal);
* bit 2: with snapshots, one more snapshot on the clean stop.

:func:`check` runs a real :class:`~advisor.embedded.service.AdvisorService` (SQLite journal, no API,
no subscriptions, ``null://`` publisher) on a scratch file: every payload that
``decode_batch`` accepts (what a subscriber delivers) goes through ``AdvisorService.ingest``;
then the service stops and a second one starts on the same files, as a restarted advisor
does (``start`` replays the journal). Invariants:

* live ingest accepts every decodable batch whose ``(source, epoch, seq)`` it has not
  journaled yet, and refuses the others as duplicates;
* the restarted advisor skips no journal entry, reaches the same position, and its index
  equals the live one (``PrefixIndex.dump``: blocks, locations, hits, orphans, sources,
  counters, storers); without snapshots it replays exactly the accepted batches.

Run: ``python tests/fuzz/fuzz_journal.py [-max_total_time=60] [corpus dirs]``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import _fuzzlib

with _fuzzlib.instrumented(__name__ == "__main__"):
    from advisor.embedded.service import AdvisorService
    from advisor.settings import AdvisorSettings
    from event_plane.codec import CodecError, decode_batch

NAME = "journal"

# The service logs every refused or skipped batch; the fuzzer makes many of them.
logging.getLogger("advisor").setLevel(logging.ERROR)

_scratch: Path | None = None
_settings: dict[int, AdvisorSettings] = {}


def _journal_path() -> Path:
    global _scratch
    if _scratch is None:
        _scratch = _fuzzlib.scratch_dir("kvadvisor-fuzz-journal-")
    return _scratch / "journal.sqlite"


def settings(flags: int) -> AdvisorSettings:
    """The advisor settings the flags byte selects (one object per choice, reused)."""
    key = flags & 6
    if key not in _settings:
        path = _journal_path()
        snapshots = bool(flags & 2)
        _settings[key] = AdvisorSettings(
            source="fuzz-advisor",
            journal_path=str(path),
            api_enabled=False,
            reconcile_on_start=False,
            policy_interval_s=0.0,
            publish_url="null://",
            snapshot_store="sqlite" if snapshots else "none",
            snapshot_path=str(path.with_name("snapshots.sqlite")),
            snapshot_every_batches=2 if snapshots else 0,
            snapshot_every_s=0.0,
            snapshot_on_stop=bool(flags & 4),
        )
    return _settings[key]


def _reset_files() -> None:
    """Remove the journal and snapshot files of the previous run (same paths, reused)."""
    path = _journal_path()
    for base in (path, path.with_name("snapshots.sqlite")):
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{base}{suffix}").unlink(missing_ok=True)


def check(data: bytes) -> None:
    """Check the replay invariants (module docstring) on one input; raise on a violation."""
    if not data:
        return
    flags = data[0]
    verify = not flags & 1
    cfg = settings(flags)
    _reset_files()

    live = AdvisorService(cfg)
    accepted = 0
    try:
        live.start()
        for payload in _fuzzlib.split_records(data[1:]):
            try:
                batch = decode_batch(payload)
            except CodecError:
                continue  # a subscriber drops it: it never reaches ingest
            assert live.journal is not None
            duplicate = live.journal.contains(batch.source, batch.epoch, batch.seq)
            ok = live.ingest(batch, payload if verify else None, verify=verify)
            assert ok != duplicate, (
                f"ingest(verify={verify}) {'accepted a duplicate' if ok else 'refused a decodable batch'} "
                f"{batch.source!r}:{batch.epoch}:{batch.seq} (counters {live.counters})"
            )
            accepted += ok
        live_dump = live.index.dump()
        live_position = live.position
    finally:
        live.stop()

    restarted = AdvisorService(cfg)
    try:
        restarted.start()
        assert restarted.counters["journal_skipped"] == 0, "replay skipped a journal entry live ingest accepted"
        assert restarted.position == live_position, f"replay ends at {restarted.position}, live at {live_position}"
        if not flags & 2:
            assert restarted.counters["replayed_batches"] == accepted, (
                f"replayed {restarted.counters['replayed_batches']} batches, {accepted} were accepted live"
            )
        assert restarted.index.dump() == live_dump, "the index after the restart differs from the live index"
    finally:
        restarted.stop()


if __name__ == "__main__":
    _fuzzlib.main(check, NAME)
    sys.exit(0)
