"""REST API benchmark: concurrent clients against ``POST /query`` (indexer-compatible, token
ids) and ``POST /v1/lookup`` (sequence hashes) of one API process, beside the same lookups
called directly in-process (docs/BENCHMARKS.md, "REST API").

* server: a separate process (``--serve``) runs an index-only advisor and its API with an
  admin token (auth on, as deployed) on loopback; the advisor index holds ``--prefixes``
  chains of ``--blocks`` blocks at 4 worker locations, and the indexer index (loaded through
  ``POST /load``) the same prefixes as token blocks of 4 workers;
* clients: ``--procs`` processes, each with ``--concurrency`` httpx async requests in
  flight over keep-alive connections, for ``--seconds``; every request asks for one
  prefix (``--blocks`` blocks: 16 tokens each for ``/query``);
* reference: the same lookups called in this process without HTTP
  (``AdvisorQuery.lookup`` and ``WorkerIndex.overlap`` of the token hashes), one thread.

Printed: requests/s, p50 and p99 latency in ms, and ours (HTTP) / direct as a ratio.
Goal (docs/BENCHMARKS.md): ≥ 2,000 lookups/s at p99 ≤ 10 ms on one API process.

Run: ``python bench/api.py [--seconds 10] [--procs 2] [--concurrency 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import Report, add_json_option  # noqa: E402

TOKEN = "bench-admin-token-0123456789abcdef"
BS = 16
WORKERS = 4


def _prefix_tokens(i: int, blocks: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, 128_000) for _ in range(blocks * BS)]


def _prefix_hashes(i: int, blocks: int) -> list[int]:
    return [(i << 20 | j) + (1 << 63) for j in range(blocks)]


def _populate(svc: Any, registry: Any, prefixes: int, blocks: int) -> None:
    from api.token_hashes import chain_hashes, local_block_hashes
    from event_plane.schema import EventBatch, store

    for w in range(WORKERS):
        evs = []
        for i in range(w, prefixes, WORKERS):
            hs = _prefix_hashes(i, blocks)
            parent = None
            for h in hs:
                evs.append(store(h, hs[0], parent, 2048, "g1"))
                parent = h
        svc.ingest(EventBatch(1, f"w{w}", 5, 0, 100, evs))
    idx = registry.ensure_index("bench-model", "default", BS)
    for i in range(prefixes):
        local = local_block_hashes(_prefix_tokens(i, blocks), BS)
        idx.stored((i % WORKERS, 0), _prefix_hashes(i, blocks), None, local, "g1", chains=chain_hashes(local))


def serve(prefixes: int, blocks: int) -> None:
    """Server process: print the URL, serve until stdin closes."""
    from pydantic import SecretStr

    from advisor import AdvisorService, AdvisorSettings
    from api.app import create_app
    from api.auth import ApiSecuritySettings
    from api.indexer_registry import IndexerRegistry
    from api.server import serve_in_thread

    tmp = tempfile.mkdtemp(prefix="kvadvisor-bench-api-")
    svc = AdvisorService(AdvisorSettings(journal_path=os.path.join(tmp, "j.sqlite"), api_enabled=False))
    svc.start()
    registry = IndexerRegistry()
    _populate(svc, registry, prefixes, blocks)
    app = create_app(svc.query(), security=ApiSecuritySettings(admin_tokens=[SecretStr(TOKEN)]), registry=registry)
    handle = serve_in_thread(app, "127.0.0.1", 0)
    print(handle.url, flush=True)
    sys.stdin.read()
    handle.stop()
    svc.stop()


def _bodies(route: str, prefixes: int, blocks: int, n: int) -> list[bytes]:
    rng = random.Random(7)
    out = []
    for _ in range(n):
        i = rng.randrange(prefixes)
        if route == "/query":
            out.append(json.dumps({"token_ids": _prefix_tokens(i, blocks), "model_name": "bench-model"}).encode())
        else:
            out.append(json.dumps({"sequence_hashes": _prefix_hashes(i, blocks)}).encode())
    return out


def _client(args: tuple[str, str, list[bytes], int, float]) -> list[float]:
    url, route, bodies, concurrency, seconds = args
    import httpx

    async def run() -> list[float]:
        lat: list[float] = []
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30.0) as c:
            stop = time.perf_counter() + seconds

            async def worker(k: int) -> None:
                j = k
                while time.perf_counter() < stop:
                    t0 = time.perf_counter()
                    r = await c.post(route, content=bodies[j % len(bodies)])
                    lat.append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        raise RuntimeError(f"{route}: {r.status_code} {r.text[:200]}")
                    j += concurrency

            await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return lat

    return asyncio.run(run())


_WRK_LUA = """
local bodies = {}
for line in io.lines(os.getenv("KVADVISOR_BENCH_BODIES")) do bodies[#bodies + 1] = line end
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("KVADVISOR_BENCH_TOKEN")
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
done = function(summary, latency, requests)
  io.write(string.format("KV %d %d %d %d %d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), summary.errors.status))
end
"""


def _wrk(url: str, route: str, bodies: list[bytes], connections: int, seconds: float) -> tuple[float, float, float]:
    """``(requests/s, p50 ms, p99 ms)`` from wrk (one thread, ``connections`` keep-alive
    connections, each with one request in flight), every request a body of ``bodies``.

    Raises:
        RuntimeError: wrk failed or a response was not 200.
    """
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "bodies").write_bytes(b"\n".join(bodies) + b"\n")
        (Path(tmp) / "kv.lua").write_text(_WRK_LUA)
        env = dict(os.environ, KVADVISOR_BENCH_BODIES=str(Path(tmp) / "bodies"), KVADVISOR_BENCH_TOKEN=TOKEN)
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, int(seconds))}s", "-s",
                              str(Path(tmp) / "kv.lua"), url + route], capture_output=True, text=True, env=env,
                             timeout=seconds + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("KV ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed: {out.stdout[-500:]} {out.stderr[-500:]}")
    n, dur_us, p50_us, p99_us, bad = (int(x) for x in line.split()[1:])
    if bad:
        raise RuntimeError(f"{route}: {bad} responses were not 2xx/3xx")
    return n / (dur_us / 1e6), p50_us / 1000, p99_us / 1000


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def direct(route: str, prefixes: int, blocks: int, seconds: float) -> tuple[float, float, float]:
    """Same lookups called in-process; (calls/s, p50 ms, p99 ms)."""
    from advisor import AdvisorService, AdvisorSettings
    from api.indexer_registry import IndexerRegistry
    from api.token_hashes import local_block_hashes

    tmp = tempfile.mkdtemp(prefix="kvadvisor-bench-api-direct-")
    svc = AdvisorService(AdvisorSettings(journal_path=os.path.join(tmp, "j.sqlite"), api_enabled=False))
    svc.start()
    registry = IndexerRegistry()
    _populate(svc, registry, prefixes, blocks)
    q, idx = svc.query(), registry.index("bench-model", "default")
    assert idx is not None
    rng = random.Random(7)
    inputs = [rng.randrange(prefixes) for _ in range(1000)]
    toks = [_prefix_tokens(i, blocks) for i in inputs]
    hashes = [_prefix_hashes(i, blocks) for i in inputs]
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    k = 0
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        if route == "/query":
            idx.overlap(local_block_hashes(toks[k % 1000], BS))
        else:
            q.lookup(hashes[k % 1000])
        lat.append(time.perf_counter() - t0)
        k += 1
    svc.stop()
    return len(lat) / seconds, _pct(lat, 0.5), _pct(lat, 0.99)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--procs", type=int, default=2, help="client processes")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight per client process")
    ap.add_argument("--prefixes", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per prefix (and per lookup)")
    ap.add_argument("--client", choices=("auto", "wrk", "httpx"), default="auto",
                    help="load generator: wrk (C, one thread; --concurrency connections) or httpx "
                         "(--procs processes); auto = wrk when installed")
    add_json_option(ap)
    a = ap.parse_args()
    report = Report("api", "REST API lookups over HTTP (auth on) against the same lookups called in-process")
    client = a.client if a.client != "auto" else ("wrk" if shutil.which("wrk") else "httpx")
    if a.serve:
        serve(a.prefixes, a.blocks)
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--prefixes", str(a.prefixes), "--blocks",
                               str(a.blocks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        if not url.startswith("http"):
            raise SystemExit("server did not start")
        who = (f"wrk, 1 thread x {a.concurrency} connections" if client == "wrk"
               else f"httpx, {a.procs} client processes x {a.concurrency} in flight")
        print(f"API {url}: {who}, {a.seconds:.0f} s per route, {a.blocks} blocks per lookup, {os.cpu_count()} CPUs")
        print(f"{'route':<12} {'ours req/s':>11} {'p50 ms':>8} {'p99 ms':>8} | {'direct/s':>10} {'p50 ms':>8} "
              f"{'p99 ms':>8} | ours/direct")
        for route in ("/query", "/v1/lookup"):
            bodies = _bodies(route, a.prefixes, a.blocks, 1000)
            if client == "wrk":
                _wrk(url, route, bodies[:50], 2, 1.0)  # warm-up
                cpu0 = _cpu_s(server.pid)
                rate, p50, p99 = _wrk(url, route, bodies, a.concurrency, a.seconds)
                cpu = _cpu_s(server.pid) - cpu0
                count = rate * a.seconds
                per_client = count
            else:
                with mp.get_context("spawn").Pool(a.procs) as pool:
                    _client((url, route, bodies[:50], 2, 1.0))  # warm-up
                    cpu0 = _cpu_s(server.pid)
                    t0 = time.perf_counter()
                    parts = pool.map(_client, [(url, route, bodies, a.concurrency, a.seconds)] * a.procs)
                    wall = time.perf_counter() - t0
                    cpu = _cpu_s(server.pid) - cpu0
                lat = [x for p in parts for x in p]
                rate, p50, p99 = len(lat) / max(wall, a.seconds), _pct(lat, 0.5), _pct(lat, 0.99)
                count = len(lat)
                per_client = statistics.median(len(p) for p in parts)
            d_rate, d50, d99 = direct(route, a.prefixes, a.blocks, min(a.seconds, 5.0))
            print(f"{route:<12} {rate:>11,.0f} {p50:>8.2f} {p99:>8.2f} | {d_rate:>10,.0f} "
                  f"{d50:>8.3f} {d99:>8.3f} | {rate / d_rate:.3f}")
            print(f"  server CPU per request: {cpu / count * 1e6:,.0f} us -> one busy core would serve "
                  f"{count / cpu:,.0f} req/s")
            print(f"  goal >= 2,000 req/s at p99 <= 10 ms: {'met' if rate >= 2000 and p99 <= 10 else 'not met'}"
                  f" ({per_client:,.0f} requests per client)")
            report.add(f"{route} over HTTP ({who})", rate, d_rate, unit="req/s",
                       reference_name="the same lookups called in-process", goal=">= 2,000 req/s at p99 <= 10 ms",
                       met=rate >= 2000 and p99 <= 10, headline=route == "/query")
            report.add(f"{route} p99 latency", p99, d99, unit="ms", reference_name="in-process call",
                       better="lower")
            report.extra[route] = {"p50_ms": p50, "direct_p50_ms": d50, "server_cpu_us_per_request": cpu / count * 1e6}
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)
    report.write(a.json)


if __name__ == "__main__":
    main()
