"""Scaled mode's figures agree wherever a user reads them: the report of ``kvadvisor demo
--scaled``, ``kvadvisor status --url`` and ``GET /v1/stats`` / ``GET /v1/volumes`` of the
cluster's API show the same events, moves, sources and volumes.

Runs on the topology ``kvadvisor up`` starts (a JetStream server, redis-server, an S3
endpoint, two cluster advisors with movers, the cluster API), small: one NATS node, four
partitions, 300 requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

KVADVISOR = [sys.executable, "-m", "kvadvisor.cli"]
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200", NIXL_LOG_LEVEL="WARN")
    return subprocess.run([*KVADVISOR, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _rows(text: str) -> list[str]:
    """Table lines with the box characters gone and the cells single-spaced."""
    return [" ".join(ln.replace("│", " ").replace("┃", " ").split()) for ln in text.splitlines()]


def test_scaled_report_status_and_stats_agree(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    r = _run("up", "--dir", str(root), "--nodes", "1", "--advisors", "2", "--partitions", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        api = json.loads((root / "cluster.json").read_text())["api_url"]
        report_file = tmp_path / "report.json"
        r = _run("demo", "--scaled", "--dir", str(root), "--requests", "300", "--json", str(report_file))
        assert r.returncode == 0, r.stdout + r.stderr
        rep = json.loads(report_file.read_text())
        stats = httpx.get(f"{api}/v1/stats", timeout=30).json()
        vols = {v["id"]: v for v in httpx.get(f"{api}/v1/volumes", timeout=30).json()["volumes"]}
        st = _run("status", "--url", api)
        assert st.returncode == 0, st.stdout + st.stderr
        status = _rows(st.stdout)

        # moves: the movers acted on the replay (the report waits for their rounds), and the
        # report, /v1/stats and status count the same ones
        m = stats["moves"]
        assert rep["promotions"] > 0, rep
        assert (rep["promotions"], rep["demotions"], rep["compactions"], rep["bytes_moved"]) == (
            m["promotions"], m["demotions"], m["compactions"], m["bytes_moved"]), (rep, m)
        assert sum(rep["failed_moves"].values()) == sum(m["failed"].values()) == 0
        moves_line = next(ln for ln in status if ln.startswith("moves:"))
        assert moves_line == (f"moves: {m['promotions']:,} promotions, {m['demotions']:,} demotions, "
                              f"{m['compactions']:,} compactions, {m['bytes_moved']:,} bytes moved, failed 0")

        # events: workers' + the movers' = what the partitions applied (a fresh topology)
        assert rep["advisor_events"] == stats["advisor_events"] > 0
        assert rep["events"] == rep["worker_events"] + rep["advisor_events"] == stats["events_applied"]
        head = status[status.index("blocks orphans pending events/s (10 s) events applied gaps dropped") + 2]
        assert head.split()[3] == f"{stats['events_applied']:,}", head

        # sources: each worker as its publishers counted it, each mover as the partitions applied it
        assert rep["sources"] == {k: {"batches": v["batches"], "events": v["events"]}
                                  for k, v in stats["sources"].items()}, (rep["sources"], stats["sources"])
        assert any(k.endswith("-mover") for k in rep["sources"]) and sum(
            v["events"] for k, v in rep["sources"].items() if k.startswith("worker-")) == rep["worker_events"]
        report_text = _rows(r.stdout)
        src_line = next(ln for ln in report_text if ln.startswith("sources: batches / events"))
        for src, v in stats["sources"].items():
            assert f"{src} {v['batches']:,} / {v['events']:,}" in src_line, src_line
            row = next(ln for ln in status if ln.startswith(src + " "))
            assert f" {v['batches']:,} {v['events']:,} " in row and "never" not in row, row

        # volumes: the advisors' storage declaration, with usage and the blocks placed on each
        assert {k: v["role"] for k, v in vols.items()} == {"fast": "fast", "slow": "slow", "s3": "archive"}
        for vid, v in vols.items():
            checked = rep["verified"][vid]  # the demo's index == catalog check per volume
            assert checked["equal"], checked
            assert v["indexed_blocks"] == checked["index"] and v["blocks"] == checked["held"], (vid, v, checked)
            row = next(ln for ln in status if ln.startswith(f"{vid} {v['role']} "))
            assert row.split()[-1] == f"{v['indexed_blocks']:,}" and row.split()[3] == f"{v['used_bytes']:,}", row
        assert vols["slow"]["used_bytes"] > 0 and vols["fast"]["indexed_blocks"] > 0
        assert {v["id"]: (v["role"], v["indexed_blocks"], v["stats"]["blocks"]) for v in rep["volumes"]} == {
            k: (v["role"], v["indexed_blocks"], v["blocks"]) for k, v in vols.items()}
    finally:
        d = _run("down", "--dir", str(root))
        assert d.returncode == 0, d.stdout + d.stderr
    # `up` again on the same directory (the README's default runs/cluster): the stopped
    # topology's stream and volumes went with its in-memory catalog; the new one starts
    # clean, so its figures are again this run's and no offload collides with an old segment
    r = _run("up", "--dir", str(root), "--nodes", "1", "--advisors", "1", "--partitions", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        api = json.loads((root / "cluster.json").read_text())["api_url"]
        r = _run("demo", "--scaled", "--dir", str(root), "--requests", "60", "--json", str(report_file))
        assert r.returncode == 0 and "offload of" not in r.stdout + r.stderr, r.stdout + r.stderr
        rep = json.loads(report_file.read_text())
        stats = httpx.get(f"{api}/v1/stats", timeout=30).json()
        assert rep["sources"] == {k: {"batches": v["batches"], "events": v["events"]}
                                  for k, v in stats["sources"].items()}, (rep["sources"], stats["sources"])
        assert rep["events"] == stats["events_applied"] and rep["verified"]["bytes_ok"] == rep["verified"]["bytes_checked"]
    finally:
        d = _run("down", "--dir", str(root))
        assert d.returncode == 0, d.stdout + d.stderr
