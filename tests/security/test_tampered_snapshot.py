"""A snapshot that fails to load is skipped and counted, never fatal, over a real Redis:
whoever can write Redis can recompute the checksum, so a payload nested deeper than the
stack, fields that are not integers and members that are not positions must each leave the
advisor starting from the newest good snapshot (plus its journal)."""

from __future__ import annotations

import secrets
from pathlib import Path

import redis
import xxhash
from security_helpers import BS

from advisor.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane.schema import WIRE_VERSION, EventBatch, store


def test_tampered_redis_snapshots_are_skipped_and_counted(tmp_path: Path, redis_url: str) -> None:
    prefix = f"kvadvisor:test-tamper-{secrets.token_hex(4)}"
    s = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False, snapshot_store="redis",
                        redis_url=redis_url, snapshot_key_prefix=prefix, snapshot_every_s=0,
                        snapshot_every_batches=0, snapshot_keep=10, snapshot_on_stop=False)
    r = redis.Redis.from_url(redis_url)
    svc = AdvisorService(s)
    svc.start()
    try:
        for seq in range(10):
            svc.ingest(EventBatch(WIRE_VERSION, "w0", 1, seq, 1, [store(10 + seq, 10, None, BS, "g1")]))
            if seq == 2:
                good = svc.snapshot_now()
        assert good == 3 and svc.position == 10
    finally:
        svc.stop()
    zkey = f"{prefix}:snapshots"
    deep = b"\x91" * 200_000 + b"\xc0"  # an array in an array ... 200,000 deep
    # newer than the good one and covered by the journal (positions 8, 9): tried first
    r.hset(f"{prefix}:snapshot:8", mapping={"payload": deep, "created_ns": 1, "checksum": xxhash.xxh3_64_intdigest(deep)})
    r.hset(f"{prefix}:snapshot:9", mapping={"payload": b"\x90", "created_ns": "soon", "checksum": "x"})
    r.zadd(zkey, {"8": 8, "9": 9, "not-a-position": 9.5})
    try:
        svc = AdvisorService(s)
        svc.start()  # on main: RecursionError / ValueError out of start()
        try:
            assert svc.counters["snapshot_loaded_position"] == good
            assert svc.counters["snapshots_skipped"] == 2
            assert svc.index.holds(12, "w0/g1") and svc.index.holds(19, "w0/g1")  # snapshot + journal
            assert svc.position == 10
        finally:
            svc.stop()
    finally:
        for k in r.scan_iter(f"{prefix}:*"):
            r.delete(k)
