"""Shared set-up of the fault cells: an advisor service over two posix volumes and a
'worker' storage agent on the same catalog (real NIXL POSIX I/O, real SQLite files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

from advisor import AdvisorService, AdvisorSettings
from event_plane.schema import EventBatch, store
from storage_backends import BlockKey, SqliteCatalog, StorageAgent
from tests import polling

NS = "ns-faults"
BLK = 64 << 10  # bytes per block
REPO = Path(__file__).resolve().parents[2]


def data(h: int) -> torch.Tensor:
    """The bytes of block ``h`` (deterministic)."""
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (BLK,), dtype=torch.uint8, generator=g)


def chain(hashes: list[int], loc: str) -> list:
    """Store events of a chain of blocks at ``loc``."""
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BLK, loc))
        parent = h
    return out


def settings(tmp: Path, fast_root: Path | None = None, fast_blocks: int = 100, **kw: Any) -> AdvisorSettings:
    """Advisor settings: ``fast`` (posix, ``fast_blocks`` blocks) and ``slow`` under ``tmp``;
    ``archive=(endpoint, access key, secret key)`` adds an S3 archive volume ``s3``, with
    ``archive_options`` (further fields of its volume settings) when given."""
    fast_root = fast_root or tmp / "fast"
    base: dict[str, Any] = dict(
        journal_path=str(tmp / "journal.sqlite"),
        catalog_path=str(tmp / "catalog.sqlite"),
        namespace=NS,
        volumes=[
            {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": fast_blocks * BLK,
             "root": str(fast_root), "segment_bytes": 1 << 20},
            {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30, "root": str(tmp / "slow"),
             "segment_bytes": 1 << 20},
        ],
        fast_volume="fast",
        slow_volumes=["slow"],
        policy_interval_s=0,
        api_enabled=False,
        snapshot_store="none",
        volume_roots=[str(tmp)],
    )
    archive = kw.pop("archive", None)  # (endpoint, access key, secret key): an S3 archive volume
    archive_options = kw.pop("archive_options", {})
    if archive is not None:
        endpoint, ak, sk = archive
        base["volumes"].append({"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30,
                                "endpoint": endpoint, "bucket": f"faults-{uuid.uuid4().hex[:12]}", "prefix": "kv",
                                "segment_bytes": 1 << 20, "access_key": ak, "secret_key": sk, **archive_options})
        base["archive_volume"] = "s3"
    base.update(kw)
    return AdvisorSettings(**base)


class Worker:
    """A worker's storage agent on the advisor's catalog, and its event batches."""

    def __init__(self, s: AdvisorSettings) -> None:
        assert s.catalog_path is not None
        self.catalog = SqliteCatalog(s.catalog_path)
        self.agent = StorageAgent(self.catalog, name=f"worker-{uuid.uuid4().hex[:8]}")
        for v in s.volumes:
            self.agent.register_volume(v.to_descriptor())
        self.seq: dict[str, int] = {}
        self.ts = 1_000

    def put(self, hashes: list[int], vol: str) -> None:
        self.agent.put([(BlockKey(NS, h), data(h)) for h in hashes], vol)

    def batch(self, source: str, *evs: Any) -> EventBatch:
        seq = self.seq.get(source, 0)
        self.seq[source] = seq + 1
        self.ts += 1_000
        return EventBatch(1, source, 1, seq, self.ts, list(evs))

    def send(self, svc: AdvisorService, source: str, *evs: Any) -> None:
        assert svc.ingest(self.batch(source, *evs))

    def where(self, hashes: list[int]) -> list[str | None]:
        return [p.volume_id if p else None for p in self.agent.locate([BlockKey(NS, h) for h in hashes])]

    def reads_back(self, hashes: list[int]) -> bool:
        got = self.agent.get([BlockKey(NS, h) for h in hashes])
        return all(torch.equal(g, data(h)) for g, h in zip(got, hashes))

    def close(self) -> None:
        self.agent.close()
        self.catalog.close()


def hot(w: Worker, svc: AdvisorService, hashes: list[int], vol: str = "slow") -> None:
    """Blocks stored on ``vol`` by w0 and onboarded by w1 and w2: 2 hits each."""
    w.put(hashes, vol)
    w.send(svc, "w0", *chain(hashes, "g1"), *chain(hashes, vol))
    w.send(svc, "w1", *chain(hashes, "g1"))
    w.send(svc, "w2", *chain(hashes, "g1"))


_CRASH_COPY = r"""
import json, os, sys
from advisor import AdvisorSettings
from storage_backends import BlockKey, SqliteCatalog, StorageAgent
cfg = json.loads(sys.argv[1])
s = AdvisorSettings(**cfg["settings"])
agent = StorageAgent(SqliteCatalog(s.catalog_path), name="crasher")
for v in s.volumes:
    agent.register_volume(v.to_descriptor())
olds = [p for p in agent.locate([BlockKey(cfg["ns"], h) for h in cfg["hashes"]]) if p is not None]
agent.copy_many(olds, cfg["dst"])  # copied and verified, never committed
print("COPIED", flush=True)
os.kill(os.getpid(), 9)
"""


def crash_mid_copy(s: AdvisorSettings, hashes: list[int], dst: str) -> None:
    """A separate process copies ``hashes`` to ``dst`` and is killed (-9) before it commits:
    the copies' segments stay unsealed, recorded in the catalog, and on the volume."""
    arg = json.dumps({"settings": json.loads(s.model_dump_json()), "ns": NS, "hashes": hashes, "dst": dst})
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _CRASH_COPY, arg], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == -9 and "COPIED" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


def wait_until(pred: Any, timeout: float = 120.0, what: str = "condition") -> None:
    """Poll ``pred()`` every 50 ms until it is true; fail after ``timeout`` seconds (a
    generous deadline: the machines running the cells are loaded)."""
    polling.wait_until(pred, timeout, what)


def start_redis(port: int, aof_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """A private ``redis-server`` on ``127.0.0.1:port``, ready: it answers PING (a restart
    answers ``LOADING`` until its append-only file is read back); with ``aof_dir`` it keeps
    an append-only file there (``appendfsync always``: a restart gets every write back),
    else nothing is persisted."""
    import shutil

    import redis

    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    persist = ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(aof_dir)] if aof_dir else \
        ["--appendonly", "no"]
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", *persist],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def answers() -> bool:
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0) as r:
                return bool(r.ping())
        except redis.RedisError:  # refused, or BusyLoadingError while the AOF is read
            return False
    try:
        wait_until(answers, 60, "redis-server answering PING")
    except AssertionError:
        proc.kill()
        raise
    return proc
