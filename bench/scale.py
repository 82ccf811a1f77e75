"""Scaled mode: aggregate fold rate and lookup rate with 1 and 2 cluster advisors, in one run.

The Mooncake trace (bundled slice, or ``--trace``) is published once by 2 workers through
``PartitionedPublisher`` into a private ``nats-server -js`` (8 partitions).  Then, for 1 and
for 2 advisor processes (``python -m advisor.cluster``) started on that log:

* **fold**: each advisor rebuilds its partitions from the stream (an empty Redis snapshot
  store, so the whole log); the advisors time it themselves (wall clock: first partition
  taken to last partition folded); aggregate events/s = events applied / that time;
* **lookups**: ``--clients`` processes each send lookups of random trace requests through
  ``ClusterClient`` (NATS request/reply to each piece's owner) for ``--seconds``; aggregate
  lookups/s and p50/p99 latency;
* **memory**: RSS of each advisor after the fold, per partition it owns.

The reference is the 1-advisor run; the ratio column is 2 advisors / 1 advisor (goal
>= 1.7 for the fold).  Every figure comes from the same run.

    .venv/bin/python bench/scale.py                       # bundled 2,000-request slice
    .venv/bin/python bench/scale.py --trace $KVADVISOR_TRACES/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.cluster.node import ClusterClient, PartitionUnavailable  # noqa: E402
from bench._report import Report, add_json_option  # noqa: E402
from event_plane.partition import PartitionScheme  # noqa: E402
from event_plane.partitioned import PartitionedPublisher, partition_url  # noqa: E402
from event_plane.schema import store  # noqa: E402
from event_plane.urls import make_publisher  # noqa: E402
from kvadvisor.evaluate import load_trace  # noqa: E402
from kvadvisor.localcluster import free_port  # noqa: E402
from kvadvisor.trace import bundled_trace  # noqa: E402

M64 = (1 << 64) - 1
REPO = Path(__file__).resolve().parents[1]


def _u64(h: int) -> int:
    return (h * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & M64


def publish(url: str, ns: str, scheme: PartitionScheme, reqs: list[list[int]]) -> int:
    """Publish the trace as 2 workers' g1 Stores; returns the events published."""
    pubs = []
    for w in range(2):
        e = random.getrandbits(63)
        pubs.append(PartitionedPublisher(scheme, lambda k, w=w, e=e: make_publisher(
            partition_url(f"{url}?namespace={ns}&manage_stream=1", k), f"w{w}", epoch=e)))  # first on the server
    seen: list[set[int]] = [set(), set()]
    for i, req in enumerate(reqs):
        w = i % 2
        chain = [_u64(h) for h in req]
        evs = [store(h, chain[0], chain[d - 1] if d else None, 4096, "g1")
               for d, h in enumerate(chain) if h not in seen[w]]
        seen[w].update(chain)
        pubs[w].publish(evs)
    for p in pubs:
        p.close()
    return sum(p.stats().events for p in pubs)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _client(url: str, ns: str, parts: int, reqs: list[list[int]], seconds: float, q: mp.Queue) -> None:
    c = ClusterClient(url, PartitionScheme(parts), ns, timeout_s=5.0)
    rng = random.Random(os.getpid())
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        chain = [_u64(h) for h in rng.choice(reqs)]
        t0 = time.perf_counter()
        try:
            c.lookup(chain)
        except PartitionUnavailable:
            continue
        lat.append(time.perf_counter() - t0)
    c.close()
    q.put(lat)


def run(n_adv: int, url: str, redis: str, ns: str, parts: int, events: int, reqs: list[list[int]],
        clients: int, seconds: float, tmp: Path) -> dict[str, float]:
    run_ns = ns
    procs = []
    for i in range(n_adv):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "advisor.cluster", "--nats", url, "--redis", redis, "--id", f"b{n_adv}-{i}",
             "--namespace", run_ns, "--partitions", str(parts), "--lease-ttl", "3", "--heartbeat", "0.5",
             "--snapshot-interval", "3600"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp / f"adv{n_adv}-{i}.log", "w")))
    for p in procs:  # joined the cluster: the fold is timed from here (leases, rebuild, apply)
        assert p.stdout is not None and b"ready" in p.stdout.readline()
    t0 = time.perf_counter()
    client = ClusterClient(url, PartitionScheme(parts), run_ns, timeout_s=5.0)
    try:
        while True:  # every partition owned, ready (folded what the log held) and all applied
            try:
                st = client.status()
                applied = sum(s["applied"] for s in st.values())
                if applied >= expected_batches[0]:
                    break
            except PartitionUnavailable:
                pass
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("the fold did not finish in 600 s")
            time.sleep(0.25)  # the advisors time the fold themselves; a poll costs them CPU
        # the rebuild, as the advisors timed it: first partition taken -> last one folded
        fold_s = max(s["ready_at"] for s in st.values()) - min(s["started_at"] for s in st.values())
        events = sum(s["events"] for s in st.values())
        rss = [_rss_mb(p.pid) for p in procs]
        q: mp.Queue = mp.Queue()
        cps = [mp.Process(target=_client, args=(url, run_ns, parts, reqs, seconds, q)) for _ in range(clients)]
        for c in cps:
            c.start()
        lat: list[float] = []
        for _ in cps:
            lat += q.get()
        for c in cps:
            c.join()
    finally:
        client.close()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    lat.sort()
    return {"fold_s": fold_s, "events_per_s": events / fold_s, "lookups_per_s": len(lat) / seconds,
            "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
            "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
            "rss_mb_per_partition": sum(rss) / parts}


