"""Soak: a sustained event load with lookups and moves, for N minutes (docs/reliability.md).

One advisor service (SQLite journal, placement catalog, a ``fast`` and a ``slow`` POSIX
volume, an ``s3`` archive volume on a loopback ``moto_server``, policy rounds every 2 s,
garbage collection on its timer) ingests the events of two worker threads over ZMQ.  The
``slow`` volume is small (``--slow-blocks``): once it passes its high watermark, cold blocks
are demoted to S3, and blocks hit again are promoted back (archive → slow → fast), so moves
go both ways for the whole run (``--no-archive``: the earlier set-up, whose moves stop
once ``fast`` is full).  Each worker serves "requests": a chain of blocks of one of
``--prefixes`` conversations, stores new blocks on ``slow`` (on the archive while ``slow``
is full: a worker whose disk tier is full writes through to the object store; acknowledged
once the put returned and the Store was published), and keeps a bounded G1 (Remove events
for what it evicts), so the index holds a bounded working set and memory must stay flat.
The workers first serve every conversation once (the whole working set is stored within
the first minute, so growth after it is not the working set still arriving); then
popularity is Zipf-like over a ranking that drifts continuously (``--drift-per-s``
conversations a second), so hot blocks keep cooling and cold ones keep warming.  A lookup
thread asks the advisor for the longest cached prefix of random chains.

Every ``--interval-s`` a row: RSS of the process, lookup p50/p99 over the interval, events
applied, moves done and failed, promotions and demotions done in the interval, and blocks
lost (acknowledged blocks the catalog no longer holds).  At the end every acknowledged block is read back and compared byte for byte.

The summary compares the end with the first minute (the reference: the row at 60 s, rows
being on a fixed grid of ``--interval-s``): memory growth after the first minute (goal: under 5 %), lookup p99 end / first minute (goal: at most 2x), and
losses (goal: 0), and, with the archive, the intervals after the first minute with moves in
both directions (goal: all of them); a last line says PASS or FAIL on the goals of memory,
losses and (with the archive) moves both ways, and so does the exit status (0 / 1).

Run: ``python bench/soak.py --minutes 10 [--rate 2000] [--no-archive] [--json soak.json]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from advisor import AdvisorService, AdvisorSettings  # noqa: E402
from bench._report import Report, add_json_option  # noqa: E402
from event_plane import PublisherConfig, make_publisher  # noqa: E402
from event_plane.schema import remove, store  # noqa: E402
from storage_backends import BlockKey, SqliteCatalog, StorageAgent, free_port  # noqa: E402
from storage_backends.local_s3 import LocalS3, start_local_s3  # noqa: E402
from storage_backends.types import StorageError  # noqa: E402

NS = "soak"
BLK = 16 << 10
CHAIN = 8
G1_BLOCKS = 256


def block(h: int) -> torch.Tensor:
    """Block ``h``'s bytes (deterministic, so they can be checked at the end)."""
    return torch.full((BLK,), h % 251, dtype=torch.uint8)


