"""Finding 11 (acceptance 4): ``kvadvisor check`` on a demo working directory reports 0
differences; after a segment is deleted by hand it names the lost blocks, and
``--repair`` makes index, catalog and events agree again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from advisor.ingest.journal import SqliteJournal
from kvadvisor.check import CHECK_SOURCE, fold_journal
from storage_backends import SqliteCatalog
from storage_backends.local_s3 import LocalS3
from tests.faults._world import REPO

CLI = "from kvadvisor.cli import app; app()"


def _run(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_check_finds_a_lost_segment_and_repairs(tmp_path: Path, local_s3: LocalS3) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KVADVISOR_DEMO_S3_ACCESS_KEY=local_s3.access_key, KVADVISOR_DEMO_S3_SECRET_KEY=local_s3.secret_key,
               NIXL_LOG_LEVEL="WARN", COLUMNS="200")
    wd = tmp_path / "wd"
    demo = _run(["demo", "--workdir", str(wd), "--requests", "60", "--s3-endpoint", local_s3.endpoint], env)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]

    clean = _run(["check", "--workdir", str(wd), "--deep"], env)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert ": 0 differences" in clean.stdout

    cat = SqliteCatalog(wd / "catalog.sqlite")
    try:
        segs = [s for s in cat.segments("slow") if s.live_blocks]
        victim = segs[len(segs) // 2]
        lost = sorted(p.key.sequence_hash for p in cat.iter_segment("slow", victim.segment_id))
    finally:
        cat.close()
    assert lost
    [seg_file] = list((wd / "volumes" / "slow").rglob(f"seg-{victim.segment_id:012d}*"))
    seg_file.unlink()  # an operator's mistake, a disk that lost a file

    found = _run(["check", "--workdir", str(wd), "--json", str(tmp_path / "found.json")], env)
    assert found.returncode == 1, found.stdout + found.stderr
    report = json.loads((tmp_path / "found.json").read_text())
    assert report["lost_blocks"] == [f"{h:#x}" for h in lost]
    assert report["differences"] == len(lost)
    assert all(f"{h:#x}" in found.stdout for h in lost)
    assert f"segment {victim.segment_id} is missing" in found.stdout

    fixed = _run(["check", "--workdir", str(wd), "--repair"], env)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "0 differences left" in fixed.stdout
    again = _run(["check", "--workdir", str(wd), "--deep"], env)
    assert again.returncode == 0 and ": 0 differences" in again.stdout, again.stdout + again.stderr

    # index (a fresh fold of the journal), catalog and the journaled events agree
    journal = SqliteJournal(wd / "journal.sqlite")
    cat = SqliteCatalog(wd / "catalog.sqlite")
    try:
        index, _ = fold_journal(journal)
        on_slow = {p.key.sequence_hash for p in cat.iter_volume("slow")}
        assert not set(lost) & on_slow
        assert index.blocks_at("slow") == on_slow
        repairs = [b for _, b in journal.read() if b.source == CHECK_SOURCE]
        assert len(repairs) == 1
        assert sorted(e.sequence_hash for e in repairs[0].events if e.storage_location == "slow") == lost
    finally:
        journal.close()
        cat.close()
