"""Acceptance: `advisor run` on a demo's work directory does not churn.

`kvadvisor demo --workdir DIR --requests 300` replays a trace (workers, volumes, advisor), and
leaves DIR/advisor.json.  `kvadvisor advisor run --config DIR/advisor.json` then runs 10 policy
rounds with no new events (and, under pressure, 10 more after a restart).  Checked over
those rounds: no block moves twice; at the end no
tier (fast, slow) is above its demotion high watermark; and no block hit at least twice sits
on the archive tier while the slow tier has room.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.journal import SqliteJournal
from kvadvisor.cli import app

ROUNDS = 10


def _run_demo(workdir: Path, local_s3: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    # an S3 that outlives the demo (the demo's own local one stops with it)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", local_s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", local_s3.secret_key)
    monkeypatch.setenv("KVADVISOR_DEMO_S3_BUCKET", f"stable-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("KVADVISOR_DEMO_FAST_CAPACITY_BLOCKS", "64")  # small: the rounds have work to do
    monkeypatch.setenv("KVADVISOR_DEMO_INNER_DIM", "2")
    result = CliRunner().invoke(app, ["demo", "--requests", "300", "--workdir", str(workdir),
                                      "--s3-endpoint", local_s3.endpoint])
    assert result.exit_code == 0, result.output
    return json.loads((workdir / "advisor.json").read_text())


def _ten_rounds(config: Path, tmp_path: Path, env: dict[str, str], name: str) -> dict[str, Any]:
    """`advisor run --config CONFIG`, 10 rounds through the API, stop; what they did."""
    err = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvadvisor.cli", "advisor", "run", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=err, env=env)
    moves: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("ADVISOR READY http"), (tmp_path / f"{name}.log").read_text()[-3000:]
        base = line.split()[-1]
        with httpx.Client(base_url=base, timeout=300.0) as http:
            for _ in range(ROUNDS):
                for it in http.post("/v1/plans/run").json()["plans"]:
                    if it["kind"] in ("promote", "demote") and it["status"] == "done":
                        moves[it["sequence_hash"]] += 1
                        kinds[f'{it["src_volume"]}->{it["dst_volume"]}'] += 1
            vols = {v["role"]: v for v in http.get("/v1/volumes").json()["volumes"]}
            st = http.get("/v1/stats").json()
            assert st["ingest"]["policy_rounds"] >= ROUNDS
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err.close()
    return {"moves": moves, "kinds": kinds, "volumes": vols}


def _check(run: dict[str, Any], workdir: Path, high: float) -> None:
    moves, kinds, roles = run["moves"], run["kinds"], run["volumes"]
    # 1. no block moved twice
    twice = {h: n for h, n in moves.items() if n > 1}
    assert not twice, f"blocks moved more than once: {dict(list(twice.items())[:10])} (moves {dict(kinds)})"
    # 2. no tier above its high watermark
    for role in ("fast", "slow"):
        v = roles[role]
        assert v["used_bytes"] <= high * v["capacity_bytes"], (role, v, dict(kinds))
    # 3. no block with hits >= 2 on the archive while slow has room (index rebuilt from the journal)
    idx = PrefixIndex()
    journal = SqliteJournal(str(workdir / "journal.sqlite"))
    try:
        for _pos, batch in journal.read():
            idx.apply_batch(batch)
    finally:
        journal.close()
    slow = roles["slow"]
    slow_room = slow["used_bytes"] < high * slow["capacity_bytes"]
    hot_on_archive = [h for h in idx.blocks_at(roles["archive"]["id"]) if idx.block(h).hits >= 2]
    assert not (slow_room and hot_on_archive), f"{len(hot_on_archive)} blocks hit >= 2 on the archive"
    print(f"moves over {ROUNDS} rounds: {dict(kinds)}; fast {roles['fast']['used_bytes']}/"
          f"{roles['fast']['capacity_bytes']} B, archive holds {idx.count_at(roles['archive']['id'])} blocks")


def test_ten_rounds_without_new_events_move_no_block_twice_and_respect_the_watermarks(
    tmp_path: Path, local_s3: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    workdir = tmp_path / "demo"
    cfg = _run_demo(workdir, local_s3, monkeypatch)
    assert cfg["policy_interval_s"] > 0  # `advisor run` runs its rounds on a timer by default
    high = cfg["policy"]["demotion"]["high_watermark"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": local_s3.access_key, "AWS_SECRET_ACCESS_KEY": local_s3.secret_key}
    # the advisor.json the demo left, as it is
    _check(_ten_rounds(workdir / "advisor.json", tmp_path, env, "as-left"), workdir, high)
    # the same under pressure: every block seen twice qualifies for promotion (min_hits 1),
    # far more than the fast volume holds -- the case that churned (fill to 95 %, demote to S3)
    pressure = {**cfg, "policy": {**cfg["policy"], "promotion": {"min_hits": 1}}}
    (tmp_path / "pressure.json").write_text(json.dumps(pressure))
    run = _ten_rounds(tmp_path / "pressure.json", tmp_path, env, "pressure")
    assert sum(run["kinds"].values()) > 0  # the rounds did work
    _check(run, workdir, high)
    # across a restart too: the move guard's memory is part of the run state
    again = _ten_rounds(tmp_path / "pressure.json", tmp_path, env, "pressure-restarted")
    both = {"moves": run["moves"] + again["moves"], "kinds": run["kinds"] + again["kinds"],
            "volumes": again["volumes"]}
    _check(both, workdir, high)