def rss_bytes() -> int:
    """Resident set size of this process (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Row:
    """One interval of the soak."""

    t_s: float
    rss_mib: float
    lookup_p50_us: float
    lookup_p99_us: float
    lookups: int
    events_applied: int
    moves_done: int
    moves_failed: int
    promoted: int
    demoted: int
    lost: int


class Soak:
    def __init__(self, tmp: Path, rate: int, prefixes: int, s3: LocalS3 | None = None,
                 slow_blocks: int = 1024, drift_per_s: float = 5.0) -> None:
        self.rate = rate
        self.drift_per_s = drift_per_s
        self.t0 = time.monotonic()  # reset when the load starts
        self.prefixes = prefixes
        self.archive = "s3" if s3 is not None else None
        self.urls = []
        for _ in range(2):
            port, rep = free_port(), free_port()
            self.urls.append(f"zmq://127.0.0.1:{port}?replay={rep}")
        volumes = [
            {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 2048 * BLK,
             "root": str(tmp / "fast"), "segment_bytes": 64 * BLK},
            {"id": "slow", "kind": "posix", "media": "hdd",
             "capacity_bytes": slow_blocks * BLK if s3 is not None else 1 << 34,
             "root": str(tmp / "slow"), "segment_bytes": 64 * BLK},
        ]
        extra: dict = {}
        if s3 is not None:
            volumes.append({"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 36,
                            "endpoint": s3.endpoint, "bucket": "kvadvisor-soak", "prefix": "kv",
                            "segment_bytes": 64 * BLK, "access_key": s3.access_key, "secret_key": s3.secret_key})
            extra["archive_volume"] = "s3"
        self.settings = AdvisorSettings(
            journal_path=str(tmp / "journal.sqlite"), catalog_path=str(tmp / "catalog.sqlite"), namespace=NS,
            volumes=volumes, fast_volume="fast", slow_volumes=["slow"], subscribe_urls=self.urls,
            policy_interval_s=2.0, api_enabled=False, get_timeout_s=0.05, gc_interval_s=30.0,
            policy={"promotion": {"min_hits": 2},
                    # with the archive: a demotion frees 40 % of a volume, room for promotions
                    # from the archive besides the workers' new blocks
                    **({"demotion": {"high_watermark": 0.8, "low_watermark": 0.4}} if s3 is not None else {})},
            **extra,
        )
        # the workers' ZMQ replay buffers (in this process) hold 1,000 batches each: full
        # within the first minute, so the memory after it is the advisor's (the default
        # 10,000 took 5 minutes to fill at 2,000 events/s and read as growth)
        self.pubs = [make_publisher(u, f"worker-{i}", config=PublisherConfig(max_events=64, max_delay_s=0.02,
                                                                             replay_buffer=1000))
                     for i, u in enumerate(self.urls)]
        self.svc = AdvisorService(self.settings)
        self.catalog = SqliteCatalog(tmp / "catalog.sqlite")
        self.agent = StorageAgent(self.catalog, name="soak-workers")
        for v in self.settings.volumes:
            self.agent.register_volume(v.to_descriptor())
        self.acked: set[int] = set()
        self.acked_lock = threading.Lock()
        self.lat: deque[float] = deque()
        self.stop = threading.Event()
        self.put_failures = 0
        self._moved = {"promote": 0, "demote": 0}

    @staticmethod
    def conversation(p: int) -> list[int]:
        """Conversation ``p``'s chain of block hashes."""
        return [(p << 16) | i | (1 << 40) for i in range(CHAIN)]

    def chain(self, rng: random.Random) -> list[int]:
        """A request's chain: Zipf-like popularity over the conversations, whose ranking
        drifts continuously (``drift_per_s`` conversations a second: the most popular
        conversations are always others), so blocks cool down and are demoted, and others
        come back from the archive, for the whole run."""
        rank = min(int(rng.paretovariate(1.2)) - 1, self.prefixes - 1)
        shift = int((time.monotonic() - self.t0) * self.drift_per_s)
        return self.conversation((rank + shift) % self.prefixes)

    def worker(self, i: int) -> None:
        rng = random.Random(i)
        pub = self.pubs[i]
        g1: deque[int] = deque()
        in_g1: set[int] = set()
        per_s = self.rate / 2
        t0, sent = time.monotonic(), 0
        first = iter(range(i, self.prefixes, 2))  # every conversation once, then the drifting ranking
        while not self.stop.is_set():
            p = next(first, None)
            hs = self.chain(rng) if p is None else self.conversation(p)
            with self.acked_lock:
                new = [h for h in hs if h not in self.acked]
            where = "slow"
            if new:
                blocks = [(BlockKey(NS, h), block(h)) for h in new]
                try:
                    self.agent.put(blocks, where)
                except StorageError:  # slow full until the next demotions: write through to the archive
                    try:
                        if self.archive is None:
                            raise
                        where = self.archive
                        self.agent.put(blocks, where)
                    except StorageError:  # not acknowledged, not stored
                        self.put_failures += 1
                        new = []
            events, parent = [], None
            for h in hs:
                if h not in in_g1:
                    events.append(store(h, hs[0], parent, BLK, "g1"))
                    g1.append(h)
                    in_g1.add(h)
                if h in new:
                    events.append(store(h, hs[0], parent, BLK, where))
                parent = h
            while len(g1) > G1_BLOCKS:
                old = g1.popleft()
                in_g1.discard(old)
                events.append(remove(old, old, None, BLK, "g1"))
            pub.publish(events)
            with self.acked_lock:
                self.acked.update(new)
            sent += len(events)
            ahead = sent / per_s - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def lookups(self) -> None:
        rng = random.Random(99)
        q = self.svc.query()
        while not self.stop.is_set():
            hs = self.chain(rng)
            t = time.perf_counter()
            q.lookup(hs)
            self.lat.append(time.perf_counter() - t)
            time.sleep(0.001)

    def lost(self) -> int:
        with self.acked_lock:
            keys = [BlockKey(NS, h) for h in self.acked]
        return sum(p is None for p in self.agent.locate(keys))

    def row(self, t0: float) -> Row:
        lat = sorted(self.lat)
        self.lat.clear()
        pct = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6) if lat else (lambda q: 0.0)
        st = self.svc.query().stats()
        done = st["moves"]["done"]
        delta = {k: done.get(k, 0) - self._moved[k] for k in self._moved}
        self._moved = {k: done.get(k, 0) for k in self._moved}
        return Row(round(time.monotonic() - t0, 1), rss_bytes() / (1 << 20), pct(0.50), pct(0.99), len(lat),
                   st["events_applied"], sum(done.values()), sum(st["moves"]["failed"].values()),
                   delta["promote"], delta["demote"], self.lost())

    def read_back(self) -> tuple[int, int]:
        with self.acked_lock:
            hs = sorted(self.acked)
        ok = 0
        for i in range(0, len(hs), 256):
            got = self.agent.get([BlockKey(NS, h) for h in hs[i:i + 256]])
            ok += sum(torch.equal(g, block(h)) for g, h in zip(got, hs[i:i + 256]))
        return len(hs), ok

    def close(self) -> None:
        for p in self.pubs:
            p.close()
        self.svc.stop()
        self.agent.close()
        self.catalog.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=2000, help="events per second, both workers together")
    ap.add_argument("--prefixes", type=int, default=2000, help="conversations (Zipf-like popularity)")
    ap.add_argument("--interval-s", type=float, default=30.0)
    ap.add_argument("--no-archive", action="store_true", help="no S3 archive (moves stop once fast is full)")
    ap.add_argument("--slow-blocks", type=int, default=1024, help="slow volume capacity in blocks (with the archive)")
    ap.add_argument("--drift-per-s", type=float, default=5.0,
                    help="conversations a second the popularity ranking moves by, continuously (0: never)")
    add_json_option(ap)
    a = ap.parse_args()
    report = Report("soak", "sustained events, lookups and moves for N minutes: the end against the first minute")
    s3 = None if a.no_archive else start_local_s3()
    with tempfile.TemporaryDirectory(prefix="kvadvisor-soak-") as tmp:
        soak = Soak(Path(tmp), a.rate, a.prefixes, s3, a.slow_blocks, a.drift_per_s)
        soak.svc.start()
        soak.t0 = time.monotonic()
        threads = [threading.Thread(target=soak.worker, args=(i,), daemon=True) for i in range(2)]
        threads.append(threading.Thread(target=soak.lookups, daemon=True))
        for t in threads:
            t.start()
        rows: list[Row] = []
        t0 = time.monotonic()
        end = t0 + a.minutes * 60
        print(f"{'t_s':>7} {'rss_MiB':>8} {'p50_us':>8} {'p99_us':>8} {'lookups':>8} {'events':>10} "
              f"{'moves':>6} {'failed':>6} {'promo':>6} {'demo':>6} {'lost':>5}", flush=True)
        while time.monotonic() < end:
            # rows on a fixed grid (t0 + k × interval): the time a row takes does not shift the
            # later ones, so the row closing the first minute is the one at 60 s
            until = min(t0 + (len(rows) + 1) * a.interval_s, end)
            while time.monotonic() < until:
                time.sleep(max(0.0, min(1.0, until - time.monotonic())))
            r = soak.row(t0)
            rows.append(r)
            print(f"{r.t_s:7.1f} {r.rss_mib:8.1f} {r.lookup_p50_us:8.1f} {r.lookup_p99_us:8.1f} {r.lookups:8d} "
                  f"{r.events_applied:10d} {r.moves_done:6d} {r.moves_failed:6d} {r.promoted:6d} {r.demoted:6d} "
                  f"{r.lost:5d}", flush=True)
        soak.stop.set()
        for t in threads:
            t.join(timeout=30)
        checked, exact = soak.read_back()
        put_failures = soak.put_failures
        soak.close()
    if s3 is not None:
        s3.stop()
    # the first minute: the rows up to the one at 60 s (by the grid, not by their measured
    # t_s, which is a little past each mark); the reference is its last row
    n_first = max(1, round(60.0 / a.interval_s))
    first = rows[:n_first]
    ref = first[-1]
    last = rows[-1]
    growth = (last.rss_mib - ref.rss_mib) / ref.rss_mib if ref.rss_mib else 0.0
    p99_first = max(r.lookup_p99_us for r in first)
    later = rows[n_first:]
    ratio = last.lookup_p99_us / p99_first if p99_first else 0.0
    summary = {"minutes": a.minutes, "rate": a.rate, "memory_growth_after_first_minute": growth,
               "lookup_p99_end_over_first_minute": ratio, "blocks_checked": checked, "blocks_exact": exact,
               "lost": last.lost + (checked - exact), "events_applied": last.events_applied,
               "moves_done": last.moves_done, "moves_failed": last.moves_failed,
               "promoted": sum(r.promoted for r in rows), "demoted": sum(r.demoted for r in rows),
               "intervals_after_first_minute": len(later),
               "intervals_with_moves_both_ways": sum(1 for r in later if r.promoted and r.demoted),
               "put_failures": put_failures, "archive": s3 is not None}
    both = summary["intervals_with_moves_both_ways"]
    checks = {"nothing lost": summary["lost"] == 0 and checked > 0,
              "memory growth < 5 %": growth < 0.05}
    if s3 is not None:  # without the archive moves stop once fast is full (by design)
        checks["moves both ways in every interval"] = bool(later) and both == len(later)
    summary["checks"] = checks
    summary["pass"] = all(checks.values())
    print(f"memory growth after the first minute: {growth * 100:+.1f} % ({ref.rss_mib:.1f} MiB at {ref.t_s:.0f} s -> "
          f"{last.rss_mib:.1f} MiB at {last.t_s:.0f} s; goal < 5 %)")
    print(f"lookup p99, end / first minute: {ratio:.2f}x (goal <= 2x)")
    print(f"acknowledged blocks read back byte-exact: {exact:,}/{checked:,}; lost: {summary['lost']}")
    print(f"moves: {summary['promoted']:,} promotions, {summary['demoted']:,} demotions")
    print(f"moves both ways in {both}/{len(later)} intervals after the first minute"
          + (" (goal: all)" if s3 is not None else " (no archive: not a goal)"))
    failed = [k for k, ok in checks.items() if not ok]
    print("soak: PASS (" + "; ".join(checks) + ")" if not failed else "soak: FAIL (" + "; ".join(failed) + ")")
    report.add("RSS of the process", last.rss_mib, ref.rss_mib, unit="MiB",
               reference_name="last row within the first minute",
               goal="< 5 % growth", met=growth < 0.05, better="lower", headline=True)
    report.add("lookup p99", last.lookup_p99_us, p99_first, unit="µs",
               reference_name="worst interval of the first minute",
               goal="<= 2x", met=ratio <= 2, better="lower")
    report.add("acknowledged blocks read back byte-exact", exact, checked, unit="blocks",
               reference_name="blocks acknowledged", goal="all (0 lost)", met=summary["lost"] == 0)
    if s3 is not None:
        report.add("intervals with moves both ways", both, len(later), unit="intervals",
                   reference_name="intervals after the first minute", goal="all", met=both == len(later))
    report.extra = {"rows": [asdict(r) for r in rows], "summary": summary}
    report.write(a.json)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