expected_batches = [0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=0, help="first N requests (0 = all)")
    ap.add_argument("--repeat", type=int, default=1, help="publish the trace this many times, ids salted apart")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    add_json_option(ap)
    a = ap.parse_args()
    report = Report("scale", "scaled mode: rebuild fold and lookups with 2 cluster advisors against 1")
    reqs = load_trace(a.trace or bundled_trace())
    if a.requests:
        reqs = reqs[: a.requests]
    reqs = [[h + (r << 40) for h in req] for r in range(a.repeat) for req in reqs]
    tmp = Path(tempfile.mkdtemp(prefix="kvadvisor-scale-"))
    port = free_port()
    nats = subprocess.Popen(["nats-server", "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp / "js")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    url = f"nats://127.0.0.1:{port}"
    scheme = PartitionScheme(a.partitions)
    try:
        ns = "s" + uuid.uuid4().hex[:8]
        t0 = time.perf_counter()
        events = publish(f"jetstream://127.0.0.1:{port}", ns, scheme, reqs)
        pub_s = time.perf_counter() - t0
        import asyncio

        import nats as nats_py

        async def count() -> int:
            nc = await nats_py.connect(url)
            info = await nc.jetstream().stream_info("KVADVISOR_EVENTS")
            await nc.close()
            return int(info.state.messages)

        expected_batches[0] = asyncio.run(count())
        print(f"log: {len(reqs):,} requests -> {events:,} events in {expected_batches[0]:,} batches "
              f"over {a.partitions} partitions (published in {pub_s:.1f} s)")
        import redis as redis_py

        results = {}
        for n_adv in (1, 2):
            # every run folds the whole log: no snapshots from an earlier run
            r = redis_py.Redis.from_url(a.redis)
            for key in r.scan_iter(f"kvadvisor:{ns}:*"):
                r.delete(key)
            results[n_adv] = run(n_adv, url, a.redis, ns, a.partitions, events, reqs, a.clients, a.seconds, tmp)
        one, two = results[1], results[2]
        print(f"{'':28} {'1 advisor':>12} {'2 advisors':>12} {'2 / 1':>8}")
        for key, fmt in (("events_per_s", "{:,.0f}"), ("fold_s", "{:.2f}"), ("lookups_per_s", "{:,.0f}"),
                         ("p50_ms", "{:.2f}"), ("p99_ms", "{:.2f}"), ("rss_mb_per_partition", "{:.1f}")):
            print(f"{key:28} {fmt.format(one[key]):>12} {fmt.format(two[key]):>12} {two[key] / one[key]:>8.2f}")
        print("goal: events_per_s 2 / 1 >= 1.7")
        fold = two["events_per_s"] / one["events_per_s"]
        report.add("rebuild fold, aggregate", two["events_per_s"], one["events_per_s"], unit="events/s",
                   reference_name="1 advisor, same log", goal=">= 1.7x", met=fold >= 1.7, headline=True)
        report.add("lookups through ClusterClient, aggregate", two["lookups_per_s"], one["lookups_per_s"],
                   unit="lookups/s", reference_name="1 advisor")
        report.add("lookup p99", two["p99_ms"], one["p99_ms"], unit="ms", reference_name="1 advisor", better="lower")
        report.add("RSS per partition", two["rss_mb_per_partition"], one["rss_mb_per_partition"], unit="MB",
                   reference_name="1 advisor", better="lower")
        report.extra = {"requests": len(reqs), "events": events, "batches": expected_batches[0],
                        "partitions": a.partitions, "one_advisor": one, "two_advisors": two}
        report.write(a.json)
    finally:
        nats.terminate()
        nats.wait(10)


if __name__ == "__main__":
    main()
