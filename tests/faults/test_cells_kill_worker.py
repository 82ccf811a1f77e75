"""Fault cell: a worker process killed (-9) in the middle of an offload: its segment is
written but never recorded. The blocks it had acknowledged (put returned, Store published)
read back byte-exact, the advisor collects the leftover at start, and index, catalog and
volumes agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from advisor import AdvisorService
from tests.faults._invariants import acknowledged_read_back, catalog_equals_volumes, index_equals_fold
from tests.faults._world import NS, REPO, Worker, chain, settings

CHILD = r"""
import json, os, sys
from advisor import AdvisorSettings
from storage_backends import BlockKey, SqliteCatalog, StorageAgent
from tests.faults._world import data
cfg = json.loads(sys.argv[1])
s = AdvisorSettings(**cfg["settings"])
agent = StorageAgent(SqliteCatalog(s.catalog_path), name="offloader")
for v in s.volumes:
    agent.register_volume(v.to_descriptor())
insert = agent.catalog.insert_if_absent
calls = [0]
def insert_or_die(placements):
    calls[0] += 1
    if calls[0] > cfg["acked_puts"]:
        os.kill(os.getpid(), 9)  # the segment is on the volume, the catalog never hears of it
    return insert(placements)
agent.catalog.insert_if_absent = insert_or_die
for i, group in enumerate(cfg["groups"]):
    agent.put([(BlockKey(cfg["ns"], h), data(h)) for h in group], "slow")
    print("ACK", json.dumps(group), flush=True)
"""


def test_worker_killed_mid_offload(tmp_path: Path) -> None:
    s = settings(tmp_path, gc_min_age_s=0)
    groups = [list(range(700 + 10 * i, 708 + 10 * i)) for i in range(4)]
    arg = json.dumps({"settings": json.loads(s.model_dump_json()), "ns": NS, "groups": groups, "acked_puts": 2})
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(REPO))
    assert r.returncode == -9, (r.stdout, r.stderr[-3000:])
    acked = [h for line in r.stdout.splitlines() if line.startswith("ACK ") for h in json.loads(line[4:])]
    assert acked == groups[0] + groups[1]
    leftovers = list((tmp_path / "slow").rglob("seg-*"))
    assert len(leftovers) == 3  # two recorded segments, one written by the killed put
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            assert svc.counters["gc_segments_removed"] == 1  # the killed put's segment
            w.send(svc, "worker-0", *chain(acked, "slow"))  # what the worker had acknowledged
            index_equals_fold(svc)
            assert svc.index.blocks_at("slow") == set(acked)
        assert len(list((tmp_path / "slow").rglob("seg-*"))) == 2
        acknowledged_read_back(w.agent, acked)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()
