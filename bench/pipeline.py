"""Whole-pipeline figures for the README's main job, side by side with a reference.

One run does three things on the same trace slice:

1. the full replay (``kvadvisor demo``: workers → ZMQ → advisor process → volumes, API),
   against the same workers with a null publisher and no advisor (the reference: what the
   workers cost without kvadvisor's event plane and advisor). Ratio = full / reference.
2. the advisor's ingest path on the journal that replay recorded: decode + journal append
   + PrefixIndex apply, against decode alone of the same batches (reference).
3. bytes per event on the wire, from the publishers' own counters.

Usage: ``python bench/pipeline.py [--requests 1000] [--repeat 3]``; prints medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor import PrefixIndex, SqliteJournal  # noqa: E402
from bench._report import Report, add_json_option  # noqa: E402
from event_plane import NullPublisher, decode_batch  # noqa: E402
from kvadvisor.demo import SLOW, _volumes, run_demo, runtime_config  # noqa: E402
from kvadvisor.settings import DemoSettings  # noqa: E402
from kvadvisor.trace import bundled_trace, read_mooncake, request_tokens  # noqa: E402
from kvbm_runtime import BlockManager, fill_synthetic_kv  # noqa: E402
from storage_backends import SqliteCatalog, StorageAgent, start_local_s3  # noqa: E402


def reference_replay(s: DemoSettings) -> float:
    """Wall seconds of the same replay with null publishers, no advisor, same volumes."""
    reqs = list(read_mooncake(s.trace or bundled_trace(), limit=s.requests))
    with tempfile.TemporaryDirectory() as tmp, start_local_s3() as s3:
        agent = StorageAgent(SqliteCatalog(Path(tmp) / "catalog.sqlite"))
        for v in _volumes(s, Path(tmp), s3.endpoint, s3.access_key, s3.secret_key):
            agent.register_volume(v)
        rcfg = runtime_config(s)
        mgrs = [BlockManager(rcfg, NullPublisher(f"worker-{i}"), store=agent, g3_volume=SLOW) for i in range(s.workers)]
        t0 = time.perf_counter()
        for n, req in enumerate(reqs):
            mgrs[n % s.workers].serve(request_tokens(req, s.page_size), fill_synthetic_kv)
        for m in mgrs:
            m.close()
        dt = time.perf_counter() - t0
        agent.close()
    return dt


def ingest_rates(journal_path: Path) -> tuple[float, float, int]:
    """(decode+journal+apply events/s, decode-only events/s, events) over a recorded journal."""
    src = SqliteJournal(journal_path)
    payloads = [p for _, p in src.read_raw()]
    src.close()
    events = sum(len(decode_batch(p).events) for p in payloads)
    t0 = time.perf_counter()
    for p in payloads:
        decode_batch(p)
    decode_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        j = SqliteJournal(Path(tmp) / "j.sqlite")
        idx = PrefixIndex()
        t0 = time.perf_counter()
        for p in payloads:
            b = decode_batch(p)
            j.append(p, b, verify=False)
            idx.apply_batch(b)
        full_s = time.perf_counter() - t0
        j.close()
    return events / full_s, events / decode_s, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    add_json_option(ap)
    a = ap.parse_args()
    report = Report("pipeline", "the demo's whole replay (workers, events, advisor, volumes) against the same "
                    "workers without kvadvisor")
    full, ref, ingest, decode, bpe, bpe_env = [], [], [], [], [], []
    for i in range(a.repeat):
        with tempfile.TemporaryDirectory() as wd:
            s = DemoSettings(requests=a.requests, workdir=Path(wd) / "demo")
            r = run_demo(s)
            full.append(r.wall_s)
            bpe.append(r.event_bytes_per_event)
            bpe_env.append(r.payload_bytes_per_event)
            rate, drate, n_events = ingest_rates(Path(wd) / "demo" / "journal.sqlite")
            ingest.append(rate)
            decode.append(drate)
        ref.append(reference_replay(s))
        print(f"run {i + 1}/{a.repeat}: full {full[-1]:.1f} s, reference {ref[-1]:.1f} s, "
              f"ingest {ingest[-1]:,.0f} ev/s over {n_events:,} events", flush=True)
    med = statistics.median
    print()
    print(f"{'figure (median of ' + str(a.repeat) + ')':<48}{'ours':>14}{'reference':>14}{'ratio':>9}")
    print(f"{'replay wall time, ' + str(a.requests) + ' requests (s)':<48}{med(full):>14.1f}{med(ref):>14.1f}"
          f"{med(full) / med(ref):>9.2f}   (reference: same workers, null publisher, no advisor)")
    print(f"{'advisor ingest, events/s (decode+journal+apply)':<48}{med(ingest):>14,.0f}{med(decode):>14,.0f}"
          f"{med(ingest) / med(decode):>9.2f}   (reference: decode only)")
    print(f"{'bytes per event on the wire (event / +envelope)':<48}{med(bpe):>14.1f}{med(bpe_env):>14.1f}"
          f"{'':>9}   (target <= 100)")
    report.add(f"replay wall time, {a.requests} requests, median of {a.repeat}", med(full), med(ref), unit="s",
               reference_name="same workers, null publisher, no advisor", better="lower", headline=True)
    report.add("advisor ingest (decode + journal + apply)", med(ingest), med(decode), unit="events/s",
               reference_name="decode only")
    report.add("bytes per event on the wire", med(bpe), unit="B/event", goal="<= 100", met=med(bpe) <= 100,
               better="lower")
    report.extra = {"full_s": full, "reference_s": ref, "ingest_per_s": ingest, "decode_per_s": decode,
                    "bytes_per_event_with_envelope": med(bpe_env)}
    report.write(a.json)


if __name__ == "__main__":
    main()
