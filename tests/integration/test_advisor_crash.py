"""Acceptance 2: kill -9 the advisor at random points of a replay, ≥ 20 times, and restart it.

A real ZMQ publisher (two workers) streams the bundled Mooncake slice as Store/Remove
events with parents, while a worker StorageAgent writes every new block to the slow
POSIX volume.  The advisor runs as its own process (``python -m advisor --config``) with
real volumes (two POSIX dirs and S3 on the ``local_s3`` endpoint), policy rounds every
50 ms (promotion, demotion to S3, compaction) and a snapshot every 10 batches.  A loop
SIGKILLs it at random delays (some before it is ready, most while it moves blocks) and
starts it again.  At the end the advisor is restarted once more (in this process) and:

* its index (snapshot + journal tail) equals a fresh fold of the whole journal;
* every block ever written has a catalog placement that reads back through the
  StorageAgent with a correct checksum and the original bytes;
* on each volume, the blocks the index places there are exactly the catalog's.

Each advisor is forked from a parent that imported torch / NIXL once (see
:class:`Zygote`): a restart then costs ~0.3 s instead of ~3 s of imports.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from advisor import AdvisorService, AdvisorSettings
from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.journal import SqliteJournal
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import remove, store
from kvadvisor.trace import read_mooncake
from storage_backends import BlockKey, SqliteCatalog, StorageAgent
from storage_backends.local_s3 import LocalS3, free_port

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "kvadvisor" / "data" / "mooncake_conversation_2000.jsonl"
NS = "ns-crash"
BLK = 4096
KILLS = 22
PREFIX_BLOCKS = 4
PER_RUN = 60  # requests replayed per advisor run
G1_BLOCKS = 24  # per-worker g1 capacity: evictions publish Removes, re-use publishes Stores (hits)


def data(h: int) -> torch.Tensor:
    return ((torch.arange(BLK, dtype=torch.int64) * (h % 251 + 1) + h) % 256).to(torch.uint8)


class Workers:
    """Two workers replaying the trace: g1 residency (LRU), write-through to 'slow'."""

    def __init__(self, urls: list[str], agent: StorageAgent) -> None:
        cfg = PublisherConfig(max_events=64, max_delay_s=0.02, replay_buffer=100_000)
        self.pubs = [make_publisher(url, f"w{i}", epoch=11 + i, config=cfg) for i, url in enumerate(urls)]
        self.g1: list[OrderedDict[int, tuple[int, int | None]]] = [OrderedDict(), OrderedDict()]
        self.agent = agent
        self.written: set[int] = set()
        # the first PREFIX_BLOCKS blocks of each request: the shared conversation prefixes
        self.requests = [r.hash_ids[:PREFIX_BLOCKS] for r in read_mooncake(TRACE, 2000)]
        self.next = 0

    def replay(self, n: int) -> None:
        for r in self.requests[self.next:self.next + n]:
            w = self.next % 2
            self.next += 1
            new = [h for h in dict.fromkeys(r) if h not in self.written]
            if new:
                self.agent.put([(BlockKey(NS, h), data(h)) for h in new], "slow")
                self.written.update(new)
            evs = []
            g1 = self.g1[w]
            parent = None
            for h in r:
                if h in g1:
                    g1.move_to_end(h)
                else:
                    evs.append(store(h, r[0], parent, BLK, "g1"))
                    if h in new:
                        evs.append(store(h, r[0], parent, BLK, "slow"))
                    g1[h] = (r[0], parent)
                    while len(g1) > G1_BLOCKS:
                        old, (prefix, par) = g1.popitem(last=False)
                        evs.append(remove(old, prefix, par, BLK, "g1"))
                parent = h
            self.pubs[w].publish(evs)
        for p in self.pubs:
            p.flush()

    def last_seqs(self) -> dict[str, int]:
        return {p.source: p.next_seq - 1 for p in self.pubs}

    def close(self) -> None:
        for p in self.pubs:
            p.close()


ZYGOTE = r"""
import os, signal, sys
import torch, storage_backends, event_plane, advisor.embedded.service  # preloaded once, inherited by every fork
cfg, log = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "start":
        pid = os.fork()
        if pid == 0:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(fd, 2)
            os._exit(advisor.embedded.service.main(["--config", cfg]))
        print("pid", pid, flush=True)
    elif cmd[0] == "kill":
        pid = int(cmd[1])
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        print("dead", pid, os.WIFSIGNALED(status) and os.WTERMSIG(status), flush=True)
"""


class Zygote:
    """Starts advisor processes (``advisor.embedded.service.main``, as ``python -m advisor`` does) by
    forking a parent that has imported torch / NIXL / the project once, so a restart does
    not pay ~2 s of imports; each advisor is its own process and is killed with SIGKILL."""

    def __init__(self, cfg: Path, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(cfg), str(log)], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _cmd(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def start(self) -> int:
        self._cmd("start")
        line = self.readline().split()
        assert line[0] == "pid", line
        return int(line[1])

    def kill9(self, pid: int) -> None:
        self._cmd(f"kill {pid}")
        while True:  # a READY line of the killed advisor may come first
            line = self.readline().split()
            if line and line[0] == "dead":
                assert line[1:] == [str(pid), str(int(signal.SIGKILL))], line
                return

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def journaled(journal: Path, source: str) -> int:
    j = SqliteJournal(journal)
    try:
        return j.sources().get(source, (0, -1))[1]
    finally:
        j.close()


def moves_in(journal: Path) -> int:
    """Moves the advisor has journaled so far (its Stores that carry ``moved_from``)."""
    if not journal.exists():
        return 0
    j = SqliteJournal(journal)
    try:
        return sum(1 for _, b in j.read() if b.source == "advisor" for e in b.events
                   if e.extra_metadata and "moved_from" in e.extra_metadata)
    finally:
        j.close()


def test_kill9_at_random_points_loses_nothing(tmp_path: Path, local_s3: LocalS3) -> None:
    rng = random.Random(20240607)
    urls = [f"zmq://127.0.0.1:{free_port()}?replay={free_port()}" for _ in range(2)]
    bucket = f"crash-{uuid.uuid4().hex[:12]}"
    volumes = [
        {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 40 * BLK, "root": str(tmp_path / "fast"),
         "segment_bytes": 8 * BLK},
        {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30, "root": str(tmp_path / "slow"),
         "segment_bytes": 16 * BLK},
        {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30, "endpoint": local_s3.endpoint,
         "bucket": bucket, "access_key": local_s3.access_key, "secret_key": local_s3.secret_key,
         "segment_bytes": 8 * BLK},
    ]
    conf = {
        "journal_path": str(tmp_path / "journal.sqlite"), "catalog_path": str(tmp_path / "catalog.sqlite"),
        "namespace": NS, "volumes": volumes, "fast_volume": "fast", "slow_volumes": ["slow"],
        "archive_volume": "s3", "subscribe_urls": urls, "api_enabled": False, "policy_interval_s": 0.05,
        "get_timeout_s": 0.05, "snapshot_every_batches": 10, "snapshot_every_s": 0,
        # min_hits 1: moves start early and keep coming (the stable policy moves a block once);
        # min_move_interval_s 0: a block may move again at once, so moves go on across the
        # kills (the move guard's memory now survives a restart, which stopped them here)
        "policy": {"planner": {"max_moves_per_round": 6, "min_move_interval_s": 0}, "compaction": {"live_fraction": 0.6},
                   "promotion": {"min_hits": 1}},
    }
    cfg = tmp_path / "advisor.json"
    cfg.write_text(json.dumps(conf))
    cfg.chmod(0o600)  # it holds the S3 secret: a config readable by others is refused
    log = tmp_path / "advisor.stderr"
    catalog = SqliteCatalog(tmp_path / "catalog.sqlite")
    agent = StorageAgent(catalog, name=f"crash-worker-{uuid.uuid4().hex[:6]}")
    for v in AdvisorSettings(**conf).volumes:
        agent.register_volume(v.to_descriptor())
    workers = Workers(urls, agent)
    zygote = Zygote(cfg, log)
    journal = tmp_path / "journal.sqlite"
    moves_seen: list[int] = []
    try:
        for k in range(KILLS):
            pid = zygote.start()
            try:
                if k % 5 != 4:  # most kills happen after READY, while rounds move blocks
                    line = zygote.readline()
                    assert line.startswith("ADVISOR READY"), log.read_text()[-3000:]
                workers.replay(PER_RUN)
                if k % 5 != 4:
                    # a loaded machine runs fewer policy rounds in a fixed time: wait for this
                    # run's first move (at most 5 s; a settled tier may have none to make), so
                    # the kill lands among moves
                    before = moves_seen[-1] if moves_seen else 0
                    t_wait = time.monotonic()
                    while time.monotonic() < t_wait + 5 and moves_in(journal) <= before:
                        time.sleep(0.05)
                time.sleep(rng.uniform(0.05, 0.6))
            finally:
                zygote.kill9(pid)
            moves_seen.append(moves_in(journal))
        # one more run that catches up with every worker batch, then a last kill
        pid = zygote.start()
        try:
            assert zygote.readline().startswith("ADVISOR READY"), log.read_text()[-3000:]
            workers.replay(6)
            want = workers.last_seqs()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and any(journaled(journal, s) < q for s, q in want.items()):
                time.sleep(0.05)
            assert all(journaled(journal, s) == q for s, q in want.items()), log.read_text()[-3000:]
            time.sleep(rng.uniform(0.05, 0.3))
        finally:
            zygote.kill9(pid)

        # moves really happened, and kept happening across kills
        assert moves_seen[-1] >= 20, moves_seen
        assert sum(1 for a, b in zip(moves_seen, moves_seen[1:]) if b > a) >= 8, moves_seen

        # restart once more (policies off, reconcile on): snapshot + tail == fresh fold
        settings = AdvisorSettings(**{**conf, "subscribe_urls": [], "policy_interval_s": 0})
        svc = AdvisorService(settings)
        svc.start()
        try:
            assert svc.counters["snapshot_loaded_position"] > 0  # it did start from a snapshot
            assert svc.journal is not None
            fresh = PrefixIndex()
            for _, b in svc.journal.read():
                fresh.apply_batch(b)
            assert svc.index.dump() == fresh.dump()

            # no block lost, every copy verified
            keys = [BlockKey(NS, h) for h in sorted(workers.written)]
            placements = agent.locate(keys)
            assert all(p is not None for p in placements)
            got = agent.get(keys)  # raises on a checksum mismatch
            assert all(torch.equal(g, data(k.sequence_hash)) for g, k in zip(got, keys))
            # the index and the catalog agree on every volume (after the restart's reconcile)
            by_vol: dict[str, set[int]] = {"fast": set(), "slow": set(), "s3": set()}
            for p in placements:
                assert p is not None
                by_vol[p.volume_id].add(p.key.sequence_hash)
            for vol, hs in by_vol.items():
                assert svc.index.blocks_at(vol) == hs, vol
            # promotions and demotions (one tier down: fast -> slow) both happened
            demoted = sum(1 for _, b in svc.journal.read() if b.source == "advisor" for e in b.events
                          if e.extra_metadata and e.extra_metadata.get("moved_from") == "fast")
            assert by_vol["fast"] and demoted > 0, demoted
        finally:
            svc.stop()
    finally:
        zygote.close()
        workers.close()
        agent.close()
        catalog.close()
